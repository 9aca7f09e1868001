"""Shared machinery of the benchmark scripts: resumable parallel fast-runner runs.

A job is ``{"id": {...}, "key": str, "name": str, "overrides": {...},
"num_clients": int}``: ``key`` identifies the run (its config), ``name`` is
its run folder. :func:`execute` runs every job whose key is not yet in
``<out>/runs.jsonl`` in spawned worker processes (one fresh process per run,
one torch thread each), appends one record per finished run and returns the
records of all jobs, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

SUMMARY_FIELDS = ("final_accg", "best_accg", "mean_last_20_accg", "rounds_to_target",
                  "target_accuracy", "total_mb")


def worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def run_job(job: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One run through the fast runner; a run that stops with a user error (e.g.
    every client replied non-finite weights after a divergence) is recorded as
    failed with its curve so far instead of killing the pool worker."""
    from fedaccel.errors import USER_ERRORS
    from fedaccel.local_run import default_run_config, fuse, run_local

    overrides = dict(job["overrides"], **{"results-dir": run_dir, "run-name": job["name"]})
    start = time.perf_counter()
    error = None
    try:
        folder = run_local(fuse(default_run_config(), overrides), job["num_clients"], quiet=True)
    except USER_ERRORS as err:
        error, folder = str(err), Path(run_dir) / job["name"]
    return record_of(job, folder, time.perf_counter() - start, error)


def record_of(job: dict[str, Any], folder: Path, seconds: float, error: str | None) -> dict[str, Any]:
    """The runs.jsonl record of ``job`` from its run folder."""
    summary = {} if error else json.loads((folder / "summary.json").read_text())
    rows = []
    if (folder / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [[r["round"], round(r["accg"], 5)] for r in rows if r.get("accg") is not None]
    return {**job["id"], "key": job["key"], **{k: summary.get(k) for k in SUMMARY_FIELDS},
            "seconds": round(seconds, 2), "run_folder": str(folder), "accg_curve": curve,
            "error": error, "last_round": rows[-1]["round"] if rows else None}


def records_from_study(jobs: list[dict[str, Any]], study_folder: Path) -> list[dict[str, Any]]:
    """The runs.jsonl records of ``jobs`` made by a study (fedaccel-sweep)
    instead of this script: each job is the cell whose run config has every
    one of the job's overrides (values and types); seconds are the run's own
    (summary.json's total_seconds). A job with no finished cell is an error."""
    cells = []
    for folder in sorted((Path(study_folder) / "cells").iterdir()):
        if (folder / "config.json").is_file():
            cells.append((folder, json.loads((folder / "config.json").read_text())))
    records = []
    for job in jobs:
        def same(config: dict[str, Any]) -> bool:
            return all(k in config and config[k] == v and type(config[k]) is type(v)
                       for k, v in job["overrides"].items())
        found = [folder for folder, config in cells if same(config)]
        status = {}
        if len(found) == 1 and (found[0] / "status.json").is_file():
            status = json.loads((found[0] / "status.json").read_text())
        if status.get("state") == "failed" and status.get("error"):
            # a run that stopped with a user-facing error (the script's USER_ERRORS):
            # the same record as the script writes for it, error and last round included
            seconds = float(status.get("updated", 0.0)) - float(status.get("started", 0.0))
            records.append(record_of(job, found[0], seconds, status["error"]))
            continue
        if len(found) != 1 or not (found[0] / "summary.json").is_file():
            raise SystemExit(f"[bench] {job['name']}: {len(found)} cells of {study_folder} match it"
                             f"{'' if len(found) != 1 else ' (not finished)'}")
        seconds = json.loads((found[0] / "summary.json").read_text())["total_seconds"]
        records.append(record_of(job, found[0], seconds, None))
    return records


def save_records_from_study(jobs: list[dict[str, Any]], study_folder: Path, out: Path) -> None:
    """``out/runs.jsonl`` = :func:`records_from_study` (what ``--phase table
    --from-study`` tabulates)."""
    records = records_from_study(jobs, study_folder)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def load_records(out: Path) -> list[dict[str, Any]]:
    path = out / "runs.jsonl"
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _as_completed(pending: list[Any]) -> Iterator[Any]:
    left = list(pending)
    while left:
        for res in list(left):
            if res.ready():
                left.remove(res)
                yield res
        time.sleep(0.2)


def execute(jobs: list[dict[str, Any]], out: Path, run_dir: Path, processes: int,
            describe: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Run the jobs not yet in ``out/runs.jsonl``; returns the records of all jobs.

    ``describe(record)`` gives the progress line's text for a finished run.
    """
    out.mkdir(parents=True, exist_ok=True)
    done = {r["key"]: r for r in load_records(out)}
    todo, seen = [], set()
    for job in jobs:
        if job["key"] not in done and job["key"] not in seen:
            todo.append(job)
            seen.add(job["key"])
    if len(jobs) - len(todo):
        print(f"[bench] {len(jobs) - len(todo)} run(s) already in {out / 'runs.jsonl'}, "
              f"{len(todo)} to do", flush=True)
    if todo:
        start = time.perf_counter()
        ctx = mp.get_context("spawn")
        with ctx.Pool(processes=max(1, processes), initializer=worker_init, maxtasksperchild=1) as pool:
            pending = [pool.apply_async(run_job, (job, str(run_dir))) for job in todo]
            for i, res in enumerate(_as_completed(pending), 1):
                rec = res.get()
                with open(out / "runs.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
                done[rec["key"]] = rec
                print(f"[bench] {i}/{len(todo)} {describe(rec)} "
                      f"({rec['seconds']:.0f}s; elapsed {time.perf_counter() - start:.0f}s)", flush=True)
    return [done[job["key"]] for job in jobs]


# ----------------------------------------------------------------------------- summaries

def mean_last(rec: dict[str, Any], window: int = 10) -> float:
    """Mean test accuracy of the evaluations in the last ``window`` rounds."""
    last = rec["num-server-rounds"]
    vals = [a for r, a in rec["accg_curve"] if r > last - window]
    return statistics.fmean(vals)


def rounds_to(rec: dict[str, Any], target: float) -> int | None:
    """First evaluated round with accg >= target (granularity: eval-every)."""
    for r, a in rec["accg_curve"]:
        if a >= target:
            return r
    return None


def mean_std(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def rounds_to_cell(recs: list[dict[str, Any]], target: float) -> str:
    hits = [rounds_to(r, target) for r in recs]
    hit = [h for h in hits if h is not None]
    if not hit:
        return f"> {recs[0]['num-server-rounds']} (0/{len(recs)})"
    std = f" ± {statistics.stdev(hit):.1f}" if len(hit) > 1 else ""
    return f"{statistics.fmean(hit):.1f}{std} ({len(hit)}/{len(recs)})"


def run_folder_name(label: str, tags: str, key: str) -> str:
    """A run folder's name: the label made path-safe, the tags, and a hash of the run's key."""
    slug = "".join(c if c.isalnum() else "_" for c in label).strip("_")
    return f"{slug}-{tags}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def mean_curve(recs: list[dict[str, Any]]):
    """Evaluated rounds and the mean and std (over runs, %) of their accuracy
    curves, cut to the shortest curve (a failed run's ends early)."""
    import numpy as np

    n = min(len(r["accg_curve"]) for r in recs)
    arr = np.array([[v for _, v in r["accg_curve"][:n]] for r in recs]) * 100
    x = np.array([rd for rd, _ in recs[0]["accg_curve"][:n]], dtype=float)
    return x, arr.mean(0), arr.std(0)
