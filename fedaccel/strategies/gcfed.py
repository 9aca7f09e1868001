"""GC-Fed (gradient centralization for FL), Algorithm 1: FedAvg + ``gc.mode='hybrid'``.

Paper: "GC-Fed: Gradient Centralized Federated Learning with Partial Client
Participation", Seo, Catak, Rong, Hong, Kim, 2025, arXiv:2503.13180.

GC itself is not part of this algorithm's code: it is a layer in
:mod:`fedaccel.clients.composition` switched on by ``gc.mode`` for *any* algorithm
(local GC = client gradient transform, global GC = server update transform;
fedaccel/clients/gradient_centralization.py). ``gcfed`` only sets the default of
``gc.mode='auto'`` to ``hybrid`` (:attr:`GCFedParams.default_gc_mode`), so

- ``algo='gcfed'``                       -> GC-Fed (hybrid, ``gc.lambda``, ``gc.global-layers``)
- ``algo='gcfed' gc.mode='local'``       -> LocalGC (lambda = 1)
- ``algo='gcfed' gc.mode='global'``      -> GlobalGC (lambda = 0)
- ``algo='gcfed' gc.mode='local-only'``  -> Figure 9's "Local GC only": local GC on
  hybrid's local tensors, no GC on the rest (lambda = 0: no GC at all)
- ``algo='fedprox' gc.mode='hybrid'``    -> FedProx with GC-Fed (Table 7)

Aggregation: Algorithm 1 line 13 averages the client updates *unweighted*,
``Delta = 1/|K| sum_k Delta_k``: ``gcfed.weighting='uniform'`` (default).
``gcfed.weighting='examples'`` is FedAvg's example-weighted mean, which makes
``algo='gcfed'`` identical to ``algo='fedavg' gc.mode='hybrid'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flwr.app import Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedavg import FedAvgSolver
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import WEIGHTINGS, mean_of_replies, reply_metrics


@dataclass(frozen=True)
class GCFedParams:
    """``gcfed.weighting``; the GC settings are the shared ``gc.*`` keys."""

    default_gc_mode: ClassVar[str] = "hybrid"  # what gc.mode='auto' means for gcfed
    weighting: str = "uniform"

    def validate(self, prefix: str) -> None:
        require(self.weighting in WEIGHTINGS, f"{prefix}.weighting", self.weighting,
                f"allowed: {', '.join(WEIGHTINGS)}")


class GCFedStrategy(FedAccelStrategy, FedAvg):
    """FedAvg with the mean of Algorithm 1 line 13; GC comes from composition."""

    def combine(self, server_round: int, replies: list[Message]) -> tuple[object, MetricRecord | None]:
        if self.run_cfg.algo_params.weighting == "examples":
            return super().combine(server_round, replies)
        mean = mean_of_replies(replies, "uniform", self.weighted_by_key)
        return mean, reply_metrics(replies, self.weighted_by_key)


def build(cfg: RunConfig, federation: Federation) -> GCFedStrategy:
    return GCFedStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="gcfed", build_strategy=build, solver=FedAvgSolver, params=GCFedParams,
    summary="GC-Fed: FedAvg with local GC on feature layers, global GC on the classifier",
)
