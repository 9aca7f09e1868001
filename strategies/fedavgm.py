"""FedAvgM (Hsu et al. 2019): server SGD with momentum on the pseudo-gradient.

Aggregation is Flower's ``FedAvgM``: ``v = beta v + (x - mean_i x_i)``,
``x = x - server_lr * v`` (its first round sets ``v`` to the pseudo-gradient,
which equals starting from ``v = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedAvgM

from clients.fedavg import FedAvgSolver
from fedaccel.config import RunConfig, require
from fedaccel.registry import AlgorithmSpec
from strategies.base import FedAccelStrategy, Federation


@dataclass(frozen=True)
class FedAvgMParams:
    """``fedavgm.server-lr`` and ``fedavgm.server-momentum``."""

    server_lr: float = 1.0
    server_momentum: float = 0.9

    def validate(self, prefix: str) -> None:
        require(self.server_lr > 0, f"{prefix}.server-lr", self.server_lr, "must be > 0")
        require(0 <= self.server_momentum < 1, f"{prefix}.server-momentum",
                self.server_momentum, "must be in [0, 1)")


class FedAvgMStrategy(FedAccelStrategy, FedAvgM):
    """Flower's FedAvgM with fedaccel's seeded sampling and accounting."""


def build(cfg: RunConfig, federation: Federation) -> FedAvgMStrategy:
    p = cfg.algo_params
    return FedAvgMStrategy(run_cfg=cfg, federation=federation,
                           server_learning_rate=p.server_lr, server_momentum=p.server_momentum)


ALGORITHM = AlgorithmSpec(
    name="fedavgm", build_strategy=build, solver=FedAvgSolver, params=FedAvgMParams,
    summary="FedAvgM: FedAvg with server momentum",
)
