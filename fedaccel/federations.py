"""``fedaccel-federations``: install flower.toml's profiles into Flower's config.

Flower reads federations (SuperLink connections) only from
``$FLWR_HOME/config.toml``. This command merges the ``[superlink.<name>]``
profiles of the project's ``flower.toml`` into it with Flower's own reader
and writer, keeps every other connection, resolves relative certificate paths
against the project folder, and (unless ``--no-default``) makes
``local-simulation`` the default so that ``flwr run .`` uses it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import tomli

from fedaccel.local_run import project_dir


def load_profiles(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(profiles by name, default name) from a flower.toml file."""
    with path.open("rb") as f:
        doc = tomli.load(f)
    superlink = doc.get("superlink", {})
    profiles = {k: v for k, v in superlink.items() if isinstance(v, dict)}
    default = superlink.get("default")
    for name, profile in profiles.items():
        cert = profile.get("root-certificates")
        if cert and not Path(cert).is_absolute():
            profile["root-certificates"] = str((path.parent / cert).resolve())
        if "address" not in profile:
            raise SystemExit(f"fedaccel-federations: error: profile {name!r} in {path} has no address")
    return profiles, default


def install(path: Path, set_default: bool = True) -> Path:
    """Merge the profiles into $FLWR_HOME/config.toml; returns that file's path."""
    from flwr.cli.flower_config import read_flower_config, write_flower_config

    profiles, default = load_profiles(path)
    config, _ = read_flower_config()
    superlink = config.setdefault("superlink", {})
    superlink.update(profiles)
    if set_default and default:
        superlink["default"] = default
    return write_flower_config(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedaccel-federations", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("install", "show", "stop-local"),
                        help="install the profiles, show them, or stop the local SuperLink "
                             "that flwr run leaves running")
    parser.add_argument("--file", type=Path, default=project_dir() / "flower.toml",
                        help="profiles file (default: the project's flower.toml)")
    parser.add_argument("--no-default", action="store_true",
                        help="add the profiles but keep Flower's current default federation")
    args = parser.parse_args(argv)
    if args.action == "stop-local":
        from fedaccel.superlink import stop_local_superlink

        print(f"stopped {stop_local_superlink()} local SuperLink(s)")
        return 0
    if not args.file.is_file():
        print(f"fedaccel-federations: error: {args.file} not found", file=sys.stderr)
        return 2
    if args.action == "show":
        profiles, default = load_profiles(args.file)
        for name, profile in profiles.items():
            mark = " (default)" if name == default else ""
            print(f"{name}{mark}: {profile}")
        return 0
    written = install(args.file, set_default=not args.no_default)
    print(f"installed federation profiles from {args.file} into {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
