"""FedDyn (Acar et al. 2021, Algorithm 1): dynamic regularisation.

Server state ``h`` (zero at the start). After round ``t`` with participants
``P_t`` out of ``N`` clients and the sent model ``theta^{t-1}``:

    h       <- h - alpha/N * sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t <- (1/|P_t|) sum_{k in P_t} theta_k^t - h / alpha

(unweighted mean, as in the paper). Client: :mod:`fedaccel.clients.feddyn`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.feddyn import FedDynSolver
from fedaccel.arrays import mean_of_records, record_to_numpy
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import numpy_to_record, reply_metrics

T = TypeVar("T")


@dataclass(frozen=True)
class FedDynParams:
    """``feddyn.alpha``: weight of the dynamic regulariser.

    Default 0.3: the value the FedRKMGC paper selected for FedDyn by grid
    search over {0.03, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0} (its Appendix D.2,
    Table 7; CIFAR-100, ResNet). FedDyn's own paper (Acar et al. 2021) tries
    {0.1, 0.01, 0.001}. On the fast runner's default experiment 0.01-1.0 tie
    within seed noise (docs/gradient-correction.md, "Where the defaults come
    from").
    """

    alpha: float = 0.3

    def validate(self, prefix: str) -> None:
        require(self.alpha > 0, f"{prefix}.alpha", self.alpha, "must be > 0")


def h_update(h: T, delta_sum: T, alpha: float, num_clients: int) -> T:
    """``h - alpha/N * sum_k (theta_k - theta)``."""
    return h - alpha / num_clients * delta_sum  # type: ignore[operator]


def server_model(mean: T, h: T, alpha: float) -> T:
    """``mean_k theta_k - h / alpha``."""
    return mean - h / alpha  # type: ignore[operator]


class FedDynStrategy(FedAccelStrategy, FedAvg):
    """FedDyn's server: keeps ``h`` (float64) across rounds."""

    carried_state = ("h",)  # checkpointed (fedaccel.checkpoint)

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.alpha = float(run_cfg.algo_params.alpha)
        self.h: dict[str, np.ndarray] | None = None

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        theta = {k: v.astype(np.float64) for k, v in record_to_numpy(self.sent_model()).items()}
        if self.h is None:
            self.h = {k: np.zeros_like(v) for k, v in theta.items()}
        models = [r.content["arrays"] for r in replies]
        mean = mean_of_records(models, dtype=np.float64)
        new = {}
        for k in theta:
            # sum_k (theta_k - theta) = n (mean - theta)
            delta_sum = len(models) * (mean[k] - theta[k])
            self.h[k] = h_update(self.h[k], delta_sum, self.alpha, self.federation.num_clients)
            new[k] = server_model(mean[k], self.h[k], self.alpha)
        return numpy_to_record(new, like=self.global_arrays), reply_metrics(replies, self.weighted_by_key)


def build(cfg: RunConfig, federation: Federation) -> FedDynStrategy:
    return FedDynStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="feddyn", build_strategy=build, solver=FedDynSolver, params=FedDynParams,
    summary="FedDyn: dynamic regularisation (linear + proximal local terms, server h)",
)
