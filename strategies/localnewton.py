"""LocalNewton (the FedPM paper's conventional SOPM baseline).

The same second-order local steps as FedPM (:class:`clients.fedpm.LocalNewtonSolver`,
FOOF or exact Newton on logistic regression), but the server takes the plain
sample-weighted mean of the local models (Flower's FedAvg), so clients upload
weights only. See docs/fedpm.md.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from clients.fedpm import LocalNewtonSolver, SecondOrderParams
from fedaccel.config import RunConfig
from fedaccel.registry import AlgorithmSpec
from strategies.base import FedAccelStrategy, Federation
from strategies.fedpm import check_exact_mode


class LocalNewtonStrategy(FedAccelStrategy, FedAvg):
    """Sample-weighted mean of second-order local models."""

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        check_exact_mode(run_cfg)
        super().__init__(run_cfg=run_cfg, federation=federation)


def build(cfg: RunConfig, federation: Federation) -> LocalNewtonStrategy:
    return LocalNewtonStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="localnewton", build_strategy=build, solver=LocalNewtonSolver, params=SecondOrderParams,
    summary="LocalNewton: FOOF/Newton local steps, plain weighted model averaging",
)
