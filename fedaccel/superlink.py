"""Find and stop the local SuperLink that ``flwr run`` leaves running.

With a ``:local:`` federation, ``flwr run`` starts a detached
``flower-superlink --simulation`` (plus its ``flower-superexec`` child) and
never stops it. Flower has no command for that, so this module does it for
scripts and tests: it matches the processes by command line (the local
Control API port, ``FLWR_LOCAL_CONTROL_API_PORT``, default 39093) and
terminates their process groups. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def local_control_port() -> str:
    """The Control API port ``flwr run`` uses for its local SuperLink."""
    return os.environ.get("FLWR_LOCAL_CONTROL_API_PORT", "39093")


def local_superlink_pids(control_port: str | None = None) -> list[int]:
    """PIDs of local simulation SuperLinks listening on ``control_port``."""
    port = control_port or local_control_port()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmd = _cmdline(int(entry.name))
        if any(c.endswith("flower-superlink") for c in cmd) and "--simulation" in cmd \
                and f"127.0.0.1:{port}" in cmd:
            pids.append(int(entry.name))
    return pids


def stop_local_superlink(control_port: str | None = None, timeout: float = 10.0) -> int:
    """Terminate local SuperLinks (and their children); returns how many were found."""
    roots = local_superlink_pids(control_port)
    groups: set[int] = set()
    for root in roots:
        stack = [root]
        while stack:
            pid = stack.pop()
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
            stack.extend(_children(pid))
    groups.discard(os.getpgid(0))  # never our own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive_group(g) for g in groups):
            time.sleep(0.2)
        if not any(_alive_group(g) for g in groups):
            break
    return len(roots)


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies count as gone.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == pgid and fields[0] != "Z":
                return True
    return False
