"""``fedaccel-run``: the fast local runner.

Runs the project's ServerApp and ClientApp objects in one process on a
:class:`~fedaccel.local_grid.LocalGrid` (no Ray, no SuperLink), with exactly
the run-config keys of ``flwr run``::

    fedaccel-run algo='fedprox' num-server-rounds=20 fedprox.mu=0.1
    fedaccel-run --run-config "algo='fedadam' lr=0.1" --num-clients 50
    fedaccel-run --config experiment.yaml seed=3

Values use ``flwr run --run-config`` syntax (TOML); a bare word such as
``algo=fedavg`` is also accepted as a string. Unknown keys are rejected.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import tomli
import yaml
from flwr.common.config import flatten_dict, get_project_config, parse_config_args

DEFAULT_NUM_CLIENTS = 20  # the local-simulation profile's num-supernodes (flower.toml)


def project_dir() -> Path:
    """The folder holding this project's pyproject.toml."""
    return Path(__file__).resolve().parents[1]


def default_run_config(app_dir: Path | None = None) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the project, flattened to dotted keys."""
    app_dir = app_dir or project_dir()
    config = get_project_config(app_dir)
    return flatten_dict(config["tool"]["flwr"]["app"]["config"])


def _parse_value(text: str) -> Any:
    try:
        return tomli.loads(f"v = {text}")["v"]
    except tomli.TOMLDecodeError:
        return text  # bare word -> string, for convenience


def parse_overrides(tokens: list[str], run_config: str | None, yaml_file: str | None) -> dict[str, Any]:
    """Merge a YAML file, ``--run-config`` string and ``key=value`` tokens (later wins)."""
    out: dict[str, Any] = {}
    if yaml_file:
        with open(yaml_file, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"fedaccel-run: error: {yaml_file} must hold a mapping of run-config keys")
        out.update(flatten_dict(loaded))
    if run_config:
        out.update(parse_config_args([run_config]))
    for token in tokens:
        if "=" not in token:
            raise SystemExit(f"fedaccel-run: error: expected key=value, got {token!r}")
        key, value = token.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def fuse(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``overrides``; unknown keys are an error, as in flwr run."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        close = ", ".join(unknown)
        raise SystemExit(
            f"fedaccel-run: error: unknown run-config key(s) {close}; "
            f"the keys are those of [tool.flwr.app.config] in pyproject.toml (docs/config.md)")
    return {**defaults, **overrides}


def run_local(run_config: dict[str, Any], num_clients: int = DEFAULT_NUM_CLIENTS,
              quiet: bool = False, verbose: bool = False) -> Path:
    """Run the project's ServerApp and ClientApp in-process; returns the run folder.

    User errors (bad config, missing data...) raise ``SystemExit`` with one
    line, exactly as the ServerApp ends a ``flwr run``.
    """
    import logging
    import os

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER

    from apps.client_app import app as client_app, prepare_clients
    from clients.state import state_run_dir
    from apps.server_app import app as server_app
    from fedaccel.local_grid import LocalGrid

    previous_level = FLOWER_LOGGER.level
    if not verbose:
        FLOWER_LOGGER.setLevel(logging.WARNING)
    grid = LocalGrid(client_app, run_config, num_clients, seed=int(run_config.get("seed", 0)))
    prepare_clients(list(grid.contexts.values()))  # every client's tensors before round 1
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    previous = os.environ.get("FEDACCEL_QUIET")
    os.environ["FEDACCEL_QUIET"] = "1" if quiet else "0"
    try:
        server_app(grid, context)
    finally:
        shutil.rmtree(state_run_dir(str(run_config.get("state-dir", "")), grid.run.run_id),
                      ignore_errors=True)
        FLOWER_LOGGER.setLevel(previous_level)  # the caller's logging is not ours to change
        if previous is None:
            del os.environ["FEDACCEL_QUIET"]
        else:
            os.environ["FEDACCEL_QUIET"] = previous
    from fedaccel.experiment import last_run_dir

    return last_run_dir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fedaccel-run",
        description="Run a fedaccel experiment in one process (no Ray), with flwr run's run-config keys.",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run-config overrides, e.g. algo='fedprox' fedprox.mu=0.1")
    parser.add_argument("--run-config", help="overrides as one string, exactly as for flwr run")
    parser.add_argument("--config", help="a YAML file of run-config keys (nested tables allowed)")
    parser.add_argument("--num-clients", type=int, default=DEFAULT_NUM_CLIENTS,
                        help=f"simulated clients (default {DEFAULT_NUM_CLIENTS}, as local-simulation)")
    parser.add_argument("--list", action="store_true", help="list the algorithms and exit")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    parser.add_argument("--verbose", action="store_true", help="show Flower's own INFO logs")
    args = parser.parse_args(argv)

    if args.list:
        from fedaccel.registry import describe

        for name, summary in describe():
            print(f"{name:12s} {summary}")
        return 0
    if args.num_clients < 1:
        parser.error("--num-clients must be >= 1")

    run_config = fuse(default_run_config(), parse_overrides(args.overrides, args.run_config, args.config))
    try:
        run_local(run_config, num_clients=args.num_clients, quiet=args.quiet, verbose=args.verbose)
    except SystemExit as err:  # the ServerApp's one-line user error
        if err.code not in (0, None):
            print(f"fedaccel-run: error: {err.code}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
