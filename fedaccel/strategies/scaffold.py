"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II control variates).

Server state: the model ``x`` and the control variate ``c`` (zero at the
start). Every training message carries ``c`` as the ArrayRecord
``scaffold.c`` (counted in ``bytes_down``). After the round, with ``S`` the replying clients out of ``N``:

    x <- x + server_lr * (1/|S|) sum_{i in S} (y_i - x)      (line 17)
    c <- c + (|S|/N) (1/|S|) sum_{i in S} delta c_i           (line 17)

The client replies ``y_i`` as ``arrays`` and ``delta c_i`` as the extra
ArrayRecord ``scaffold.dc`` (counted in ``bytes_up``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.scaffold import ScaffoldSolver, validate_cv_update
from fedaccel.arrays import record_to_numpy
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import ControlVariateServer, numpy_to_record, plain_mean, reply_metrics

T = TypeVar("T")


@dataclass(frozen=True)
class ScaffoldParams:
    """``scaffold.server-lr`` (global step size) and ``scaffold.cv-update``.

    Defaults: server lr 1 (Karimireddy et al. 2020, section 7: "we always use
    global step-size eta_g = 1"); ``mean-gradient`` is option II computed from
    the gradients the client took, identical to the formula at momentum 0.
    """

    server_lr: float = 1.0
    cv_update: str = "mean-gradient"

    def validate(self, prefix: str) -> None:
        require(self.server_lr > 0, f"{prefix}.server-lr", self.server_lr, "must be > 0")
        validate_cv_update(self.cv_update, prefix)


def model_step(x: T, mean_dy: T, server_lr: float) -> T:
    """``x + server_lr * mean(y_i - x)``."""
    return x + server_lr * mean_dy  # type: ignore[operator]


class ScaffoldStrategy(ControlVariateServer, FedAccelStrategy, FedAvg):
    """SCAFFOLD's server: model and control-variate steps."""

    carried_state = ("c",)  # checkpointed (fedaccel.checkpoint)

    messages = ScaffoldSolver.messages  # c down, dc up

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.server_lr = float(run_cfg.algo_params.server_lr)
        self.c: dict[str, np.ndarray] | None = None

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The plain mean of the ``y_i``; also the control-variate step (line 17)."""
        mean_y = plain_mean(replies)
        self.step_control_variate(replies)  # the state changes last
        return numpy_to_record(mean_y, like=self.global_arrays), reply_metrics(replies, self.weighted_by_key)

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        """``x + server_lr * (aggregate - x)`` (line 17, after the update transforms)."""
        x = {k: v.astype(np.float64) for k, v in record_to_numpy(self.global_arrays).items()}
        mean_y = record_to_numpy(aggregate)
        new = {k: model_step(x[k], mean_y[k] - x[k], self.server_lr) for k in x}
        return numpy_to_record(new, like=self.global_arrays)


def build(cfg: RunConfig, federation: Federation) -> ScaffoldStrategy:
    return ScaffoldStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="scaffold", build_strategy=build, solver=ScaffoldSolver, params=ScaffoldParams,
    summary="SCAFFOLD: control-variate drift correction (option II), server and client lr",
)
