"""Glue from a :class:`RunConfig` to data and models, used by both apps."""

from __future__ import annotations

from typing import Any

import torch

from fedaccel.data import DataConfig, FederatedDataset, load_federated
from fedaccel.config import RunConfig
from fedaccel.models import build_model, default_model


def data_config_for(cfg: RunConfig, num_clients: int) -> DataConfig:
    """The data settings of a run; identical on the server and every client."""
    return DataConfig(
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
    )


def load_data(data_cfg: DataConfig) -> FederatedDataset:
    """Load (cached per process) the federated dataset."""
    return load_federated(data_cfg)


def model_name(cfg: RunConfig) -> str:
    """``model='auto'`` resolves to the dataset's default model."""
    return default_model(cfg.dataset) if cfg.model == "auto" else cfg.model


def build_model_for(cfg: RunConfig, dataset: FederatedDataset | Any) -> torch.nn.Module:
    """The run's model, initialised from ``seed`` (same weights everywhere)."""
    torch.manual_seed(cfg.seed)
    return build_model(model_name(cfg), tuple(dataset.input_shape), dataset.num_classes)
