"""Glue from a :class:`RunConfig` to data and models, used by both apps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedaccel.data import DataConfig, FederatedDataset, load_federated
from fedaccel.config import RunConfig, config_error
from fedaccel.models import build_model, default_model
from fedaccel.optimum import Optimum, optimum_for


#: ``precision`` -> the torch dtype of the model and every tensor of the run
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def data_config_for(cfg: RunConfig, num_clients: int) -> DataConfig:
    """The data settings of a run; identical on the server and every client."""
    return DataConfig(
        precision=cfg.precision,
        dataset=cfg.dataset,
        num_clients=num_clients,
        partition=cfg.partition,
        dirichlet_alpha=cfg.dirichlet_alpha,
        seed=cfg.seed,
        data_dir=cfg.data_dir,
        local_test_fraction=cfg.local_test_fraction,
        train_samples=cfg.train_samples,
        synthetic_alpha=cfg.synthetic.alpha,
        synthetic_beta=cfg.synthetic.beta,
        synthetic_iid=cfg.synthetic.iid,
        synthetic_max_samples=cfg.synthetic.max_samples,
        synthetic_size_mu=cfg.synthetic.size_mu,
        synthetic_min_samples=cfg.synthetic.min_samples,
        synthetic_shared_model=cfg.synthetic.shared_model,
        clients_key="logical-clients" if cfg.logical_clients else "num-clients",
    )


def load_data(data_cfg: DataConfig) -> FederatedDataset:
    """Load (cached per process) the federated dataset."""
    return load_federated(data_cfg)


def model_name(cfg: RunConfig) -> str:
    """``model='auto'`` resolves to the dataset's default model."""
    return default_model(cfg.dataset) if cfg.model == "auto" else cfg.model


def build_model_for(cfg: RunConfig, dataset: FederatedDataset | Any) -> torch.nn.Module:
    """The run's model in its ``precision``, the same weights everywhere:
    initialised from ``seed`` (``init='seeded'``), or the optimum of the
    run's objective plus ``init-noise`` (``init='near-optimum'``, seeded too)."""
    torch.manual_seed(cfg.seed)
    model = build_model(model_name(cfg), tuple(dataset.input_shape), dataset.num_classes)
    model = model.to(TORCH_DTYPES[cfg.precision])
    if cfg.init == "near-optimum":
        start = optimum_of(cfg, dataset).near(cfg.init_noise, cfg.seed)
        with torch.no_grad():
            for key, value in start.items():
                model.get_parameter(key).copy_(value)
    return model


def optimum_of(cfg: RunConfig, dataset: FederatedDataset | Any) -> Optimum:
    """The optimum of the run's objective over its clients' training data
    (:mod:`fedaccel.optimum`; refused for a dataset this process does not
    hold, such as a device's own data file)."""
    if not isinstance(dataset, FederatedDataset):
        raise config_error(*cfg.optimum_setting, "needs the run's whole training data in this process; a "
                           "SuperNode with its own data-path holds only its own: use the fast runner (fedaccel-run)")
    return optimum_for(dataset.config, cfg.weight_decay, dataset.num_classes)


def load_final_model(run_dir: str | Path) -> torch.nn.Module:
    """The final global model of a finished run: the model its
    ``config.json`` names (``resolved``'s ``model``, ``input-shape`` and
    ``num-classes``, in the run's ``precision``) with ``final_model.npz``
    loaded into it, on the CPU and in eval mode. A folder without those
    files or keys raises ``FileNotFoundError`` / ``ValueError`` saying
    what is missing."""
    run_dir = Path(run_dir)
    config_path, weights_path = run_dir / "config.json", run_dir / "final_model.npz"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir}: no config.json (not a fedaccel run folder)")
    if not weights_path.is_file():
        raise FileNotFoundError(f"{run_dir}: no final_model.npz (the run did not finish; its status.json says why)")
    config = json.loads(config_path.read_text())
    resolved = config.get("resolved") if isinstance(config.get("resolved"), dict) else {}
    missing = [key for key in ("model", "input-shape", "num-classes") if key not in resolved]
    if missing:
        raise ValueError(f"{config_path}: resolved lacks {', '.join(missing)} (a run written before they were "
                         "recorded): build the model with fedaccel.models.build_model(name, input_shape, "
                         "num_classes) and load final_model.npz into it")
    model = build_model(resolved["model"], resolved["input-shape"], int(resolved["num-classes"]))
    precision = resolved.get("precision", config.get("precision", "float32"))
    if precision not in TORCH_DTYPES:
        raise ValueError(f"{config_path}: precision={precision!r} is not one of {', '.join(TORCH_DTYPES)}")
    model = model.to(TORCH_DTYPES[precision])
    with np.load(weights_path) as weights:
        model.load_state_dict({key: torch.from_numpy(weights[key]) for key in weights.files})
    return model.eval()
