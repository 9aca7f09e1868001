"""Is the process a file names still the one that wrote it?

Run folders (``status.json``), studies (``plan.json``) and the dashboard's
launch records name the process that runs them by pid. A pid outlives its
process: after a kill, an out-of-memory end or a reboot, the same number can
belong to an unrelated process (a shell, a notebook). So the records keep the
process's start time too (Linux: ``/proc/<pid>/stat``, in clock ticks since
boot), and a pid only counts as the same process when its start time matches.
Written by hand: psutil would do it, but is not a dependency of the project.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None where
    ``/proc`` cannot tell (not Linux, or no such process)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[19])  # field 22 of stat(5); fields here start at field 3
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` runs (an exited child not yet reaped, a
    zombie, has ended) and, when ``start`` is given and ``/proc`` can tell,
    is the process that started then (not a later one with the same pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, but see its start time
        pass
    try:  # Linux: the state after the command name in /proc/<pid>/stat
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        return True
    now = process_start(pid)
    return start is None or now is None or now == start
