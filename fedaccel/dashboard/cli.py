"""``fedaccel-dashboard``: the dashboard on http://127.0.0.1:8765.

    fedaccel-dashboard                      # the runs under ./results
    fedaccel-dashboard results other/runs   # several results folders; launches go to the first
    fedaccel-dashboard --host 0.0.0.0       # reachable from other machines: needs a token

Off localhost a token is required (``--token``, ``$FEDACCEL_DASHBOARD_TOKEN``
or a random one); the URL printed at start carries it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import sys
from pathlib import Path

PROG = "fedaccel-dashboard"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Watch, compare and launch fedaccel runs in a browser.")
    parser.add_argument("results", nargs="*", default=["results"],
                        help="results folders to list runs from (default: results); launched runs go to the first")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    parser.add_argument("--token", default=os.environ.get("FEDACCEL_DASHBOARD_TOKEN"),
                        help="required on every request; off localhost one is made up if not given")
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("plotly") is None:
        print(f"{PROG}: error: the dashboard needs plotly: pip install 'fedaccel[dashboard]' "
              "(or bash scripts/install.sh)", file=sys.stderr)
        return 2
    roots = [Path(r).expanduser().resolve() for r in args.results]
    for root in roots:
        if root.exists() and not root.is_dir():
            print(f"{PROG}: error: {root} is a file, not a results folder", file=sys.stderr)
            return 2
    try:
        roots[0].mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"{PROG}: error: cannot create {roots[0]} ({err.strerror or err}); pass a writable results folder",
              file=sys.stderr)
        return 3
    token = args.token
    if not _is_loopback(args.host) and not token:
        token = secrets.token_urlsafe(24)
    import uvicorn

    from fedaccel.dashboard.app import create_app

    app = create_app(roots, token=token, allowed_hosts=(args.host,) if args.host not in ("0.0.0.0", "::") else ())
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown}:{args.port}/" + (f"?token={token}" if token else "")
    print(f"{PROG}: runs under {', '.join(map(str, roots))}; open {url}", flush=True)
    if args.host in ("0.0.0.0", "::"):
        print(f"{PROG}: bound to every address: start it with --host <this machine's name or address> "
              "so that other machines' requests are accepted", flush=True)
    try:
        # open live-update streams must not hold Ctrl-C up
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    except OSError as err:
        print(f"{PROG}: error: cannot listen on {args.host}:{args.port} ({err.strerror or err}); "
              "choose another --port", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
