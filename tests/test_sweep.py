"""fedaccel-sweep: a study file's cells, their checks, resuming, and the report."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

import pytest

from fedaccel.config import ConfigError
from fedaccel.sweep import Cell, cell_name, expand, load_study, main, random_draws, range_values, run_study

TINY = {"num-server-rounds": 2, "clients-per-round": 2, "synthetic": {"max-samples": 60}}


def write_study(tmp_path: Path, **parts) -> Path:
    import yaml

    study = {"name": "s", "results-dir": str(tmp_path / "out"), "num-clients": 4, "base": TINY, **parts}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


class Lines(list):
    """A stream for ``run_study(out=...)`` that keeps what was written."""

    def write(self, text: str) -> None:
        self.append(text)

    def flush(self) -> None:
        pass


def test_cells_are_variants_times_grid_times_seeds_with_readable_names() -> None:
    cells = expand([{"algo": "fedavg"}, {"algo": "fedprox", "fedprox.mu": 0.1}],
                   [("lr", [0.01, 0.1])], [0, 1])
    assert len(cells) == 8
    assert cells[0] == Cell("algo=fedavg,lr=0.01,seed=0", {"algo": "fedavg", "lr": 0.01, "seed": 0})
    assert cells[-1].name == "algo=fedprox,fedprox.mu=0.1,lr=0.1,seed=1"
    assert "/" not in cell_name({"results-dir": "a/b"})
    assert len(cell_name({f"k{i}": "x" * 20 for i in range(20)})) <= 120


def test_ranges_by_hand() -> None:
    assert range_values("local-epochs", {"linear": [1, 3], "count": 3}) == [1, 2, 3]
    assert range_values("lr", {"linear": [0.0, 1.0], "count": 5}) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert range_values("wd", {"log": [1e-4, 1e-2], "count": 3}) == [1e-4, 1e-3, 1e-2]
    for bad in ({"log": [0, 1], "count": 2}, {"linear": [0, 1]}, {"log": [1, 2], "count": 0},
                {"linear": [0, 1], "count": 2, "extra": 1}):
        with pytest.raises(ConfigError, match="grid.x"):
            range_values("x", bad)


def test_every_invalid_cell_is_reported_at_once_and_nothing_runs(tmp_path) -> None:
    path = write_study(tmp_path, variants=[{"algo": "fedavg"}, {"algo": "fedprx"}],
                       grid={"lr": [0.1, -1.0]}, seeds=[0])
    study, shared = load_study(path)
    with pytest.raises(ConfigError) as err:
        run_study(study, shared, workers=1)
    text = str(err.value)
    assert text.startswith("3 of 4 cells are invalid, nothing was run:")
    assert "algo=fedprx,lr=0.1,seed=0: " in text and "algo=fedavg,lr=-1.0,seed=0: " in text
    assert "did you mean 'fedprox'" in text
    assert not (tmp_path / "out").exists()


def test_a_cell_that_cannot_be_batched_with_cohort_batching_on_is_refused_before_any_run(tmp_path) -> None:
    path = write_study(tmp_path, variants=[{"algo": "fedpm"}, {"algo": "fedpm", "fedpm.mode": "exact"}],
                       grid={"cohort-batching": ["on"]}, seeds=[0])
    study, shared = load_study(path)
    with pytest.raises(ConfigError) as err:
        run_study(study, shared, workers=1)
    text = str(err.value)
    assert text.startswith("1 of 2 cells are invalid, nothing was run:")
    assert "fedpm.mode='exact' takes full-batch Newton steps per client" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # five runs and three reports: 15-30 s
def test_a_study_runs_resumes_and_reports(tmp_path) -> None:
    path = write_study(tmp_path, variants=[{"algo": "fedavg"}, {"algo": "fedprox", "fedprox.mu": 0.1}],
                       seeds=[0, 1])
    study, shared = load_study(path)
    lines = Lines()
    first = run_study(study, shared, workers=1, out=lines)
    assert first == {"cells": 4, "skipped": 0, "ran": 4, "failed": {}}
    cells = tmp_path / "out" / "s" / "cells"
    assert sorted(p.name for p in cells.iterdir()) == sorted(c.name for c in study.cells)
    config = json.loads((cells / "algo=fedprox,fedprox.mu=0.1,seed=1" / "config.json").read_text())
    assert config["fedprox.mu"] == 0.1 and config["seed"] == 1 and config["num-server-rounds"] == 2
    rows = list(csv.DictReader(open(tmp_path / "out" / "s" / "report" / "groups.csv")))
    assert [(r["runs"], r["seeds"]) for r in rows] == [("2", "0 1"), ("2", "0 1")]
    assert all(0 <= float(r["final_accg_mean"]) <= 1 and r["final_accg_std"] != "" for r in rows)
    assert "Grouped over seeds" in (tmp_path / "out" / "s" / "report" / "comparison.md").read_text()
    assert any("4/4" in line for line in lines)
    # the same command again: nothing to run
    assert run_study(study, shared, workers=1, out=lines)["ran"] == 0
    # a cell killed mid-run (its folder but no summary) runs again from round 1
    (cells / "algo=fedavg,seed=1" / "summary.json").unlink()
    again = run_study(study, shared, workers=1, out=lines)
    assert (again["skipped"], again["ran"]) == (3, 1)
    assert (cells / "algo=fedavg,seed=1" / "summary.json").is_file()


@pytest.mark.slow  # a killed and resumed sweep cell: the full suite
def test_a_killed_cell_goes_on_from_its_checkpoint(tmp_path) -> None:
    import numpy as np

    path = write_study(tmp_path, base={**TINY, "num-server-rounds": 3, "checkpoint-every": 1}, seeds=[0])
    study, shared = load_study(path)
    run_study(study, shared, workers=1, out=open("/dev/null", "w"))
    cell = tmp_path / "out" / "s" / "cells" / "seed=0"
    whole = dict(np.load(cell / "final_model.npz"))
    # as if killed in round 3: its checkpoint and results never written
    for name in ("checkpoints/round-00003.zip", "summary.json", "final_model.npz"):
        (cell / name).unlink()
    again = run_study(study, shared, workers=1, out=open("/dev/null", "w"))
    assert (again["skipped"], again["ran"], again["failed"]) == (0, 1, {})
    assert json.loads((cell / "config.json").read_text())["resume"] == str(cell)  # resumed, not rerun
    resumed = dict(np.load(cell / "final_model.npz"))
    assert all(np.array_equal(whole[k], resumed[k]) for k in whole)
    rows = [json.loads(line)["round"] for line in (cell / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    # killed again, and the study changed meanwhile: its checkpoint is not this cell's any more
    (cell / "summary.json").unlink()
    path = write_study(tmp_path, base={**TINY, "num-server-rounds": 3, "checkpoint-every": 1, "lr": 0.02}, seeds=[0])
    study, shared = load_study(path)
    assert run_study(study, shared, workers=1, out=open("/dev/null", "w"))["failed"] == {}
    config = json.loads((cell / "config.json").read_text())
    assert config["lr"] == 0.02 and config["resume"] == ""  # run again from round 1


@pytest.mark.slow  # a real run and a report: 4 s (the plan checks run quick on faked cells below)
def test_a_finished_cell_is_skipped_and_a_study_changed_under_it_is_refused(tmp_path) -> None:
    path = write_study(tmp_path, seeds=[0], base={**TINY, "num-server-rounds": 1})
    study, shared = load_study(path)
    quiet = open("/dev/null", "w")
    assert run_study(study, shared, workers=1, out=quiet)["ran"] == 1
    assert run_study(study, shared, workers=1, out=quiet)["skipped"] == 1
    changed = write_study(tmp_path, seeds=[0], base={**TINY, "num-server-rounds": 1, "lr": 0.5})
    study, shared = load_study(changed)
    with pytest.raises(ConfigError, match=r"(?s)other settings than the study file now says.*seed=0 \(lr: 0.05 -> 0.5\)"):
        run_study(study, shared, workers=1)


def test_random_draws_by_hand() -> None:
    """Python's Random(0).random() starts 0.8444218515250481, 0.7579544029403025,
    0.420571580830845, 0.25891675029296335: each draw takes one number per key,
    in the keys' order; floats keep 4 significant digits."""
    draws = random_draws({"count": 2, "keys": {
        "lr": {"log-uniform": [1e-3, 1e-1]},        # 10 ** (-3 + 2 * 0.84442) = 0.048848...
        "local-epochs": {"int-uniform": [1, 3]},    # 1 + int(0.75795 * 3) = 3
    }})
    assert draws == [{"lr": 0.04885, "local-epochs": 3}, {"lr": 0.006937, "local-epochs": 1}]
    # 10 ** (-3 + 2 * 0.42057) = 0.0069369...; 1 + int(0.25892 * 3) = 1
    assert random_draws({"count": 1, "keys": {"m": {"uniform": [0.0, 0.5]},
                                              "b": {"choice": [16, 32, 64]}}}) == [{"m": 0.4222, "b": 64}]
    # 0.5 * 0.84442 = 0.42221; [16, 32, 64][int(0.75795 * 3)] = 64
    seeded = {"count": 3, "seed": 7, "keys": {"lr": {"uniform": [0.0, 1.0]}}}
    assert random_draws(seeded) == random_draws(seeded) != random_draws({**seeded, "seed": 8})
    assert random_draws(None) == [{}]


def test_random_draws_never_repeat_and_say_when_they_cannot() -> None:
    small = {"keys": {"b": {"choice": [16, 32]}, "e": {"int-uniform": [1, 3]}}}
    draws = random_draws({**small, "count": 6})
    assert sorted((d["b"], d["e"]) for d in draws) == [(b, e) for b in (16, 32) for e in (1, 2, 3)]
    with pytest.raises(ConfigError, match="only 6 distinct draws found for count=7"):
        random_draws({**small, "count": 7})


def test_a_random_study_crosses_variants_draws_and_seeds(tmp_path) -> None:
    path = write_study(tmp_path, variants=[{"algo": "fedavg"}, {"algo": "fedprox"}], seeds=[0, 1],
                       random={"count": 2, "keys": {"fedprox": {"mu": {"log-uniform": [1e-3, 1.0]}}}})
    with pytest.raises(ConfigError, match="fedprox.mu=0.3414: is a hyperparameter of algo=.fedprox."):
        from fedaccel.sweep import check_cells
        check_cells(*load_study(path))
    path = write_study(tmp_path, variants=[{"algo": "fedprox"}], seeds=[0, 1], grid={"lr": [0.01, 0.1]},
                       random={"count": 2, "keys": {"fedprox": {"mu": {"log-uniform": [1e-3, 1.0]}}}})
    study, _ = load_study(path)
    assert [c.name for c in study.cells] == [  # variant x grid x draw x seed
        f"algo=fedprox,lr={lr},fedprox.mu={mu},seed={seed}"
        for lr in (0.01, 0.1) for mu in (0.3414, 0.1879) for seed in (0, 1)]


@pytest.mark.parametrize("text, wanted", [
    ("random: {count: 2, keys: {lr: {gauss: [0.1, 0.2]}}}\n", "random.keys.lr: one of {uniform: [low, high]}"),
    ("random: {count: 2, keys: {lr: {log-uniform: [0, 1]}}}\n", "log-uniform needs low and high > 0"),
    ("random: {count: 2, keys: {lr: {uniform: [1, 0]}}}\n", "uniform needs [low, high] numbers with low <= high"),
    ("random: {count: 2, keys: {e: {int-uniform: [1, 2.5]}}}\n", "int-uniform needs whole numbers"),
    ("random: {count: 0, keys: {lr: {uniform: [0, 1]}}}\n", "random.count: must be an integer >= 1"),
    ("random: {keys: {lr: {uniform: [0, 1]}}}\n", "random: a mapping {count: n, seed: s, keys:"),
    ("grid: {lr: [0.1]}\nrandom: {count: 1, keys: {lr: {uniform: [0, 1]}}}\n", "lr in both grid and random"),
])
def test_malformed_random_sections_get_one_line(tmp_path, capsys, text, wanted) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedaccel-sweep: error: ") and wanted in err and "\n" not in err


@pytest.mark.parametrize("text, wanted", [
    ("name: x\nlr: 0.1\n", "unknown study key(s) lr"),
    ("grid: {lr: 0.1}\n", "grid.lr: must be a non-empty list"),
    ("seeds: [a]\n", "seeds must be a non-empty list of integers"),
    ("grid: [1\n", "not valid YAML at line 2"),
])
def test_malformed_study_files_get_one_line(tmp_path, capsys, text, wanted) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedaccel-sweep: error: ") and wanted in err and "\n" not in err


def test_dry_run_lists_the_cells(tmp_path, capsys) -> None:
    path = write_study(tmp_path, grid={"lr": {"log": [0.01, 0.1], "count": 2}}, seeds=[0, 1])
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert out.out.split("\n")[:4] == ["lr=0.01,seed=0  (to run)", "lr=0.01,seed=1  (to run)",
                                      "lr=0.1,seed=0  (to run)", "lr=0.1,seed=1  (to run)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two worker processes start and import torch: ~10 s
def test_workers_run_cells_in_parallel_processes(tmp_path) -> None:
    path = write_study(tmp_path, seeds=[0, 1, 2])
    study, shared = load_study(path)
    outcome = run_study(study, shared, workers=2, out=open("/dev/null", "w"))
    assert outcome == {"cells": 3, "skipped": 0, "ran": 3, "failed": {}}
    for seed in (0, 1, 2):
        assert (tmp_path / "out" / "s" / "cells" / f"seed={seed}" / "summary.json").is_file()


STUDIES = sorted((Path(__file__).resolve().parents[1] / "configs" / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_study_files_are_valid(path, tmp_path) -> None:
    from fedaccel.sweep import check_cells

    study, shared = load_study(path, results_dir=str(tmp_path))
    assert len(check_cells(study, shared)) == len(study.cells) > 1
    assert f"fedaccel-sweep configs/studies/{path.name}" in path.read_text()


def test_a_cell_is_finished_when_its_status_says_so_not_at_its_summary(tmp_path) -> None:
    """A run writes summary.json, draws its curves, then sets its status to
    finished: a cell killed in between is not finished (it is run again),
    as fedaccel-compare, which makes the report, does not count it either;
    a run recorded before status.json existed counts by its summary."""
    from fedaccel.compare import run_state_of
    from fedaccel.sweep import finished

    cell = tmp_path / "cell"
    cell.mkdir()
    assert not finished(cell)
    (cell / "summary.json").write_text(json.dumps({"final_accg": 0.5}))
    assert finished(cell) and run_state_of(cell, {})[0] == "finished"  # no status.json: an older run
    (cell / "status.json").write_text(json.dumps({"state": "running", "host": "elsewhere", "pid": 1}))
    assert not finished(cell) and run_state_of(cell, {})[0] == "running"
    (cell / "status.json").write_text(json.dumps({"state": "finished"}))
    assert finished(cell) and run_state_of(cell, {})[0] == "finished"


@pytest.mark.slow  # a real fedaccel-sweep process, killed and started again: ~20 s
def test_a_killed_sweep_resumes_with_the_same_command(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    path = write_study(tmp_path, seeds=[0, 1, 2], base={**TINY, "num-server-rounds": 3})
    cells = tmp_path / "out" / "s" / "cells"
    command = [sys.executable, "-m", "fedaccel.sweep", str(path), "--workers", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    from fedaccel.results import run_finished

    while not run_finished(cells / "seed=0"):  # the first cell has finished: its summary and its status
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished_before = {p.name for p in cells.iterdir() if run_finished(p)}
    assert "seed=0" in finished_before and len(finished_before) < 3
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"3 cells, {len(finished_before)} already finished" in again.stderr
    assert all((cells / f"seed={s}" / "summary.json").is_file() for s in (0, 1, 2))
    assert (tmp_path / "out" / "s" / "report" / "groups.csv").is_file()


@pytest.mark.slow  # starts a local Ray: ~20 s
def test_cells_run_as_ray_tasks_and_their_files_come_back(tmp_path) -> None:
    """``--ray-address local``, the workers acting as if on other machines:
    each cell runs in a Ray worker into a temporary folder; its files come
    back and land in the cell's folder."""
    path = write_study(tmp_path, seeds=[0, 1])
    study, shared = load_study(path)
    lines = Lines()
    outcome = run_study(study, shared, out=lines, ray_address="local", ray_shared_folder=False)
    assert outcome == {"cells": 2, "skipped": 0, "ran": 2, "failed": {}}
    assert "on Ray at local" in lines[0]
    for seed in (0, 1):
        folder = tmp_path / "out" / "s" / "cells" / f"seed={seed}"
        assert {"summary.json", "metrics.jsonl", "config.json", "final_model.npz"} <= {p.name for p in folder.iterdir()}
        assert json.loads((folder / "config.json").read_text())["seed"] == seed
    assert not list((tmp_path / "out" / "s" / "cells").glob("*/.*.tmp"))
    config = json.loads((tmp_path / "out" / "s" / "cells" / "seed=0" / "config.json").read_text())
    assert config["results-dir"] != str(tmp_path / "out" / "s" / "cells")  # the worker's temporary folder


@pytest.mark.slow  # a two-node Ray cluster on this machine: ~30 s
def test_cells_spread_over_the_nodes_of_a_multi_node_ray_cluster(tmp_path) -> None:
    """Two Ray nodes of one CPU each (``ray.cluster_utils.Cluster``, as two
    machines would be): the two cells run at once, one on each node, and the
    progress lines say where."""
    import re

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        study, shared = load_study(write_study(tmp_path, seeds=[0, 1]))
        lines = Lines()
        outcome = run_study(study, shared, out=lines, ray_address=cluster.address)
    finally:
        cluster.shutdown()
    assert outcome == {"cells": 2, "skipped": 0, "ran": 2, "failed": {}}
    nodes = {m.group(1) for line in lines if (m := re.search(r"done in .* s \(.*, Ray node (\w+)\)", line))}
    assert len(nodes) == 2, lines
    for seed in (0, 1):
        assert (tmp_path / "out" / "s" / "cells" / f"seed={seed}" / "summary.json").is_file()


@pytest.mark.slow  # starts a local Ray three times: ~25 s
def test_a_killed_ray_cell_goes_on_from_its_checkpoint_in_place_or_shipped(tmp_path) -> None:
    """A Ray worker that sees the sweep's folder runs its cell in place (its
    checkpoints there as it runs); one on another machine gets a resumed
    cell's files shipped and sends all back. Either way a cell killed in
    round 3 resumes from its round-2 checkpoint to the uninterrupted model."""
    import numpy as np

    path = write_study(tmp_path, base={**TINY, "num-server-rounds": 3, "checkpoint-every": 1}, seeds=[0])
    study, shared = load_study(path)
    quiet = open(os.devnull, "w")
    cell = tmp_path / "out" / "s" / "cells" / "seed=0"
    assert run_study(study, shared, out=quiet, ray_address="local")["ran"] == 1
    assert json.loads((cell / "config.json").read_text())["results-dir"] == str(cell.parent)  # in place
    whole = dict(np.load(cell / "final_model.npz"))
    for in_place in (True, False):
        for name in ("checkpoints/round-00003.zip", "summary.json", "final_model.npz"):
            (cell / name).unlink()  # as if killed in round 3
        again = run_study(study, shared, out=quiet, ray_address="local", ray_shared_folder=in_place)
        assert (again["skipped"], again["ran"], again["failed"]) == (0, 1, {})
        resume = json.loads((cell / "config.json").read_text())["resume"]
        assert resume and (resume == str(cell)) is in_place  # resumed (not rerun): here, or in the worker's copy
        resumed = dict(np.load(cell / "final_model.npz"))
        assert all(np.array_equal(whole[k], resumed[k]) for k in whole)
        rows = [json.loads(line)["round"] for line in (cell / "metrics.jsonl").read_text().splitlines()]
        assert rows == [1, 2, 3] and (cell / "checkpoints" / "round-00003.zip").is_file()


def test_named_variant_axes_are_crossed(tmp_path) -> None:
    path = write_study(tmp_path, variants={
        "method": [{"algo": "fedavg"}, {"algo": "fedprox", "fedprox.mu": 0.001}],
        "data": [{"synthetic": {"alpha": 0.0, "beta": 0.0}}, {"synthetic.alpha": 1.0, "synthetic.beta": 1.0}]},
        seeds=[0])
    study, _ = load_study(path)
    assert [c.name for c in study.cells] == [
        "algo=fedavg,synthetic.alpha=0.0,synthetic.beta=0.0,seed=0",
        "algo=fedavg,synthetic.alpha=1.0,synthetic.beta=1.0,seed=0",
        "algo=fedprox,fedprox.mu=0.001,synthetic.alpha=0.0,synthetic.beta=0.0,seed=0",
        "algo=fedprox,fedprox.mu=0.001,synthetic.alpha=1.0,synthetic.beta=1.0,seed=0"]
    with pytest.raises(ConfigError, match="named lists of them"):
        load_study(write_study(tmp_path, variants={"method": [{"algo": "fedavg"}], "data": []}))


def fake_finished(study, name: str) -> None:
    folder = study.folder / "cells" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text("{}")


def plan(path):
    from fedaccel.sweep import check_cells, check_plan

    study, shared = load_study(path)
    check_plan(study, check_cells(study, shared))
    return study


def test_a_cell_that_leaves_the_study_and_comes_back_changed_is_refused(tmp_path) -> None:
    study = plan(write_study(tmp_path, seeds=[0]))
    fake_finished(study, "seed=0")
    plan(write_study(tmp_path, seeds=[1], base={**TINY, "lr": 0.5}))  # seed=0 not in this study
    with pytest.raises(ConfigError, match=r"(?s)seed=0 \(lr: 0.05 -> 0.5\)"):
        plan(write_study(tmp_path, seeds=[0, 1], base={**TINY, "lr": 0.5}))


def test_the_same_study_from_another_path_is_not_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    study = plan(write_study(tmp_path, seeds=[0], **{"results-dir": "out"}))
    fake_finished(study, "seed=0")
    plan(write_study(tmp_path, seeds=[0], **{"results-dir": str(tmp_path / "out")}))  # absolute now


def test_home_in_results_dir_and_a_damaged_summary(tmp_path, monkeypatch) -> None:
    from fedaccel.sweep import finished

    monkeypatch.setenv("HOME", str(tmp_path))
    study, _ = load_study(write_study(tmp_path, seeds=[0], **{"results-dir": "~/sweeps"}))
    assert study.folder == tmp_path / "sweeps" / "s"
    fake_finished(study, "seed=0")
    assert finished(study.folder / "cells" / "seed=0")
    (study.folder / "cells" / "seed=0" / "summary.json").write_text('{"final_accg": 0.')  # killed mid-write
    assert not finished(study.folder / "cells" / "seed=0")


def test_a_run_file_is_found_next_to_the_study_and_bad_paths_get_one_line(tmp_path, capsys, monkeypatch) -> None:
    import yaml

    (tmp_path / "run.yaml").write_text("lr: 0.02\n")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"config": "run.yaml", "base": TINY, "seeds": [0],
                                    "results-dir": str(tmp_path / "out")}))
    monkeypatch.chdir("/")
    _, shared = load_study(path)
    assert shared["lr"] == 0.02
    for bad in (str(tmp_path), str(tmp_path / "missing.yaml")):
        assert main([bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("fedaccel-sweep: error: ") and "\n" not in err
    path.write_text(yaml.safe_dump({"variants": [{1: 2}]}))
    assert main([str(path)]) == 2
    assert "key 1 is not a string; run-config keys are names" in capsys.readouterr().err


def test_a_damaged_plan_is_one_line(tmp_path, capsys) -> None:
    path = write_study(tmp_path, seeds=[0])
    plan(path)
    (tmp_path / "out" / "s" / "plan.json").write_text("{not json")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedaccel-sweep: error: ") and "is not a sweep plan (damaged?): delete it" in err


from test_configs import ROOT, _bench  # noqa: E402  (a bench script as a module, one helper for both)


def _gradient_correction_runs(monkeypatch, argv=()):
    """The runs of `python bench/gradient_correction.py [argv]` (main(), phase run)."""
    bench = _bench(monkeypatch, "gradient_correction")
    args = bench.parse_args(list(argv))
    return [bench.make_run(args, m, alpha, seed) for seed in args.seeds for alpha in args.alphas
            for m in (bench.MAIN + [a for a in bench.ABLATION if a not in bench.MAIN]
                      if alpha in args.ablation_alphas else bench.MAIN)]


def _fedpm_test2_runs(monkeypatch):
    """The runs of `python bench/fedpm_test2.py` (main(), phase run, default arguments; not --phase lr)."""
    bench = _bench(monkeypatch, "fedpm_test2")
    args = bench.parse_args([])
    assert args.phase == "run"
    return [bench.make_run(args, m, alpha, seed) for seed in args.seeds for alpha in args.alphas
            for m in args.methods]


def _gradient_correction_5pct_runs(monkeypatch):
    """The runs of `python bench/gradient_correction.py --per-round 5 --ablation-alphas`."""
    return _gradient_correction_runs(monkeypatch, ["--per-round", "5", "--ablation-alphas"])


def _fedpm_test1_runs(monkeypatch):
    """The runs of `python bench/fedpm_test1.py` (--rounds 30, the default, and --rounds 200; --clients 10)."""
    bench = _bench(monkeypatch, "fedpm_test1")
    return bench.make_runs(30, 10) + bench.make_runs(200, 10)


@pytest.mark.parametrize("name,bench_runs", [("fedrkmgc-ablation", _gradient_correction_runs),
                                             ("fedrkmgc-5pct", _gradient_correction_5pct_runs),
                                             ("fedpm-test2", _fedpm_test2_runs),
                                             ("fedpm-test1", _fedpm_test1_runs)])
def test_paper_study_cells_are_the_bench_scripts_runs(monkeypatch, tmp_path, name, bench_runs) -> None:
    """The study's cells are one-to-one the runs of its bench script's default
    invocation: every cell's full run config equals exactly one script run's
    (values and types, apart from where the run is written), every script run
    is a cell, and the study runs as many clients as the script."""
    from fedaccel.local_run import default_run_config, fuse
    from fedaccel.sweep import PLACE_KEYS, check_cells

    study, shared = load_study(ROOT / "configs" / "studies" / f"{name}.yaml", results_dir=str(tmp_path))
    cells = check_cells(study, shared)
    runs = bench_runs(monkeypatch)
    defaults = default_run_config()

    def typed(config):
        return {k: (v, type(v).__name__) for k, v in config.items() if k not in PLACE_KEYS}

    ours = [typed(config) for config in cells]
    theirs = [typed(fuse(defaults, run["overrides"])) for run in runs]

    def closest(config, candidates):
        """(differing keys, (ours, theirs) for each) against the nearest candidate."""
        diffs = [{k: (config.get(k), other.get(k)) for k in sorted(set(config) | set(other))
                  if config.get(k) != other.get(k)} for other in candidates]
        return min(diffs, key=len) if diffs else {}

    problems = []
    for cell, config in zip(study.cells, ours):
        matches = [run["name"] for run, other in zip(runs, theirs) if other == config]
        if len(matches) != 1:
            problems.append(f"cell {cell.name}: matches {len(matches)} script runs {matches}; nearest "
                            f"differs in (cell, script): {closest(config, theirs)}")
    for run, other in zip(runs, theirs):
        if other not in ours:
            problems.append(f"script run {run['name']} is no cell; nearest cell differs in "
                            f"(cell, script): {closest(other, ours)}")
    assert not problems, f"{name}: {len(cells)} cells, {len(runs)} script runs:\n" + "\n".join(problems)
    assert len(cells) == len(runs)
    assert {run["num_clients"] for run in runs} == {study.num_clients}, "num-clients differs from the script's"


def test_a_study_another_live_sweep_runs_is_refused(tmp_path) -> None:
    import subprocess
    import sys

    from fedaccel.processes import process_start

    path = write_study(tmp_path, seeds=[0])
    study, shared = load_study(path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        study.folder.mkdir(parents=True)
        (study.folder / "plan.json").write_text(json.dumps({
            "num-clients": 4, "cells": {}, "pid": other.pid, "pid_start": process_start(other.pid),
            "host": __import__("socket").gethostname()}))
        with pytest.raises(ConfigError, match=f"is being run by another fedaccel-sweep \\(process {other.pid}\\)"):
            run_study(study, shared, workers=1, out=open("/dev/null", "w"))
    finally:
        other.kill()
        other.wait()
    # once it has ended, the same study runs
    assert run_study(study, shared, workers=1, out=open("/dev/null", "w"))["failed"] == {}


def test_an_unknown_federation_is_refused_before_any_cell(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))  # a Flower config with no fedaccel profiles
    path = write_study(tmp_path, seeds=[0])
    assert main([str(path), "--federation", "no-such-connection"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedaccel-sweep: error: --federation no-such-connection: not a SuperLink connection "
                          "of Flower's config.toml") and err.endswith("run fedaccel-federations install")
    assert "\n" not in err and not (tmp_path / "out" / "s" / "cells").exists()
    with pytest.raises(SystemExit) as usage:  # argparse's usage error: cells on Flower run one at a time
        main([str(path), "--federation", "x", "--workers", "2"])
    assert usage.value.code == 2
    assert "--federation runs the cells one after another on Flower" in capsys.readouterr().err


def test_a_study_that_needs_the_optimum_is_refused_on_a_federation_before_any_cell(tmp_path, capsys) -> None:
    path = write_study(tmp_path, seeds=[0], base={**TINY, "model": "logreg", "weight-decay": 0.01,
                                                   "optimality": True})
    assert main([str(path), "--federation", "local-simulation"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedaccel-sweep: error: cell seed=0: init='near-optimum' and optimality=true run in "
                          "the fast runner only") and "\n" not in err
    assert not (tmp_path / "out" / "s" / "cells").exists()


def test_a_bench_table_takes_its_runs_from_the_study_cells_that_equal_them(tmp_path, monkeypatch) -> None:
    """``bench/gradient_correction.py --phase table --from-study``: each of
    the script's runs is the study cell with every one of its overrides
    (values and types), recorded as the script records its own runs."""
    bench = _bench(monkeypatch, "gradient_correction")
    jobs = [bench.make_run(bench.parse_args([]), "FedAvg", 0.3, seed) for seed in (0, 1)]
    cells = tmp_path / "study" / "cells"
    for job, accs in zip(jobs, ([0.5, 0.6], [0.55, 0.65])):
        folder = cells / job["name"]
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**job["overrides"], "run-name": job["name"]}))
        (folder / "summary.json").write_text(json.dumps({"final_accg": accs[-1], "total_mb": 2.0,
                                                         "total_seconds": 12.5}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": 5 * (i + 1), "accg": a}) + "\n"
                                                      for i, a in enumerate(accs)))
    runner = sys.modules["runner"]
    records = runner.records_from_study(jobs, tmp_path / "study")
    assert [(r["seed"], r["final_accg"], r["seconds"], r["accg_curve"]) for r in records] == [
        (0, 0.6, 12.5, [[5, 0.5], [10, 0.6]]), (1, 0.65, 12.5, [[5, 0.55], [10, 0.65]])]
    # a cell whose value differs only in type is not that run
    config = cells / jobs[1]["name"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "seed": 1.0}))  # 1.0 == 1, a float
    with pytest.raises(SystemExit, match=r"0 cells of .* match it"):
        runner.records_from_study(jobs, tmp_path / "study")
    config.write_text(json.dumps({**json.loads(config.read_text()), "seed": 1}))
    # a cell that stopped with an error is the script's failed-run record
    failed = cells / jobs[1]["name"]
    (failed / "summary.json").unlink()
    (failed / "status.json").write_text(json.dumps({"state": "failed", "round": 1, "started": 100.0,
                                                    "updated": 112.0, "error": "round 2: diverged"}))
    (failed / "metrics.jsonl").write_text(json.dumps({"round": 1, "accg": 0.4}) + "\n")
    records = runner.records_from_study(jobs, tmp_path / "study")
    assert [(r["error"], r["last_round"], r["seconds"], r["final_accg"]) for r in records] == [
        (None, 10, 12.5, 0.6), ("round 2: diverged", 1, 12.0, None)]
    # one that is still running (or was killed) is not finished
    (failed / "status.json").write_text(json.dumps({"state": "running", "round": 1}))
    with pytest.raises(SystemExit, match=r"1 cells of .* match it \(not finished\)"):
        runner.records_from_study(jobs, tmp_path / "study")


def test_the_fedpm_test1_tables_take_each_run_from_the_cell_with_its_run_config(tmp_path, monkeypatch) -> None:
    """``bench/fedpm_test1.py --phase table --from-study``: each script run is
    the one cell with every one of its keys (values and types); round 0 is the
    cell's start (config.json), rounds 1.. its metrics; a cell that failed is
    a failed run; the kept lr is the smallest final gap; a study of another
    problem (another F*) is refused."""
    import torch

    bench = _bench(monkeypatch, "fedpm_test1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prob = bench.problem(10)
    finally:
        torch.set_num_threads(threads)
    runs = bench.make_runs(2, 10)
    sizes = [len(ys) for _, ys in prob["shards"]]
    cells = tmp_path / "study" / "cells"
    for i, run in enumerate(runs):
        folder = cells / f"cell{i}"
        folder.mkdir(parents=True)
        optimum = {"f-star": prob["f_star"], "start-dist": prob["start_dist"], "start-gap": 0.5}
        (folder / "config.json").write_text(json.dumps({**run["overrides"], "run-name": f"cell{i}", "resolved": {
            "optimum": optimum, "partition-sizes": sizes}}))
        failed = run["method"] == "FedAvg" and run["lr"] == 8.0
        rows = [{"round": 1, "gap": 0.1 / (i + 1), "dist": 0.3}] + ([] if failed else [
            {"round": 2, "gap": 0.01 / (i + 1), "dist": 0.2}])
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "status.json").write_text(json.dumps({"state": "failed" if failed else "finished",
                                                        "error": "round 2 failed" if failed else None}))
        if not failed:
            (folder / "summary.json").write_text(json.dumps({"total_seconds": 1.5}))
    grid, seconds = bench.grid_from_study(runs, tmp_path / "study", prob, 2)
    assert seconds == 1.5 * (len(runs) - 1)
    assert [(m, lr) for m, _, lr, *_ in grid] == [(r["method"], r["lr"]) for r in runs]
    first = grid[0]
    assert first[3] == [prob["start_dist"], 0.3, 0.2] and first[4] == [0.5, 0.1, 0.01] and first[5] == "ok"
    broken = next(row for row in grid if row[0] == "FedAvg" and row[2] == 8.0)
    assert broken[5] == "failed: round 2 failed" and math.isnan(broken[4][-1])
    kept = bench.keep_best(grid, 2)
    assert kept["FedAvg"][1] == 4.0  # the smallest final gap among the finished ones (lr 8 failed)
    # a cell whose lr differs only in type is not that run
    config = cells / "cell0" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lr": 1}))
    with pytest.raises(SystemExit, match=r"FedAvg lr=1: 0 cells of .* have its run config"):
        bench.grid_from_study(runs, tmp_path / "study", prob, 2)
    config.write_text(json.dumps({**json.loads(config.read_text()), "lr": 1.0}))
    optimum_of_another_problem = {**json.loads(config.read_text())}
    optimum_of_another_problem["resolved"]["optimum"]["f-star"] = 0.1
    config.write_text(json.dumps(optimum_of_another_problem))
    with pytest.raises(SystemExit, match="are not this script's"):
        bench.grid_from_study(runs, tmp_path / "study", prob, 2)


def test_a_cell_whose_auto_now_resolves_otherwise_is_run_again_not_resumed(tmp_path, monkeypatch) -> None:
    """A killed cell with a checkpoint of its own run config is resumed,
    unless a setting's 'auto' now resolves to another rule than the cell's
    config.json recorded (FedProx's straggler policy): that cell cannot go on
    and is run again from round 1 instead of failing on every rerun."""
    import fedaccel.sweep as sweep
    from fedaccel.local_run import default_run_config, fuse

    config = fuse(default_run_config(), {"algo": "fedprox", "straggler-fraction": 0.5})
    monkeypatch.setattr(sweep, "list_checkpoints", lambda run_dir: [run_dir / "checkpoints" / "round-00001.zip"])
    monkeypatch.setattr(sweep, "read_manifest", lambda path: {"round": 1, "run-config": config})
    for started, resumable in (("partial", True), ("drop", False)):
        (tmp_path / "config.json").write_text(json.dumps({"resolved": {"straggler_policy": started,
                                                                       "sampler": "uniform"}}))
        assert sweep._resumable(tmp_path, config) is resumable, started
