"""Flower runs on a SuperLink, listed from Flower's own Control API.

The same calls as ``flwr ls --format json`` (flwr.cli.ls): the connection
from ``$FLWR_HOME/config.toml``, Flower's HTTP Control client, ``ListRuns``,
and Flower's own row formatting. A ``:local:`` connection is only asked when
its local SuperLink already runs: listing must not start one (``flwr ls``
would).
"""

from __future__ import annotations

import json
from typing import Any

from fedaccel.superlink import local_superlink_pids


def flower_runs(connection: str | None = None) -> dict[str, Any]:
    """``{"connection", "runs": [...flwr ls json rows...]}``, or ``{"connection",
    "runs": [], "note": why none were asked for}``, or ``{"error": ...}``."""
    try:
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.ls import _list_runs, _to_json  # what `flwr ls --format json` prints
        from flwr.cli.utils import init_http_client_from_connection

        conn = read_superlink_connection(connection)
    except Exception as err:  # no Flower config, unknown name: say so, in one line
        return {"connection": connection, "runs": [], "error": _one_line(err)}
    name = connection or getattr(conn, "name", None) or "default"
    if str(getattr(conn, "address", "")) == ":local:" and not local_superlink_pids():
        return {"connection": name, "runs": [],
                "note": "no local SuperLink is running (flwr run starts one)"}
    client = None
    try:
        client = init_http_client_from_connection(conn)
        rows = json.loads(_to_json(_list_runs(client)))["runs"]
    except BaseException as err:  # flwr's CLI helpers exit (typer.Exit) on errors
        if isinstance(err, KeyboardInterrupt):
            raise
        return {"connection": name, "runs": [], "error": _one_line(err)}
    finally:
        if client is not None:
            client.close()
    return {"connection": name, "runs": rows}


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip(": ")
