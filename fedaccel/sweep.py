"""``fedaccel-sweep``: a study (a grid of runs over run-config keys and seeds) from one file.

A study file is YAML::

    name: fedprox-mu          # the study's folder under results-dir (default: the file's stem)
    results-dir: results/sweeps
    num-clients: 20           # fast-runner clients of every cell (default 20)
    config: configs/x.yaml    # optional: a run-config file every cell starts from
    base:                     # run-config keys every cell shares (nested tables allowed)
      num-server-rounds: 30
    variants:                 # alternatives, each its own keys (default: one empty variant);
      - {algo: fedavg}        # or named axes crossed: {method: [...], data: [...]}
      - {algo: fedprox, fedprox.mu: 0.01}
    grid:                     # every combination of these values
      lr: [0.01, 0.05]
      local-epochs: {linear: [1, 3], count: 3}      # 1, 2, 3
      weight-decay: {log: [1.0e-4, 1.0e-2], count: 3}  # 1e-4, 1e-3, 1e-2
    random:                   # random search: count draws of these keys together
      count: 8
      seed: 0                 # of the draws: the same file gives the same cells
      keys:
        momentum: {uniform: [0.0, 0.9]}
        batch-size: {choice: [16, 32]}
    seeds: [0, 1, 2]

Its cells are every variant x every grid combination x every random draw x
every seed, in that order; each cell is a normal run of the fast runner (:func:`fedaccel.local_run.run_local`)
with its own folder ``<results-dir>/<name>/cells/<cell>/``, whose name says
the cell's keys. ``variants`` exist because a run refuses another
algorithm's hyperparameters: ``fedprox.mu`` can only vary with
``algo='fedprox'``.

- **Every cell is checked before anything runs**, and all invalid cells are
  reported in one message.
- **Resumable**: a cell whose run finished (its ``summary.json``, and its
  ``status.json`` saying so) is skipped when the same command runs again; an unfinished cell (killed
  mid-run) goes on from its newest checkpoint when the study sets
  ``checkpoint-every`` (fedaccel.checkpoint; local workers), else starts
  again from round 1. ``<name>/plan.json`` records each
  cell's keys; a study file changed under a finished cell is refused (use
  another ``name``, or delete the cell's folder).
- **In parallel**: ``--workers N`` processes (default: one per two cores;
  each gets ``cores / N`` torch threads). ``--workers 1`` runs the cells in
  this process. ``--ray-address`` runs them as Ray tasks on a cluster
  (:func:`_run_on_ray`; a cell's files come back to this process).
- **Report**: ``<name>/report/``: ``comparison.md`` and ``comparison.png``
  from :func:`fedaccel.compare.compare_runs` (cells grouped over seeds,
  mean ± std) and ``groups.csv``, one row per group.

Written by hand: Flower has no sweep runner, and the general ones (Ray Tune,
Hydra's multirun) know nothing of this project's cells, seeds and report.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import product
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from fedaccel.checkpoint import config_mismatch, list_checkpoints, read_manifest, resolution_changed
from fedaccel.config import ConfigError
from fedaccel.errors import CheckpointError, ResultsDirError
from fedaccel.processes import process_record, record_alive, stop_on_sigint
from fedaccel.results import STATUS_FILE, SUMMARY_FILE, run_finished

from fedaccel.local_run import (DEFAULT_NUM_CLIENTS, Yaml12Loader, default_run_config, flat_config, fuse,
                                load_yaml_config)

PROG = "fedaccel-sweep"
STUDY_KEYS = ("name", "results-dir", "num-clients", "config", "base", "variants", "grid", "random", "seeds")
RANGE_KINDS = ("linear", "log")
PLACE_KEYS = ("results-dir", "run-name")  # where a cell is, not what it runs


@dataclass(frozen=True)
class Cell:
    """One run of a study: its folder name and the run-config keys it sets."""

    name: str
    overrides: dict[str, Any]


@dataclass(frozen=True)
class Study:
    name: str
    folder: Path
    num_clients: int
    cells: list[Cell]
    file: Path | None = None  # the study file it was read from


def range_values(key: str, spec: dict[str, Any]) -> list[Any]:
    """``{linear: [a, b], count: n}`` (n evenly spaced values, whole numbers
    stay integers when a, b and the step are) or ``{log: [a, b], count: n}``
    (n values evenly spaced in log scale, a and b > 0)."""
    kinds = [k for k in RANGE_KINDS if k in spec]
    if len(kinds) != 1 or set(spec) != {kinds[0], "count"}:
        raise ConfigError(f"grid.{key}: a range is {{linear: [low, high], count: n}} or "
                          f"{{log: [low, high], count: n}}, got {spec!r}")
    kind, bounds, count = kinds[0], spec[kinds[0]], spec["count"]
    if not (isinstance(bounds, list) and len(bounds) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)):
        raise ConfigError(f"grid.{key}: {kind} needs [low, high] numbers, got {bounds!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"grid.{key}: count must be an integer >= 1, got {count!r}")
    low, high = float(bounds[0]), float(bounds[1])
    if count == 1:
        points = [low]
    elif kind == "linear":
        points = [low + (high - low) * i / (count - 1) for i in range(count)]
    else:
        if low <= 0 or high <= 0:
            raise ConfigError(f"grid.{key}: log needs low and high > 0, got {bounds!r}")
        points = [math.exp(math.log(low) + (math.log(high) - math.log(low)) * i / (count - 1))
                  for i in range(count)]
    if kind == "linear" and all(isinstance(b, int) for b in bounds) and all(p.is_integer() for p in points):
        return [int(p) for p in points]
    return [float(f"{p:.6g}") for p in points]


def grid_values(grid: Any) -> list[tuple[str, list[Any]]]:
    if grid is None:
        return []
    if not isinstance(grid, dict):
        raise ConfigError(f"grid: must map run-config keys to lists of values, got {type(grid).__name__}")
    out = []
    for key, values in flatten_grid(grid).items():
        if isinstance(values, dict):
            values = range_values(key, values)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key}: must be a non-empty list of values or a range, got {values!r}")
        out.append((key, values))
    return out


def flatten_grid(grid: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables of the grid to dotted keys; a range (a mapping with
    ``count``) is a value, not a table."""
    out: dict[str, Any] = {}
    for key, value in grid.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "count" not in value:
            out.update(flatten_grid(value, name + "."))
        else:
            out[name] = value
    return out


def flatten_random(keys: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables of ``random.keys`` to dotted keys: a table of tables
    (``fedprox: {mu: {...}}``) is nested, any other value a distribution."""
    out: dict[str, Any] = {}
    for key, value in keys.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            out.update(flatten_random(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


RANDOM_KINDS = ("uniform", "log-uniform", "int-uniform", "choice")
RANDOM_KEYS = ("count", "seed", "keys")


def _draw(key: str, spec: Any, u: float) -> Any:
    """One value of ``key`` from a uniform number ``u`` in [0, 1)."""
    kind = next(iter(spec))
    bounds = spec[kind]
    if kind == "choice":
        return bounds[int(u * len(bounds))]
    low, high = bounds
    if kind == "int-uniform":
        return int(low) + int(u * (int(high) - int(low) + 1))  # both ends included
    if kind == "uniform":
        value = low + (high - low) * u
    else:
        value = math.exp(math.log(low) + (math.log(high) - math.log(low)) * u)
    return float(f"{value:.4g}")  # the cell's name and its run config say the same value


def _check_random_key(key: str, spec: Any) -> None:
    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in RANDOM_KINDS):
        raise ConfigError(f"random.keys.{key}: one of {{uniform: [low, high]}}, {{log-uniform: [low, high]}}, "
                          f"{{int-uniform: [low, high]}} (both ends included) or {{choice: [a, b, ...]}}, "
                          f"got {spec!r}")
    kind, bounds = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(bounds, list) or not bounds:
            raise ConfigError(f"random.keys.{key}: choice needs a non-empty list of values, got {bounds!r}")
        return
    numbers = isinstance(bounds, list) and len(bounds) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds)
    if not numbers or bounds[0] > bounds[1]:
        raise ConfigError(f"random.keys.{key}: {kind} needs [low, high] numbers with low <= high, got {bounds!r}")
    if kind == "int-uniform" and not all(isinstance(b, int) for b in bounds):
        raise ConfigError(f"random.keys.{key}: int-uniform needs whole numbers, got {bounds!r}")
    if kind == "log-uniform" and bounds[0] <= 0:
        raise ConfigError(f"random.keys.{key}: log-uniform needs low and high > 0, got {bounds!r}")


def random_draws(spec: Any) -> list[dict[str, Any]]:
    """``count`` distinct draws of the ``random`` keys together (random
    search), seeded by ``seed`` (default 0): the same file gives the same
    cells, so a random study resumes like a grid. Uses only
    :meth:`random.Random.random`, whose stream Python keeps stable."""
    import random

    if spec is None:
        return [{}]
    if not isinstance(spec, dict) or set(spec) - set(RANDOM_KEYS) or "keys" not in spec or "count" not in spec:
        raise ConfigError("random: a mapping {count: n, seed: s, keys: {key: {uniform: [low, high]}, ...}}, "
                          f"got {spec!r}")
    count, seed = spec["count"], spec.get("seed", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"random.count: must be an integer >= 1, got {count!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"random.seed: must be an integer, got {seed!r}")
    keys = spec["keys"]
    if not isinstance(keys, dict) or not keys:
        raise ConfigError(f"random.keys: must map run-config keys to distributions, got {keys!r}")
    keys = flatten_random(keys)
    for key, dist in keys.items():
        _check_random_key(key, dist)
    rng = random.Random(seed)
    draws: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(100 * count):
        draw = {key: _draw(key, dist, rng.random()) for key, dist in keys.items()}
        text = json.dumps(draw, sort_keys=True)
        if text not in seen:  # without repeats: a repeated combination would be the same cell twice
            seen.add(text)
            draws.append(draw)
            if len(draws) == count:
                return draws
    raise ConfigError(f"random: only {len(draws)} distinct draws found for count={count} "
                      "(the choices and integer ranges allow fewer combinations): lower count")


def value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def cell_name(overrides: dict[str, Any]) -> str:
    """A folder name from the cell's keys, e.g. ``algo=fedprox,fedprox.mu=0.01,seed=1``."""
    text = ",".join(f"{k}={value_text(v)}" for k, v in overrides.items())
    text = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if len(text) > 120:  # long names: a readable head and a digest of the whole
        import hashlib

        text = text[:100] + "-" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return text


def expand(variants: list[dict[str, Any]], grid: list[tuple[str, list[Any]]], seeds: list[Any],
           draws: list[dict[str, Any]] | None = None) -> list[Cell]:
    """Every variant x grid combination x random draw x seed, in that order."""
    cells, seen = [], set()
    for variant in variants:
        for combo, draw in product(product(*[values for _, values in grid]), draws or [{}]):
            for seed in seeds:
                overrides = {**variant, **dict(zip([k for k, _ in grid], combo)), **draw, "seed": seed}
                name = cell_name(overrides)
                if name in seen:
                    raise ConfigError(f"two cells would run {name}: a variant and the grid set the same "
                                      "key to the same value, or a value repeats")
                seen.add(name)
                cells.append(Cell(name, overrides))
    return cells


def _flat(path: Path, what: str, mapping: dict[Any, Any]) -> dict[str, Any]:
    """A mapping of run-config keys (nested tables allowed) as dotted keys,
    refused as a ``--config`` file's are (:func:`fedaccel.local_run.flat_config`)."""
    return flat_config(mapping, f"{path}: {what}")


def crossed_variants(path: Path, spec: Any) -> list[dict[str, Any]]:
    """``variants`` as a list of mappings (one axis), or a mapping of named
    axes, each a list of mappings, crossed in the order written (e.g.
    ``{method: [...], data: [...]}``: every method on every data set)."""
    if not spec:
        return [{}]
    axes = list(spec.values()) if isinstance(spec, dict) else [spec]
    for axis in axes:
        if not isinstance(axis, list) or not axis or not all(isinstance(v, dict) for v in axis):
            raise ConfigError(f"{path}: variants must be a list of mappings of run-config keys, or a "
                              "mapping of named lists of them (crossed)")
    out = []
    for combo in product(*axes):
        merged: dict[str, Any] = {}
        for part in combo:
            merged.update(_flat(path, "variants", part))
        out.append(merged)
    return out


def load_study(path: str | Path, results_dir: str | None = None) -> tuple[Study, dict[str, Any]]:
    """The study's cells and the run config they share (base file + ``base``),
    checked (:class:`ConfigError` for a malformed file)."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such study file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the study file ({err.__class__.__name__}: "
                          f"{getattr(err, 'strerror', None) or err})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a study file holds a mapping (name, base, variants, grid, seeds)")
    unknown = sorted(set(raw) - set(STUDY_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown study key(s) {', '.join(unknown)}; allowed: {', '.join(STUDY_KEYS)} "
                          "(run-config keys go under base, variants or grid)")
    shared: dict[str, Any] = {}
    if raw.get("config"):
        run_file = Path(str(raw["config"])).expanduser()
        if not run_file.is_absolute() and not run_file.is_file() and (path.parent / run_file).is_file():
            run_file = path.parent / run_file  # relative to the study file
        if not run_file.is_file():
            raise ConfigError(f"{path}: config: {raw['config']}: no such run-config file")
        shared.update(load_yaml_config(str(run_file)))
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: base must map run-config keys to values")
    shared.update(_flat(path, "base", base))
    variants = crossed_variants(path, raw.get("variants"))
    seeds = raw.get("seeds", [shared.get("seed", 0)])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                          for s in seeds):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, got {seeds!r}")
    num_clients = raw.get("num-clients", DEFAULT_NUM_CLIENTS)
    if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
        raise ConfigError(f"{path}: num-clients must be an integer >= 1, got {num_clients!r}")
    name = str(raw.get("name") or path.stem)
    if "/" in name or name in (".", ".."):
        raise ConfigError(f"{path}: name={name!r} must be a folder name")
    grid, draws = grid_values(raw.get("grid")), random_draws(raw.get("random"))
    both = sorted({k for k, _ in grid} & set(draws[0]))
    if both:
        raise ConfigError(f"{path}: {', '.join(both)} in both grid and random: give each key one of them")
    cells = expand(variants, grid, seeds, draws)
    root = Path(results_dir or raw.get("results-dir")
                or Path(str(shared.get("results-dir", "results"))) / "sweeps").expanduser()
    return Study(name, root / name, num_clients, cells, path.resolve()), shared


def cell_run_config(study: Study, shared: dict[str, Any], cell: Cell) -> dict[str, Any]:
    """The full run config of a cell: defaults, the study's shared keys, the
    cell's keys, and its folder."""
    return fuse(default_run_config(), {**shared, **cell.overrides,
                                       "results-dir": str(study.folder / "cells"), "run-name": cell.name})


def check_cells(study: Study, shared: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cell's run config, validated; all invalid cells in one error."""
    from fedaccel.errors import USER_ERRORS
    from fedaccel.experiment import refuse_by_model
    from fedaccel.run_config import parse_run_config

    configs, problems = [], []
    for cell in study.cells:
        try:
            config = cell_run_config(study, shared, cell)
            refuse_by_model(parse_run_config(config))
            configs.append(config)
        except USER_ERRORS as err:
            problems.append(f"  {cell.name}: {err}")
    if problems:
        raise ConfigError(f"{len(problems)} of {len(study.cells)} cells are invalid, nothing was run:\n"
                          + "\n".join(problems))
    return configs


def check_plan(study: Study, configs: list[dict[str, Any]], write: bool = True) -> None:
    """Refuse to resume a study whose file changed under its finished cells,
    then record this plan (``plan.json``: every cell's full run config, the
    cells the study has now in its order, the study file and the process
    that runs it: what fedaccel-dashboard reads). A study another sweep
    process is running is refused. ``write=False`` only checks (the
    dashboard, before it launches a study)."""
    plan_path = study.folder / "plan.json"
    planned = {cell.name: config for cell, config in zip(study.cells, configs)}
    old: dict[str, Any] = {}
    if plan_path.is_file():
        try:
            old = json.loads(plan_path.read_text(encoding="utf-8"))
            old["cells"] = dict(old.get("cells", {}))
        except (ValueError, TypeError, AttributeError):
            raise ConfigError(f"{plan_path} is not a sweep plan (damaged?): delete it to run the study "
                              "again (finished cells are then trusted as they are)") from None
        pid = old.get("pid")
        if pid != os.getpid() and record_alive(old):
            raise ConfigError(f"{study.folder} is being run by another fedaccel-sweep (process {pid}); "
                              "wait for it to end, or stop it first (Ctrl-C there, or the dashboard's Stop)")
        changed = []
        for name, config in planned.items():
            before = old["cells"].get(name)
            if before is None or not finished(study.folder / "cells" / name):
                continue
            keys = sorted(k for k in set(before) | set(config)
                          if k not in PLACE_KEYS and before.get(k) != config.get(k))
            if keys or old.get("num-clients") != study.num_clients:
                what = ", ".join(f"{k}: {before.get(k)!r} -> {config.get(k)!r}" for k in keys[:3]) or (
                    f"num-clients: {old.get('num-clients')} -> {study.num_clients}")
                changed.append(f"  {name} ({what})")
        if changed:
            raise ConfigError(
                f"{study.folder} holds finished cells that ran with other settings than the study file "
                f"now says; give the study another name, or delete those cells' folders:\n" + "\n".join(changed))
    if not write:
        return
    # cells that left the study stay in the plan: if they come back, they are checked too
    cells = {**old.get("cells", {}), **planned}
    try:
        study.folder.mkdir(parents=True, exist_ok=True)
        _write_plan(plan_path, {
            "num-clients": study.num_clients, "cells": cells, "current": [c.name for c in study.cells],
            "study-file": str(study.file) if study.file else None,
            **process_record(), "started": time.time()})
    except OSError as err:
        raise ResultsDirError(f"cannot write the study's folder {study.folder} "
                              f"({err.strerror or err}): use another --results-dir") from None


def finished(run_dir: Path) -> bool:
    """A cell is finished when its run is (:func:`fedaccel.results.run_finished`:
    a readable ``summary.json`` and its status ``finished``, the run's last
    word; a cell killed before that is run again), as fedaccel-compare,
    which makes the study's report, counts it."""
    return run_finished(run_dir)


def _resumable(run_dir: Path, config: dict[str, Any]) -> bool:
    """Whether an unfinished cell has a checkpoint of this very cell (one
    written under other settings, or unreadable, is run again from round 1)."""
    found = list_checkpoints(run_dir)
    if not found:
        return False
    try:
        if config_mismatch(read_manifest(found[-1])["run-config"], config):
            return False
    except CheckpointError:
        return False
    from fedaccel.run_config import parse_run_config

    # a setting whose 'auto' resolves otherwise than when the cell started: the run cannot go on
    return resolution_changed(run_dir, parse_run_config(config)) is None


def _run_cell(config: dict[str, Any], num_clients: int, threads: int | None) -> tuple[str, float, str | None]:
    """One cell (in a worker process or in this one): (cell, seconds, error or None)."""
    import torch

    from fedaccel.errors import USER_ERRORS
    from fedaccel.local_run import run_local

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), stop_on_sigint():  # stdout: the run's results line
            run_local(config, num_clients=num_clients, quiet=True)
    except USER_ERRORS as err:
        return config["run-name"], time.perf_counter() - start, str(err)
    return config["run-name"], time.perf_counter() - start, None


#: written into a Ray sweep's cells folder: a Ray worker that reads the same
#: token there shares the sweep's filesystem (the same machine, or a shared
#: mount at the same path) and runs its cell in place
SHARED_TOKEN_FILE = ".sweep-token"


def _run_cell_remote(config: dict[str, Any], num_clients: int, threads: int | None,
                     token: str | None = None, resume_files: dict[str, bytes] | None = None
                     ) -> tuple[str, float, str | None, dict[str, bytes], str]:
    """:func:`_run_cell` on a Ray worker, which may be another machine.

    Where the worker sees the sweep's cells folder (``token`` found in it),
    the cell runs in place, exactly as in a local worker: its checkpoints are
    in the cell's folder as it runs, and a resumed cell reads them there.
    Elsewhere it runs in a temporary folder (a resumed cell's files, shipped
    as ``resume_files``, written there first) and all its files, checkpoints
    included, come back to the sweep, which writes them into the cell's
    folder (no shared filesystem needed). Last in the result: where it ran
    (host and Ray node)."""
    import socket
    import tempfile

    import ray

    where = f"{socket.gethostname()}, Ray node {ray.get_runtime_context().get_node_id()[:8]}"
    results = Path(config["results-dir"])
    with contextlib.suppress(OSError):
        if token and (results / SHARED_TOKEN_FILE).read_text(encoding="utf-8").strip() == token:
            return (*_run_cell(config, num_clients, threads), {}, where)
    with tempfile.TemporaryDirectory(prefix="fedaccel-cell-") as tmp:
        local = {**config, "results-dir": tmp}
        folder = Path(tmp) / config["run-name"]
        if config.get("resume"):
            _write_files(folder, resume_files or {})
            local["resume"] = str(folder)
        name, took, error = _run_cell(local, num_clients, threads)
        files = ({p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
                 if folder.is_dir() else {})
    return name, took, error, files, where


def _cell_files(folder: Path) -> dict[str, bytes]:
    """A cell's files by path relative to its folder (a resumed cell shipped to a Ray worker)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` (paths relative to ``folder``) atomically each;
    ``summary.json`` and then ``status.json`` last, as the run itself writes
    them, so that a sweep killed while writing sees the cell as unfinished
    (:func:`fedaccel.results.run_finished`) and the dashboard agrees."""
    last = {SUMMARY_FILE: 1, STATUS_FILE: 2}
    for rel in sorted(files, key=lambda n: last.get(n, 0)):
        target = folder / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ValueError(f"a cell file outside its folder: {rel!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(files[rel])
        tmp.replace(target)


def _store_cell(cells_dir: Path, name: str, files: dict[str, bytes]) -> None:
    """Write a remote cell's files into its folder (:func:`_write_files`)."""
    _write_files(cells_dir / name, files)


def _run_on_ray(address: str, todo: list[dict[str, Any]], num_clients: int, cells_dir: Path,
                record: Any, shared_folder: bool = True) -> None:
    """The cells as Ray tasks (one CPU's worth of threads each unless the
    cluster says more), on the cluster at ``address`` (``local``: a Ray
    started here for the sweep). Workers that see ``cells_dir`` run their
    cells in place (:func:`_run_cell_remote`); ``shared_folder=False`` makes
    every worker act as if on another machine (tests)."""
    import uuid

    import ray

    cells_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    (cells_dir / SHARED_TOKEN_FILE).write_text(token + "\n", encoding="utf-8")

    try:
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise ConfigError(f"--ray-address {address}: no Ray cluster there ({str(err).splitlines()[0]}); "
                          "start one (ray start --head) or use 'local'") from None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        threads = 2 if cpus >= 2 * len(todo) else 1
        task = ray.remote(num_cpus=threads)(_run_cell_remote)
        pending = {task.remote(config, num_clients, threads, token if shared_folder else None,
                               _cell_files(cells_dir / config["run-name"]) if config.get("resume") else None): config
                   for config in todo}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                config = pending.pop(ref)
                try:
                    name, took, error, files, where = ray.get(ref)
                except ray.exceptions.RayError as err:  # the task or its worker died
                    record(config["run-name"], 0.0, f"its Ray task failed ({str(err).splitlines()[0]})")
                    continue
                if files:
                    _store_cell(cells_dir, name, files)
                record(name, took, error, where)
    finally:
        ray.shutdown()


def refuse_fast_runner_only(configs: list[dict[str, Any]]) -> None:
    """Cells with ``init='near-optimum'`` or ``optimality=true`` (computed from
    every client's data, which only the fast runner's server holds for
    certain) are refused on a Flower federation before any cell runs."""
    from fedaccel.run_config import parse_run_config

    for config in configs:
        if parse_run_config(config).needs_optimum:
            raise ConfigError(f"cell {config['run-name']}: init='near-optimum' and optimality=true run in the "
                              "fast runner only: run the study without --federation")


def check_federation(connection: str, num_clients: int) -> None:
    """Refuse, before any cell runs, a connection Flower does not know and a
    simulation whose SuperNodes are not the study's ``num-clients``."""
    from fedaccel.federations import installed_connections

    try:
        connections = installed_connections()
    except Exception as err:  # no or a broken $FLWR_HOME/config.toml
        raise ConfigError(f"--federation {connection}: cannot read Flower's config.toml ({err}); "
                          "run fedaccel-federations install") from None
    if connection not in connections:
        raise ConfigError(f"--federation {connection}: not a SuperLink connection of Flower's config.toml "
                          f"(there: {', '.join(sorted(connections)) or 'none'}); run fedaccel-federations install")
    nodes = connections[connection].get("options", {}).get("num-supernodes")
    if connections[connection].get("address") == ":local:" and nodes != num_clients:
        raise ConfigError(f"--federation {connection}: its simulation has {nodes} SuperNodes, the study's "
                          f"num-clients is {num_clients}: run fedaccel-federations size {connection} "
                          f"{num_clients} (or set num-clients: {nodes} in the study)")


_RUN_ID = re.compile(r"run_id `(\d+)`|started run (\d+)")


def _run_cell_on_flower(config: dict[str, Any], connection: str) -> tuple[str, float, str | None]:
    """One cell as ``flwr run <project> <connection> --stream``: its keys that
    differ from the defaults (and where it writes) as ``--run-config``, its
    console to ``<cell>/console.log``. Interrupted (Ctrl-C, the dashboard's
    stop), it asks Flower to stop the run (``flwr stop``) before it goes."""
    from fedaccel.local_run import project_dir, run_config_tokens

    defaults = default_run_config()
    keys = {k: v for k, v in config.items() if k in PLACE_KEYS or k == "resume" or defaults.get(k) != v}
    # the ServerApp resolves a relative results-dir against its own working folder
    keys["results-dir"] = str(Path(config["results-dir"]).resolve())
    run_dir = Path(keys["results-dir"]) / config["run-name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    argv = [flwr, "run", str(project_dir()), connection, "--run-config", " ".join(run_config_tokens(keys)),
            "--stream"]
    start = time.perf_counter()
    run_id = None
    lines: list[str] = []
    with open(run_dir / "console.log", "w", encoding="utf-8") as console:
        console.write("$ " + " ".join(argv) + "\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            for line in proc.stdout:
                console.write(line)
                console.flush()
                lines.append(line.rstrip())
                match = None if run_id else _RUN_ID.search(line)
                if match:
                    run_id = match.group(1) or match.group(2)
            proc.wait()
        except KeyboardInterrupt:
            if run_id:  # the run goes on on the SuperLink unless Flower is told
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([flwr, "stop", run_id, connection], capture_output=True, timeout=60)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    took = time.perf_counter() - start
    if finished(run_dir):
        return config["run-name"], took, None
    said = [ln for ln in lines if "error" in ln.lower() or "invalid" in ln.lower() or "stopped" in ln.lower()]
    return config["run-name"], took, (said[-1].strip() if said else
                                      f"flwr run ended without results (exit {proc.returncode}); "
                                      f"see {run_dir / 'console.log'}")


def default_workers() -> int:
    """One worker per two cores (a run already uses two threads well)."""
    return max(1, (os.cpu_count() or 1) // 2)


def _eta(seconds: list[float], remaining: int, workers: int) -> str:
    if not seconds or not remaining:
        return ""
    left = sum(seconds) / len(seconds) * remaining / max(workers, 1)
    return f", about {left / 60:.0f} min left" if left >= 90 else f", about {left:.0f} s left"


def run_study(study: Study, shared: dict[str, Any], workers: int | None = None,
              out=sys.stderr, ray_address: str | None = None, federation: str | None = None,
              ray_shared_folder: bool = True) -> dict[str, Any]:
    """Run every unfinished cell (``workers`` processes; 1: in this process;
    as tasks on the Ray cluster at ``ray_address``; or one after another as
    ``flwr run`` on the SuperLink connection ``federation``), then write the
    report. Returns counts and the failed cells' errors. ``ray_shared_folder=False``:
    Ray workers act as if on another machine (:func:`_run_on_ray`)."""
    configs = check_cells(study, shared)
    if federation:
        refuse_fast_runner_only(configs)
        check_federation(federation, study.num_clients)
    check_plan(study, configs)
    try:
        return _run_planned(study, configs, workers, out, ray_address, federation, ray_shared_folder)
    finally:  # the plan no longer names a live process (fedaccel-dashboard reads it)
        _release_plan(study.folder / "plan.json")


def _write_plan(plan_path: Path, plan: dict[str, Any]) -> None:
    """Replace ``plan.json`` atomically (a reader never sees half of it)."""
    tmp = plan_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    tmp.replace(plan_path)


def _release_plan(plan_path: Path) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        plan = json.loads(plan_path.read_text(encoding="utf-8"))
        if plan.get("pid") == os.getpid():
            plan.update(pid=None, ended=time.time())
            _write_plan(plan_path, plan)


def _run_planned(study: Study, configs: list[dict[str, Any]], workers: int | None, out: Any,
                 ray_address: str | None, federation: str | None = None,
                 ray_shared_folder: bool = True) -> dict[str, Any]:
    cells_dir = study.folder / "cells"
    todo = []
    for config in configs:
        run_dir = cells_dir / config["run-name"]
        if finished(run_dir):
            continue
        if _resumable(run_dir, config):  # killed mid-run: go on from its checkpoint
            config = {**config, "resume": str(run_dir)}
        elif run_dir.exists():  # killed before its first checkpoint: start it again
            shutil.rmtree(run_dir)
        todo.append(config)
    done_before = len(configs) - len(todo)
    workers = 1 if federation else max(1, min(workers or default_workers(), len(todo) or 1))
    threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
    where = (f"Ray at {ray_address}" if ray_address else f"Flower ({federation}), one after another"
             if federation else f"{workers} worker{'s' if workers > 1 else ''}")
    print(f"[sweep] {study.name}: {len(configs)} cells, {done_before} already finished, "
          f"{len(todo)} to run on {where} ({study.folder})", file=out, flush=True)
    failed: dict[str, str] = {}
    seconds: list[float] = []

    def record(name: str, took: float, error: str | None, where: str = "") -> None:
        seconds.append(took)
        if error:
            failed[name] = error
        finished_now = len(seconds)
        print(f"[sweep] {done_before + finished_now}/{len(configs)} {name}: "
              f"{'failed: ' + error if error else f'done in {took:.1f} s'}{f' ({where})' if where else ''}"
              f"{_eta(seconds, len(todo) - finished_now, workers)}", file=out, flush=True)

    if ray_address and todo:
        _run_on_ray(ray_address, todo, study.num_clients, cells_dir, record, ray_shared_folder)
    elif federation:
        for config in todo:
            record(*_run_cell_on_flower(config, federation))
    elif workers == 1:
        for config in todo:
            record(*_run_cell(config, study.num_clients, None))
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            submitted = {pool.submit(_run_cell, c, study.num_clients, threads): c["run-name"] for c in todo}
            pending: set[Future] = set(submitted)
            try:
                while pending:
                    complete, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in complete:
                        try:
                            record(*future.result())
                        except BrokenProcessPool:  # a worker died (killed, out of memory): its cells failed
                            record(submitted[future], 0.0, "its worker process died (out of memory?)")
            except KeyboardInterrupt:
                _stop_workers(pool)
                raise
    report = write_report(study) if any(finished(cells_dir / c.name) for c in study.cells) else None
    if report:
        print(f"[sweep] report: {report / 'comparison.md'}, {report / 'groups.csv'}, "
              f"{report / 'comparison.png'}", file=out, flush=True)
    return {"cells": len(configs), "skipped": done_before, "ran": len(todo), "failed": failed}


def _stop_workers(pool: ProcessPoolExecutor, grace: float = 5.0) -> None:
    """Ctrl-C (or the dashboard's stop): no cell starts any more. The workers
    share the sweep's process group, so the same SIGINT reached their running
    cells (each records ``stopped`` with its rows so far; a second one here
    could interrupt that recording); they get ``grace`` seconds, then any
    worker still alive (a cell it took from the queue meanwhile) is ended."""
    import multiprocessing

    pool.shutdown(wait=False, cancel_futures=True)
    workers = multiprocessing.active_children()
    deadline = time.monotonic() + grace
    try:
        for proc in workers:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:  # a second Ctrl-C while waiting still ends them
        for proc in workers:
            if proc.is_alive():
                proc.terminate()


def write_report(study: Study) -> Path:
    """``report/comparison.md`` + ``.png`` (cells grouped over seeds) and
    ``report/groups.csv`` (one row per group), from the finished cells."""
    from fedaccel.compare import compare_runs, group_by_seed, load_runs

    out = study.folder / "report"
    dirs = [study.folder / "cells" / c.name for c in study.cells if finished(study.folder / "cells" / c.name)]
    compare_runs(dirs, out, group_seeds=True)
    groups = group_by_seed(load_runs(dirs))
    with open(out / "groups.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["group", "runs", "seeds", "final_accg_mean", "final_accg_std",
                         "mean_last_20_accg_mean", "mean_last_20_accg_std", "best_accg_mean",
                         "rounds_to_target_mean", "runs_reaching_target", "total_mb_mean"])
        for group in groups:
            summaries = [r.summary for r in group.runs]
            reached = [s["rounds_to_target"] for s in summaries if s.get("rounds_to_target") is not None]
            writer.writerow([group.label, len(group.runs), " ".join(map(str, group.seeds)),
                             *_mean_std([s.get("final_accg") for s in summaries]),
                             *_mean_std([s.get("mean_last_20_accg") for s in summaries]),
                             _mean([s.get("best_accg") for s in summaries]),
                             _mean(reached), len(reached),
                             _mean([s.get("total_mb") for s in summaries])])
    return out


def _numbers(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _mean(values: list[Any]) -> str:
    xs = _numbers(values)
    return f"{sum(xs) / len(xs):.6g}" if xs else ""


def _mean_std(values: list[Any]) -> tuple[str, str]:
    import statistics

    xs = _numbers(values)
    if not xs:
        return "", ""
    return f"{statistics.fmean(xs):.6g}", (f"{statistics.stdev(xs):.6g}" if len(xs) > 1 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a study (a grid of fast-runner runs over run-config keys and seeds) "
        "from one YAML file; resumable: the same command skips finished cells.")
    parser.add_argument("study", help="the study file (configs/ has examples; docs/sweeps.md)")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel runs (default: one per two cores; 1 = in this process)")
    parser.add_argument("--results-dir", default=None, help="where the study's folder goes "
                        "(default: the file's results-dir, else results/sweeps)")
    parser.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="run the cells as tasks on this Ray cluster ('auto': the one this machine "
                        "belongs to, host:port, or 'local': a Ray started for the sweep)")
    parser.add_argument("--federation", default=None, metavar="CONNECTION",
                        help="run each cell as `flwr run` on this SuperLink connection of Flower's config.toml "
                        "(e.g. local-simulation), one after another; its ServerApp must write where this "
                        "machine sees (docs/sweeps.md)")
    parser.add_argument("--dry-run", action="store_true", help="check and list the cells, run nothing")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")

    from fedaccel.errors import USER_ERRORS, exit_code

    try:
        study, shared = load_study(args.study, args.results_dir)
        if args.dry_run:
            check_cells(study, shared)
            for cell in study.cells:
                state = "finished" if finished(study.folder / "cells" / cell.name) else "to run"
                print(f"{cell.name}  ({state})")
            print(f"[sweep] {len(study.cells)} cells, all valid ({study.folder})", file=sys.stderr)
            return 0
        if args.federation and (args.ray_address or (args.workers or 1) > 1):
            parser.error("--federation runs the cells one after another on Flower: drop --ray-address "
                         "and --workers")
        with stop_on_sigint():
            outcome = run_study(study, shared, args.workers, ray_address=args.ray_address,
                                federation=args.federation)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped (interrupt); finished cells are kept, the same command runs the rest",
              file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return exit_code(err)
    if outcome["failed"]:
        print(f"{PROG}: {len(outcome['failed'])} of {outcome['cells']} cells failed (listed above); "
              "the same command runs them again", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
