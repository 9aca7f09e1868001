"""FedAdam: Adam on the server's pseudo-gradient (Reddi et al. 2021,
"Adaptive Federated Optimization", arXiv:2003.00295).

``fedadam.variant`` picks the rule (:func:`fedaccel.strategies.server_steps.adam_step`):

- ``paper`` (default): Algorithm 2 exactly: ``Delta = (1/|S|) sum_i Delta_i``
  (unweighted mean over the round's clients), ``m = b1 m + (1-b1) Delta``,
  ``v = b2 v + (1-b2) Delta^2`` with ``v_{-1} = tau^2``,
  ``x = x + eta m / (sqrt(v) + tau)``, no bias correction. The default
  because the papers we reproduce (FedACG among them) compare against this
  rule, and the paper is our specification.
- ``flower``: Flower's ``FedAdam`` (example-weighted mean; ``m``, ``v`` from
  zero and the bias-corrected step ``eta sqrt(1-b2^(r+1)) / (1-b1^(r+1))``
  with ``r`` the 1-based round), bit-identical to it (tested). Its first
  step is ``sqrt(1-b2^2)/(1-b1^2)`` = 0.74x Algorithm 2's at b1 = 0.9,
  b2 = 0.99 (for ``|Delta| >> tau``); later ratios depend on the updates.

The step runs as the :meth:`server_step` hook, after the update transforms
(global GC), so the moments are built from the centralized update.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedavg import FedAvgSolver
from fedaccel.arrays import record_to_numpy
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import (ADAM_VARIANTS, AdamState, adam_step, numpy_to_record, plain_mean,
                                     reply_metrics)


@dataclass(frozen=True)
class FedAdamParams:
    """``fedadam.server-lr``, ``.beta1``, ``.beta2``, ``.tau`` and ``.variant``."""

    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 0.001
    variant: str = "paper"

    def validate(self, prefix: str) -> None:
        require(self.server_lr > 0, f"{prefix}.server-lr", self.server_lr, "must be > 0")
        require(0 <= self.beta1 < 1, f"{prefix}.beta1", self.beta1, "must be in [0, 1)")
        require(0 <= self.beta2 < 1, f"{prefix}.beta2", self.beta2, "must be in [0, 1)")
        require(self.tau > 0, f"{prefix}.tau", self.tau, "must be > 0 (adaptivity / epsilon)")
        require(self.variant in ADAM_VARIANTS, f"{prefix}.variant", self.variant,
                "allowed: paper (Reddi et al. Algorithm 2), flower (Flower's bias-corrected FedAdam)")


class FedAdamStrategy(FedAccelStrategy, FedAvg):
    """The variant's mean of the replies, then the server Adam step."""

    carried_state = ("adam",)  # checkpointed (fedaccel.checkpoint)

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.params = run_cfg.algo_params
        self.adam = AdamState()

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.params.variant == "flower":
            return super().combine(server_round, replies)  # Flower's example-weighted mean
        mean = plain_mean(replies)  # Algorithm 2: (1/|S|) sum_i
        return numpy_to_record(mean, like=self.global_arrays), reply_metrics(replies, self.weighted_by_key)

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        p = self.params
        new = adam_step(record_to_numpy(self.global_arrays), record_to_numpy(aggregate), self.adam,
                        server_round, p.server_lr, p.beta1, p.beta2, p.tau, p.variant)
        return numpy_to_record(new)


def build(cfg: RunConfig, federation: Federation) -> FedAdamStrategy:
    return FedAdamStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedadam", build_strategy=build, solver=FedAvgSolver, params=FedAdamParams,
    summary="FedAdam: FedAvg with an Adam server optimizer (Reddi et al. Algorithm 2, or Flower's)",
)
