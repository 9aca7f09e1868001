"""bench/pooled_reference.py trains on the run's own data pooled in one place:
every client's training rows (not their local test splits), the run's test
set, model, batch size and optimizer settings; the same seed gives the same
curve, and it learns (far above chance on the default synthetic data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fakes import bench_script

from fedaccel.runtime import data_config_for, load_data

pytestmark = pytest.mark.slow  # about 6 s of training: the full suite runs it


def test_pooled_run_uses_every_clients_training_rows_and_the_run_test_set(tmp_path, capsys):
    pooled = bench_script("pooled_reference")
    out = tmp_path / "runs.jsonl"
    args = ["--num-clients", "20", "--set", "synthetic.max-samples=60", "--seeds", "3", "3", "--lrs", "0.05",
            "--epochs", "6", "--eval-every", "3", "--variants", "1,1", "--out", str(out)]
    threads = torch.get_num_threads()
    assert pooled.main(args) == 0
    assert torch.get_num_threads() == threads  # one thread while it trains, not after
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = pooled.run_config(pooled.base_run_config(None), {"synthetic.max-samples": 60, "seed": 3, "lr": 0.05,
                                   "synthetic.alpha": 1.0, "synthetic.beta": 1.0})
    data = load_data(data_config_for(cfg, 20))
    assert first["train_rows"] == sum(len(data.client(c).y_train) for c in range(20))
    assert first["test_rows"] == len(data.test_y) == sum(len(data.client(c).y_test) for c in range(20))
    assert first["batch_size"] == cfg.batch_size and first["momentum"] == cfg.momentum
    assert [e for e, _ in first["curve"]] == [3, 6]
    assert first["curve"] == second["curve"]  # the same seed, the same run
    assert first["final"] > 100 / 10 + 20  # 10 classes: well above chance
    assert "| (1.0, 1.0) | 0.05 |" in capsys.readouterr().out
    assert np.isfinite(first["best"]) and first["best"] >= first["final"]
