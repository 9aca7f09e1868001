"""The runs the dashboard lists: every run folder under the results roots.

A run folder is one holding ``config.json`` and ``metrics.jsonl`` (written by
:class:`fedaccel.results.RunRecorder`, whichever runner or engine ran it);
its ``status.json`` says whether it is running. Nothing here is a second
bookkeeping: every value is read from those files when asked.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from fedaccel.processes import record_alive
from fedaccel.results import (CONFIG_FILE, METRICS_FILE, STOP_FILE, SUMMARY_FILE, load_rows, load_status,
                              progress_line, recorded_state, summarize)

#: how deep under a root run folders are looked for (sweeps: root/study/cells/run)
MAX_DEPTH = 4
#: what a run's console output is captured to when the dashboard launched it
CONSOLE_FILE = "console.log"
#: what the dashboard wrote when it launched a run: argv, engine, overrides, pid
LAUNCH_FILE = "launch.json"
# STOP_FILE (fedaccel.results): written when the dashboard asked a run to stop


@dataclass(frozen=True)
class RunRef:
    """Where one run lives: root number and its path under that root (its id)."""

    root: int
    rel: str

    @property
    def id(self) -> str:
        return f"{self.root}/{self.rel}"


def is_run_dir(path: Path) -> bool:
    """A run's folder: recorded by a run, or launched by the dashboard (a
    launched run that fails before its first file shows with its console)."""
    return ((path / CONFIG_FILE).is_file() and (path / METRICS_FILE).is_file()) or (path / LAUNCH_FILE).is_file()


def _mtime(path: Path) -> float:
    for name in (METRICS_FILE, LAUNCH_FILE):
        try:
            return (path / name).stat().st_mtime
        except OSError:
            pass
    return 0.0


def load_launch(path: Path) -> dict | None:
    try:
        launch = json.loads((path / LAUNCH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return launch if isinstance(launch, dict) else None


def console_tail(path: Path, n: int) -> list[str]:
    try:
        with open(path / CONSOLE_FILE, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-n:]]
    except OSError:
        return []


def find_runs(roots: list[Path]) -> Iterator[tuple[RunRef, Path]]:
    """Every run folder under the roots, newest first within a root."""
    for i, root in enumerate(roots):
        found: list[Path] = []
        stack = [(root, 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                children = [c for c in folder.iterdir() if c.is_dir() and not c.name.startswith(".")]
            except OSError:
                continue
            for child in children:
                if is_run_dir(child):
                    found.append(child)
                elif depth + 1 < MAX_DEPTH and child.name != "checkpoints":
                    stack.append((child, depth + 1))
        found.sort(key=_mtime, reverse=True)
        for path in found:
            yield RunRef(i, path.relative_to(root).as_posix()), path


def resolve(roots: list[Path], run_id: str, is_folder: Callable[[Path], bool] = is_run_dir) -> Path | None:
    """The folder of ``run_id`` (``<root>/<relative path>``) when ``is_folder``
    says it is one (a run's; a study's for studies.py), or None; never a path
    outside the roots."""
    head, _, rel = run_id.partition("/")
    if not head.isdigit() or int(head) >= len(roots) or not rel:
        return None
    root = roots[int(head)].resolve()
    path = (root / rel).resolve()
    if root not in path.parents or not is_folder(path):
        return None
    return path


def run_state(path: Path, status: dict | None, launch: dict | None = None) -> tuple[str, str | None]:
    """``running``, ``finished``, ``failed``, ``stopped``, ``starting`` (the
    dashboard launched it; it has not recorded a round yet), ``interrupted``
    (its process died without a word) or ``unknown`` (no status.json), and
    the one-line error of a run that ended early."""
    if status is None:
        if (path / SUMMARY_FILE).is_file():
            return "finished", None
        if launch is None:
            return "unknown", None
        if record_alive(launch):
            return "starting", None
        if (path / STOP_FILE).is_file():  # stopped while it started, before it recorded anything
            return "stopped", "stopped from the dashboard before its first round"
        last = [line for line in console_tail(path, 20) if line.strip()]
        errors = [line for line in last if "error" in line.lower()]
        return "failed", (errors or last or ["the run ended before its first round"])[-1]
    return recorded_state(path, status)


def _seconds_per_round(rows: list[dict]) -> float | None:
    secs = [r["seconds"] for r in rows if isinstance(r.get("seconds"), (int, float))]
    return statistics.fmean(secs[-10:]) if secs else None


def _last(rows: list[dict], key: str) -> float | None:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def _read(path: Path, launch: dict | None) -> tuple[dict, list[dict]]:
    """A run's config and rows: recorded ones, or what the dashboard launched
    it with while it has recorded nothing (OSError/ValueError if unreadable)."""
    if (path / CONFIG_FILE).is_file():
        return json.loads((path / CONFIG_FILE).read_text(encoding="utf-8")), load_rows(path / METRICS_FILE)
    return {**(launch or {}).get("run-config", {})}, []


def run_overview(ref: RunRef, path: Path, read: tuple[dict, list[dict]] | None = None) -> dict[str, Any]:
    """One row of the runs table, read from the run's files now (``read``:
    its config and rows, when the caller has read them already)."""
    launch = load_launch(path)
    try:
        config, rows = read or _read(path, launch)
    except (OSError, ValueError) as err:
        return {"id": ref.id, "name": path.name, "state": "unreadable", "error": str(err)}
    status = load_status(path)
    state, error = run_state(path, status, launch)
    total = int(config.get("num-server-rounds") or (status or {}).get("num_rounds") or 0)
    done = rows[-1]["round"] if rows else 0
    per_round = _seconds_per_round(rows)
    eta = per_round * (total - done) if state == "running" and per_round is not None else None
    return {
        "id": ref.id, "name": path.name, "path": str(path),
        "algo": config.get("algo"), "dataset": config.get("dataset"), "seed": config.get("seed"),
        "state": state, "round": done, "rounds": total,
        "accuracy": _last(rows, "accg"), "loss": _last(rows, "loss"),
        "seconds_per_round": per_round, "eta_seconds": eta,
        "engine": (status or {}).get("engine") or (launch or {}).get("engine"),
        "flower_run_id": (status or {}).get("run_id"), "error": error,
        "updated": _mtime(path),
    }


def run_detail(ref: RunRef, path: Path, log_lines: int = 40) -> dict[str, Any]:
    """Everything the run page shows: the overview, the config, every row,
    the summary so far and the log tail."""
    try:
        config, rows = _read(path, load_launch(path))
    except (OSError, ValueError):
        return run_overview(ref, path)  # says unreadable, and why
    overview = run_overview(ref, path, (config, rows))
    target = config.get("target-accuracy")
    summary = summarize(rows, float(target)) if isinstance(target, (int, float)) and rows else None
    return {**overview, "config": config, "rows": rows, "summary": summary,
            "log": log_tail(path, rows, overview, log_lines)}


def log_tail(path: Path, rows: list[dict], overview: dict, n: int) -> list[str]:
    """The last ``n`` lines of the run's console (when the dashboard captured
    it), else its progress lines rebuilt from ``metrics.jsonl`` as
    ``fedaccel-run`` prints them, and the error of a failed run."""
    if (path / CONSOLE_FILE).is_file():
        return console_tail(path, n)
    lines = [progress_line(row, overview.get("rounds") or len(rows)) for row in rows[-n:]]
    if overview.get("error"):
        lines.append(f"[fedaccel] {overview['state']}: {overview['error']}")
    return lines


def snapshot(roots: list[Path]) -> list[dict[str, Any]]:
    """Every run's overview, for the runs table and its live updates."""
    return [run_overview(ref, path) for ref, path in find_runs(roots)]


def fingerprint(roots: list[Path]) -> tuple:
    """Changes when any run's metrics or status change (what live updates watch)."""
    out = []
    for ref, path in find_runs(roots):
        for name in (METRICS_FILE, "status.json", LAUNCH_FILE, CONSOLE_FILE):
            try:
                st = (path / name).stat()
                out.append((ref.id, name, st.st_mtime_ns, st.st_size))
            except OSError:
                pass
    out.append(int(time.time() // 5))  # and every 5 s: a dead process shows as interrupted
    return tuple(out)
