"""fedaccel ServerApp (Flower Message API).

Reads the run config, learns which partition each node holds, builds the
algorithm's strategy from the registry and runs it; results go to
``results-dir/run-name/``. User errors (bad config, missing data files, too
few nodes) end the run with one clear line instead of a traceback.
"""

from __future__ import annotations

import os
from logging import ERROR, WARNING

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedaccel.errors import USER_ERRORS
from fedaccel.experiment import run_experiment

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment with the run config given to ``flwr run``."""
    if "runtime-envs" in os.environ.get("VIRTUAL_ENV", ""):
        log(WARNING, "[fedaccel] Flower installed this app's dependencies for this run with "
            "`uv sync` (torch included: slow, and a CUDA build). Stop the local SuperLink "
            "(fedaccel-federations stop-local) and start runs with "
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 (scripts/install.sh sets it in .venv).")
    try:
        run_experiment(grid, dict(context.run_config))
    except USER_ERRORS as err:
        log(ERROR, "[fedaccel] %s", err)
        raise SystemExit(f"[fedaccel] {err}") from None
