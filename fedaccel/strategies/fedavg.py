"""FedAvg (McMahan et al. 2017): sample-weighted mean of the clients' models.

Aggregation is Flower's own ``FedAvg``; :class:`FedAccelStrategy` adds seeded
sampling, byte accounting and ACCL.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedavg import FedAvgSolver
from fedaccel.config import RunConfig
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation


@dataclass(frozen=True)
class FedAvgParams:
    """FedAvg has no hyperparameters of its own."""


class FedAvgStrategy(FedAccelStrategy, FedAvg):
    """Flower's FedAvg with fedaccel's seeded sampling and accounting."""


def build(cfg: RunConfig, federation: Federation) -> FedAvgStrategy:
    return FedAvgStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedavg", build_strategy=build, solver=FedAvgSolver, params=FedAvgParams,
    summary="FedAvg: local SGD, sample-weighted model averaging",
)
