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


def simulation_overrides(profile: str, num_supernodes: int, path: Path | None = None) -> str:
    """The ``flwr run --federation-config`` text that runs simulation
    profile ``profile`` of flower.toml (default: the project's) with
    ``num_supernodes`` nodes and the profile's own backend and resources
    per client. Flower's ``--federation-config`` replaces a profile's
    options whole: ``"num-supernodes=N"`` alone gives each client Flower's
    default 2 CPUs, which on a 2-core machine is one Ray worker for all
    clients."""
    profiles, _ = load_profiles(path or project_dir() / "flower.toml")
    if profile not in profiles:
        raise ValueError(f"no profile {profile!r} in flower.toml (profiles: {', '.join(sorted(profiles))})")
    backend = profiles[profile].get("options", {}).get("backend", {})
    parts = [f"num-supernodes={num_supernodes}"]
    if "name" in backend:
        parts.append(f"backend='{backend['name']}'")
    for key, value in backend.get("client-resources", {}).items():
        parts.append(f"client-resources-{key}={value}")
    return " ".join(parts)


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


def installed_connections() -> dict[str, dict[str, Any]]:
    """The SuperLink connections of $FLWR_HOME/config.toml, by name."""
    from flwr.cli.flower_config import read_flower_config

    config, _ = read_flower_config()
    return {k: v for k, v in config.get("superlink", {}).items() if isinstance(v, dict)}


def set_size(profile: str, num_supernodes: int) -> Path:
    """Set an installed simulation profile's ``num-supernodes`` in
    $FLWR_HOME/config.toml, keeping its other options (backend, CPU/GPU per
    client), which ``flwr run --federation-config "num-supernodes=N"`` drops."""
    from flwr.cli.flower_config import read_flower_config, write_flower_config

    if num_supernodes < 1:
        raise ValueError(f"the number of SuperNodes must be >= 1, got {num_supernodes}")
    config, _ = read_flower_config()
    profiles = {k: v for k, v in config.get("superlink", {}).items() if isinstance(v, dict)}
    if profile not in profiles:
        raise ValueError(f"profile {profile!r} is not installed (installed: {', '.join(sorted(profiles))}); "
                         "run fedaccel-federations install first")
    if profiles[profile].get("address") != ":local:":
        raise ValueError(f"profile {profile!r} is a real federation: it has as many clients as "
                         "SuperNodes connect to it (start more SuperNodes instead)")
    profiles[profile].setdefault("options", {})["num-supernodes"] = int(num_supernodes)
    return write_flower_config(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedaccel-federations", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("install", "show", "size", "stop-local"),
                        help="install the profiles, show them, set a simulation profile's number "
                             "of clients (size PROFILE N), or stop the local SuperLink that flwr run "
                             "leaves running")
    parser.add_argument("size_args", nargs="*", metavar="PROFILE N",
                        help="for size: the profile and its num-supernodes, e.g. local-simulation 100")
    parser.add_argument("--file", type=Path, default=project_dir() / "flower.toml",
                        help="profiles file (default: the project's flower.toml)")
    parser.add_argument("--no-default", action="store_true",
                        help="add the profiles but keep Flower's current default federation")
    args = parser.parse_args(argv)
    if args.action == "stop-local":
        from fedaccel.superlink import stop_local_superlink

        print(f"stopped {stop_local_superlink()} local SuperLink(s)")
        return 0
    if args.action == "size":
        if len(args.size_args) != 2 or not args.size_args[1].isdigit():
            parser.error("size needs a profile and a number, e.g. size local-simulation 100")
        try:
            written = set_size(args.size_args[0], int(args.size_args[1]))
        except ValueError as err:
            print(f"fedaccel-federations: error: {err}", file=sys.stderr)
            return 2
        print(f"{args.size_args[0]}: num-supernodes = {args.size_args[1]} in {written} "
              "(its other options kept)")
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
