"""A finished run's folder rebuilds its final model (fedaccel.runtime.load_final_model)."""

from __future__ import annotations

import json

import pytest
import torch

from fedaccel.local_run import default_run_config, fuse, run_local
from fedaccel.run_config import parse_run_config
from fedaccel.runtime import data_config_for, load_data, load_final_model


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_the_rebuilt_model_scores_the_runs_final_accuracy(tmp_path, precision):
    cfg = fuse(default_run_config(), {"num-server-rounds": 2, "results-dir": str(tmp_path), "run-name": "r",
                                      "precision": precision, "clients-per-round": 3})
    run_dir = run_local(cfg, num_clients=6, quiet=True)
    model = load_final_model(run_dir)
    assert next(model.parameters()).dtype == getattr(torch, precision) and not model.training
    data = load_data(data_config_for(parse_run_config(cfg), 6))
    with torch.no_grad():
        predicted = model(torch.from_numpy(data.test_x)).argmax(dim=1)
    accuracy = (predicted == torch.from_numpy(data.test_y)).double().mean().item()
    final = json.loads((run_dir / "summary.json").read_text())["final_accg"]
    assert accuracy == pytest.approx(final, abs=1e-12)


def test_a_folder_it_cannot_rebuild_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_final_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"resolved": {"model": "mlp"}}))
    with pytest.raises(FileNotFoundError, match="no final_model.npz .the run did not finish"):
        load_final_model(tmp_path)
    (tmp_path / "final_model.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="resolved lacks input-shape, num-classes"):
        load_final_model(tmp_path)
