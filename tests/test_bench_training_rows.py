"""bench/training_rows_accuracy.py reads a sweep's final models on the run's
own data: on the test set it gives exactly the run's final accuracy (the
same data rebuilt from the cell's config), and on the training rows a
number of its own; seeds of one setting form one group."""

from __future__ import annotations

import json

import pytest
from fakes import bench_script

from fedaccel.sweep import main as sweep_main


@pytest.mark.slow  # two short runs: the full suite runs it
def test_final_models_are_read_on_the_runs_own_training_rows_and_test_set(tmp_path, capsys):
    study = tmp_path / "tiny.yaml"
    study.write_text("name: tiny\nnum-clients: 12\nbase:\n  num-server-rounds: 2\n  clients-per-round: 4\n"
                     "  local-epochs: 1\nseeds: [0, 1]\n")
    assert sweep_main([str(study), "--workers", "1", "--results-dir", str(tmp_path / "sweeps")]) == 0
    capsys.readouterr()
    out = tmp_path / "rows.jsonl"
    script = bench_script("training_rows_accuracy")
    assert script.main([str(tmp_path / "sweeps" / "tiny"), "--num-clients", "12", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["seed"] for r in records) == [0, 1]
    for r in records:
        summary = json.loads((tmp_path / "sweeps" / "tiny" / "cells" / r["cell"] / "summary.json").read_text())
        assert r["test"] == pytest.approx(100 * summary["final_accg"], abs=1e-6)
        assert 0 <= r["train"] <= 100
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.startswith("| tiny | ")]
    assert len(rows) == 1 and " | 2 | " in rows[0]  # the two seeds: one group of two runs


def test_a_folder_without_cells_is_one_line(tmp_path, capsys):
    script = bench_script("training_rows_accuracy")
    assert script.main([str(tmp_path), "--num-clients", "12"]) == 2
    assert "no cells/" in capsys.readouterr().err
