"""FedDC (Gao et al., CVPR 2022, arXiv:2203.11751): local drift decoupling and correction.

The rules are the authors' public code's (github.com/gaoliang13/FedDC,
``train_FedDC``). Server state: the model ``x``, the gradient state ``c``
(SCAFFOLD's control variate, zero at the start, sent as ``scaffold.c``) and
``H``, the sum of every client's drift ``h_i`` (zero at the start; the
server's copy of what the clients keep, summed from the replies it
applied). After a round with replying clients ``S`` out of ``N``:

    c <- c + (1/N) sum_{i in S} delta c_i                         (SCAFFOLD's step)
    H <- H + sum_{i in S} (theta_i - x)                           (the clients' h_i updates)
    x <- (1/|S|) sum_{i in S} theta_i + H / N                     (mean of the replies + mean drift)

(the code's ``cld_mdl_param = avg_mdl_param_sel + np.mean(parameter_drifts,
axis=0)``; unweighted, as there). Client: :class:`fedaccel.clients.scaffold.FedDCSolver`.

The paper describes the server averaging the clients' drift-corrected
models ``theta_i + h_i``. With every client in every round that is the rule
above; with a cohort ``S`` the code adds the mean drift of all ``N``
clients (``H / N``) to the mean of the replies, where a mean over ``S`` of
``theta_i + h_i`` would add only the cohort's. We follow the authors' released code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.algorithm import AlgorithmSpec
from fedaccel.arrays import record_to_numpy
from fedaccel.clients.scaffold import FedDCSolver, validate_cv_update
from fedaccel.config import RunConfig, require
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import ControlVariateServer, numpy_to_record, plain_mean, reply_metrics

T = TypeVar("T")


@dataclass(frozen=True)
class FedDCParams:
    """``feddc.alpha`` (the drift penalty's weight) and ``feddc.cv-update``.

    Default alpha 0.1: the middle of the grid the FedCDR paper tunes FedDC's
    alpha over on its synthetic and MNIST data ({0.03, 0.1, 0.3}, its
    appendix G.2.4); the FedDC code's examples use 0.1 for MNIST, 0.01 for
    CIFAR-10 and CIFAR-100 and 0.005 for its synthetic data. ``cv-update``:
    as SCAFFOLD's (:class:`fedaccel.clients.scaffold.FedDCSolver`).
    """

    alpha: float = 0.1
    cv_update: str = "mean-gradient"

    def validate(self, prefix: str) -> None:
        require(self.alpha > 0, f"{prefix}.alpha", self.alpha, "must be > 0")
        validate_cv_update(self.cv_update, prefix)


def drift_sum_update(h_sum: T, delta_sum: T) -> T:
    """``H + sum_{i in S} (theta_i - x)``."""
    return h_sum + delta_sum  # type: ignore[operator]


def server_model(mean: T, h_sum: T, num_clients: int) -> T:
    """``mean_{i in S} theta_i + H / N``."""
    return mean + h_sum / num_clients  # type: ignore[operator]


class FedDCStrategy(ControlVariateServer, FedAccelStrategy, FedAvg):
    """FedDC's server: SCAFFOLD's ``c`` and the drifts' sum ``H``, both
    carried across rounds; no server learning rate (the new model is the
    mean of the replies plus the mean drift)."""

    carried_state = ("c", "h_sum")  # checkpointed (fedaccel.checkpoint)

    messages = FedDCSolver.messages  # c down, dc up

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.c: dict[str, np.ndarray] | None = None
        self.h_sum: dict[str, np.ndarray] | None = None

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The control-variate step, then ``H`` and the new model (float64);
        the state changes last, once everything that can raise has run."""
        x = {k: v.astype(np.float64) for k, v in record_to_numpy(self.sent_model()).items()}
        mean = plain_mean(replies)
        self.step_control_variate(replies)
        if self.h_sum is None:
            self.h_sum = {k: np.zeros_like(v) for k, v in x.items()}
        new = {}
        for k in x:
            # sum_{i in S} (theta_i - x) = |S| (mean - x)
            self.h_sum[k] = drift_sum_update(self.h_sum[k], len(replies) * (mean[k] - x[k]))
            new[k] = server_model(mean[k], self.h_sum[k], self.federation.num_clients)
        return numpy_to_record(new, like=self.global_arrays), reply_metrics(replies, self.weighted_by_key)


def build(cfg: RunConfig, federation: Federation) -> FedDCStrategy:
    return FedDCStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="feddc", build_strategy=build, solver=FedDCSolver, params=FedDCParams,
    summary="FedDC: SCAFFOLD's gradient correction plus a local drift variable (drift penalty, server adds mean drift)",
)
