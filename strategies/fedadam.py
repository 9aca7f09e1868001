"""FedAdam (Reddi et al. 2021, Algorithm 2): Adam on the server's pseudo-gradient.

Aggregation is Flower's ``FedAdam`` (``m = b1 m + (1-b1) d``,
``v = b2 v + (1-b2) d^2``, ``x = x + eta_t m / (sqrt(v) + tau)`` with Flower's
bias-corrected ``eta_t``), where ``d`` is the weighted mean client update.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedAdam

from clients.fedavg import FedAvgSolver
from fedaccel.config import RunConfig, require
from fedaccel.registry import AlgorithmSpec
from strategies.base import FedAccelStrategy, Federation


@dataclass(frozen=True)
class FedAdamParams:
    """``fedadam.server-lr``, ``fedadam.beta1``, ``fedadam.beta2``, ``fedadam.tau``."""

    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 0.001

    def validate(self, prefix: str) -> None:
        require(self.server_lr > 0, f"{prefix}.server-lr", self.server_lr, "must be > 0")
        require(0 <= self.beta1 < 1, f"{prefix}.beta1", self.beta1, "must be in [0, 1)")
        require(0 <= self.beta2 < 1, f"{prefix}.beta2", self.beta2, "must be in [0, 1)")
        require(self.tau > 0, f"{prefix}.tau", self.tau, "must be > 0 (adaptivity / epsilon)")


class FedAdamStrategy(FedAccelStrategy, FedAdam):
    """Flower's FedAdam with fedaccel's seeded sampling and accounting."""


def build(cfg: RunConfig, federation: Federation) -> FedAdamStrategy:
    p = cfg.algo_params
    return FedAdamStrategy(run_cfg=cfg, federation=federation, eta=p.server_lr,
                           eta_l=cfg.lr, beta_1=p.beta1, beta_2=p.beta2, tau=p.tau)


ALGORITHM = AlgorithmSpec(
    name="fedadam", build_strategy=build, solver=FedAvgSolver, params=FedAdamParams,
    summary="FedAdam: FedAvg with an Adam server optimizer",
)
