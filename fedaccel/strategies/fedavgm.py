"""FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification", arXiv:1909.06335): server
SGD with momentum on the pseudo-gradient.

``v = beta v + (x - aggregate)``, ``x = x - server_lr * v`` (the first round
sets ``v`` to the pseudo-gradient, which equals starting from ``v = 0``):
:func:`fedaccel.strategies.server_steps.momentum_step`, bit-identical to Flower's
``FedAvgM`` (tested). It runs as the :meth:`server_step` hook, after the
update transforms, so with ``gc.mode`` global/hybrid the momentum is built
from the centralized update.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedavg import FedAvgSolver
from fedaccel.arrays import numpy_to_record, record_to_numpy
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import momentum_step


@dataclass(frozen=True)
class FedAvgMParams:
    """``fedavgm.server-lr`` and ``fedavgm.server-momentum``."""

    server_lr: float = 1.0
    server_momentum: float = 0.9

    def validate(self, prefix: str) -> None:
        require(self.server_lr > 0, f"{prefix}.server-lr", self.server_lr, "must be > 0")
        require(0 <= self.server_momentum < 1, f"{prefix}.server-momentum",
                self.server_momentum, "must be in [0, 1)")


class FedAvgMStrategy(FedAccelStrategy, FedAvg):
    """FedAvg's example-weighted mean, then server SGD with momentum."""

    carried_state = ("velocity",)  # checkpointed (fedaccel.checkpoint)

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.params = run_cfg.algo_params
        self.velocity: dict[str, np.ndarray] | None = None

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        x = record_to_numpy(self.global_arrays)
        new, self.velocity = momentum_step(x, record_to_numpy(aggregate), self.velocity,
                                           self.params.server_lr, self.params.server_momentum)
        return numpy_to_record(new)


def build(cfg: RunConfig, federation: Federation) -> FedAvgMStrategy:
    return FedAvgMStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedavgm", build_strategy=build, solver=FedAvgSolver, params=FedAvgMParams,
    summary="FedAvgM: FedAvg with server momentum",
)
