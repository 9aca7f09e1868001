"""The studies the dashboard lists: every ``fedaccel-sweep`` folder under the
results roots, read from what the sweep writes (``plan.json``: its cells,
its study file and the process running it; ``cells/<cell>/``: normal run
folders). The table over seeds is :func:`fedaccel.compare.groups_table`,
the one ``fedaccel-compare --group-seeds`` and the sweep's report print.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterator

from fedaccel.compare import group_by_seed, groups_table, load_runs, target_note
from fedaccel.dashboard.runs import RunRef, console_tail, is_run_dir, resolve, run_overview
from fedaccel.processes import record_alive
from fedaccel.results import load_status, run_finished

PLAN_FILE = "plan.json"
#: what the dashboard wrote when it launched a study (not launch.json: that marks a run folder)
STUDY_LAUNCH_FILE = "sweep-launch.json"
CELLS = "cells"
REPORT = "report"
#: how deep under a root study folders are looked for (root/sweeps/<name>)
MAX_DEPTH = 3


def is_study_dir(path: Path) -> bool:
    """A study's folder: its sweep wrote ``plan.json``, or the dashboard
    launched it (a sweep that fails before its plan shows with its console)."""
    return (path / PLAN_FILE).is_file() or (path / STUDY_LAUNCH_FILE).is_file()


def _mtime(path: Path) -> float:
    return max((p.stat().st_mtime for p in (path / PLAN_FILE, path / STUDY_LAUNCH_FILE) if p.is_file()),
               default=0.0)


def find_studies(roots: list[Path]) -> Iterator[tuple[RunRef, Path]]:
    """Every study folder under the roots, newest first within a root."""
    for i, root in enumerate(roots):
        found = {p.parent for depth in range(1, MAX_DEPTH + 1) for name in (PLAN_FILE, STUDY_LAUNCH_FILE)
                 for p in root.glob("/".join(["*"] * depth) + "/" + name)}
        for path in sorted(found, key=_mtime, reverse=True):
            yield RunRef(i, path.relative_to(root).as_posix()), path


def resolve_study(roots: list[Path], study_id: str) -> Path | None:
    """The folder of ``study_id`` (``<root>/<relative path>``), never outside the roots."""
    return resolve(roots, study_id, is_study_dir)


def _read_object(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def load_plan(path: Path) -> dict[str, Any]:
    return _read_object(path / PLAN_FILE)


def study_file_of(path: Path, plan: dict[str, Any] | None = None) -> str | None:
    """The study file the study was run (or launched here) from."""
    plan = load_plan(path) if plan is None else plan
    return plan.get("study-file") or _read_object(path / STUDY_LAUNCH_FILE).get("study-file")


def sweep_process(path: Path, plan: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The live process that runs this study here (the sweep's own record in
    ``plan.json``, or the dashboard's launch), or None."""
    plan = load_plan(path) if plan is None else plan
    launch = _read_object(path / STUDY_LAUNCH_FILE)
    return next((r for r in (plan, launch) if record_alive(r)), None)


def _cell_seconds(cell_dir: Path) -> float | None:
    status = load_status(cell_dir) or {}
    started, updated = status.get("started"), status.get("updated")
    if status.get("state") == "finished" and isinstance(started, (int, float)) and isinstance(updated, (int, float)):
        return float(updated) - float(started)
    return None


def study_cells(ref: RunRef, path: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cell the study has now: its run's overview, or ``pending``."""
    names = plan.get("current") or sorted(plan.get("cells") or {})
    out = []
    for name in names:
        cell_dir = path / CELLS / name
        if is_run_dir(cell_dir):
            out.append(run_overview(RunRef(ref.root, f"{ref.rel}/{CELLS}/{name}"), cell_dir))
        else:
            out.append({"id": None, "name": name, "state": "pending", "round": 0,
                        "rounds": (plan.get("cells", {}).get(name) or {}).get("num-server-rounds")})
    return out


def study_state(cells: list[dict[str, Any]], process: dict[str, Any] | None) -> str:
    """``running`` (its process is alive here), ``finished`` (every cell),
    else how it ended: ``stopped``, ``failed`` (a cell did, or the sweep
    before it planned any) or ``interrupted``."""
    if process is not None:
        return "running"
    if not cells:
        return "failed"
    states = [c["state"] for c in cells]
    if states and all(s == "finished" for s in states):
        return "finished"
    for state in ("stopped", "failed"):
        if state in states:
            return state
    return "interrupted"


def study_overview(ref: RunRef, path: Path, cells: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One row of the studies table."""
    plan = load_plan(path)
    launch = _read_object(path / STUDY_LAUNCH_FILE)
    cells = study_cells(ref, path, plan) if cells is None else cells
    process = sweep_process(path, plan)
    # launched here after its last plan, and gone: the sweep refused to start (its console says why)
    refused = process is None and float(launch.get("started") or 0) > float(plan.get("started") or 0)
    state = "failed" if refused else study_state(cells, process)
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell["state"]] = counts.get(cell["state"], 0) + 1
    done = counts.get("finished", 0)
    took = [s for s in (_cell_seconds(path / CELLS / c["name"]) for c in cells if c["state"] == "finished")
            if s is not None]
    running = max(1, counts.get("running", 0))
    eta = (statistics.fmean(took) * (len(cells) - done) / running
           if state == "running" and took and done < len(cells) else None)
    error = None
    if refused or (state == "failed" and not cells):  # ended before it planned: its console says why
        said = [line for line in console_tail(path, 20) if line.strip()]
        error = next((line for line in reversed(said) if "error" in line.lower()),
                     said[-1] if said else "the sweep ended before it planned its cells")
    return {"id": ref.id, "name": path.name, "path": str(path), "state": state, "error": error,
            "cells": len(cells), "finished": done, "counts": counts,
            "study_file": plan.get("study-file") or launch.get("study-file"),  # as study_file_of
            "num_clients": plan.get("num-clients"),
            "eta_seconds": eta, "pid": (process or {}).get("pid")}


def study_detail(ref: RunRef, path: Path, log_lines: int = 40) -> dict[str, Any]:
    """The study page: overview, every cell, the table over seeds of the
    finished cells (fedaccel-compare's) and each group's mean curve."""
    plan = load_plan(path)
    cells = study_cells(ref, path, plan)
    out = {**study_overview(ref, path, cells), "cell_rows": cells, "groups_table": None, "series": [],
           "report": sorted(p.name for p in (path / REPORT).glob("*")) if (path / REPORT).is_dir() else [],
           "log": console_tail(path, log_lines)}
    finished = [path / CELLS / c["name"] for c in cells if run_finished(path / CELLS / c["name"])]
    if finished:
        try:
            groups = group_by_seed(load_runs(finished))
        except (OSError, ValueError) as err:
            out["error"] = str(err)
            return out
        out["groups_table"] = groups_table(groups)
        out["note"] = target_note([r for g in groups for r in g.runs], None)
        out["series"] = [{"label": g.label, "seeds": g.seeds, **mean_curve([r.rows for r in g.runs])}
                         for g in groups]
    return out


def mean_curve(runs: list[list[dict]], key: str = "accg") -> dict[str, list]:
    """Per round, the mean and standard deviation over runs of ``key`` (rounds
    where every run has it)."""
    by_round: dict[int, list[float]] = {}
    for rows in runs:
        for row in rows:
            if isinstance(row.get(key), (int, float)):
                by_round.setdefault(row["round"], []).append(float(row[key]))
    rounds = [r for r in sorted(by_round) if len(by_round[r]) == len(runs)]
    return {"rounds": rounds, "mean": [statistics.fmean(by_round[r]) for r in rounds],
            "std": [statistics.stdev(by_round[r]) if len(runs) > 1 else 0.0 for r in rounds]}


def study_files(project: Path) -> list[dict[str, str]]:
    """The study files a project ships (``configs/studies/*.yaml``), for the launch form."""
    folder = project / "configs" / "studies"
    return [{"file": str(p), "name": p.relative_to(project).as_posix()}
            for p in sorted(folder.glob("*.y*ml")) if p.is_file()]


def fingerprint(roots: list[Path]) -> tuple:
    """Changes when a study's plan, launch or console changes (its cells'
    files are watched as runs)."""
    out = []
    for ref, path in find_studies(roots):
        for name in (PLAN_FILE, STUDY_LAUNCH_FILE, "console.log"):
            try:
                st = (path / name).stat()
                out.append((ref.id, name, st.st_mtime_ns, st.st_size))
            except OSError:
                pass
    return tuple(out)


def snapshot(roots: list[Path]) -> list[dict[str, Any]]:
    """Every study's overview, for the studies table and its live updates."""
    return [study_overview(ref, path) for ref, path in find_studies(roots)]
