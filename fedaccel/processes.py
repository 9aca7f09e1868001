"""Is the process a file names still the one that wrote it?

Run folders (``status.json``), studies (``plan.json``) and the dashboard's
launch records name the process that runs them by pid. A pid outlives its
process: after a kill, an out-of-memory end or a reboot, the same number can
belong to an unrelated process (a shell, a notebook). So the records keep the
process's start time too (Linux: ``/proc/<pid>/stat``, in clock ticks since
boot), and a pid only counts as the same process when its start time matches.
Written by hand: psutil would do it, but is not a dependency of the project.

A run is stopped by SIGINT: Ctrl-C, the dashboard's stop button, a sweep's
stop. :func:`stop_on_sigint` makes that reliable (see there).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: set by whoever starts a run that must stop on SIGINT although it may have
#: inherited SIGINT ignored (the dashboard's launches: a dashboard started as
#: a script's background job ignores SIGINT, and so would every run it starts)
SIGINT_STOPS_ENV = "FEDACCEL_SIGINT_STOPS"

_stop = threading.Event()


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None where
    ``/proc`` cannot tell (not Linux, or no such process)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[19])  # field 22 of stat(5); fields here start at field 3
    except (OSError, IndexError, ValueError):
        return None


def process_record(pid: int | None = None) -> dict:
    """``{"pid", "pid_start", "host"}`` of process ``pid`` (default: this
    one), as the records that name a process keep it."""
    import socket

    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "pid_start": process_start(pid), "host": socket.gethostname()}


def record_alive(record: dict | None) -> bool:
    """Whether the process a record names (:func:`process_record`'s keys)
    runs on this host and is still the one that started then."""
    import socket

    pid = (record or {}).get("pid")
    return (isinstance(pid, int) and record.get("host") == socket.gethostname()
            and pid_alive(pid, record.get("pid_start")))


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


def _on_sigint(signum: int, frame: object) -> None:
    _stop.set()
    raise KeyboardInterrupt


@contextmanager
def stop_on_sigint() -> Iterator[None]:
    """While inside, SIGINT stops the run: it raises KeyboardInterrupt, as
    Python's own handler does, and also sets a flag that the round loop
    checks (:func:`raise_if_stop_requested`), so the run stops at the end of
    the current round even where the exception was swallowed (Python drops
    exceptions raised in finalizers and some callbacks: "Exception ignored").

    SIGINT inherited as ignored (a background job of a script, which must
    survive the terminal's Ctrl-C) stays ignored, unless the environment says
    the starter wants SIGINT to stop this process (:data:`SIGINT_STOPS_ENV`,
    set by the dashboard for the processes it launches in their own session).
    The previous handler is restored on the way out. Nested (a sweep's cell
    in the sweep's process), or outside the main thread (where Python runs no
    signal handler), it changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if (previous is _on_sigint or threading.current_thread() is not threading.main_thread()
            or (previous is signal.SIG_IGN and os.environ.get(SIGINT_STOPS_ENV) != "1")):
        yield
        return
    _stop.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _stop.clear()


def raise_if_stop_requested() -> None:
    """KeyboardInterrupt if a SIGINT arrived under :func:`stop_on_sigint`
    (called by the round loop at the end of every round)."""
    if _stop.is_set():
        raise KeyboardInterrupt
