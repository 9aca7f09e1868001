"""fedaccel ServerApp (Flower Message API).

Reads the run config, learns which partition each node holds, builds the
algorithm's strategy from the registry and runs it; results go to
``results-dir/run-name/``. A user error (bad config, missing data files, too
few nodes) ends the run as *failed* in ``flwr ls`` and shows in ``flwr log``
as one line, not a traceback.
"""

from __future__ import annotations

import logging
import os
from logging import WARNING

from flwr.app import ConfigRecord, Context
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import Grid, ServerApp

from fedaccel.errors import USER_ERRORS
from fedaccel.experiment import run_experiment

app = ServerApp()

# What a caller that runs the ServerApp itself (the fast runner) passes and
# gets back, through Flower's own Context rather than process-wide state:
QUIET = "fedaccel-quiet"  # node_config key: true = no per-round progress lines
RESULTS = "fedaccel.results"  # context.state ConfigRecord: {"run-dir": the results folder}


class OneLineUserErrors(logging.Filter):
    """Show a user error that ends a run as one line in Flower's log.

    Flower marks a run failed only when the ServerApp raises (a ``SystemExit``
    is listed as completed), and it logs what was raised with its traceback
    ("ServerApp raised an exception" on a SuperLink, "Simulation raised an
    exception" under Ray). For our user errors this filter drops the traceback
    and puts the message in the line. Flower has no hook for this; a logging
    filter on its logger is the least intrusive way.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        if isinstance(err, USER_ERRORS):
            entity = record.args[0] if isinstance(record.args, tuple) and record.args else "ServerApp"
            record.msg, record.args = "%s stopped: [fedaccel] %s", (entity, err)
            record.exc_info = record.exc_text = None
        return True


def install_one_line_user_errors() -> None:
    if not any(isinstance(f, OneLineUserErrors) for f in FLOWER_LOGGER.filters):
        FLOWER_LOGGER.addFilter(OneLineUserErrors())


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run one experiment with the run config given to ``flwr run``."""
    if "runtime-envs" in os.environ.get("VIRTUAL_ENV", ""):
        log(WARNING, "[fedaccel] Flower installed this app's dependencies for this run with "
            "`uv sync` (torch included: slow, and a CUDA build). Stop the local SuperLink "
            "(fedaccel-federations stop-local) and start runs with "
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 (scripts/install.sh sets it in .venv).")
    try:
        run_dir = run_experiment(grid, dict(context.run_config),
                                 quiet=bool(context.node_config.get(QUIET, False)))
        context.state[RESULTS] = ConfigRecord({"run-dir": str(run_dir)})
    except USER_ERRORS as err:
        install_one_line_user_errors()
        raise err.with_traceback(None) from None
