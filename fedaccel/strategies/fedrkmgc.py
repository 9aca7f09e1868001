"""FedRKMGC: gradient correction with fast KM and global relaxation
(fedrkmgc-relaxation-fast-km.txt, Algorithm 1, sections 3.2-3.3).

Server (Algorithm 1, lines 14-15): the *unweighted* mean of the returned
client models (section 3.3 sets ``omega = 1/|C_t|``), then the relaxation
``theta <- (1 - rho) theta + rho mean`` (:func:`fedaccel.strategies.server_steps.relax`).
Client: :mod:`fedaccel.clients.fedrkmgc`. The variant table that maps the paper's
ablation rows (Tables 3 and 9) to components is
:data:`fedaccel.clients.fedrkmgc.VARIANTS`: variants without relaxation use ``rho = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedrkmgc import VARIANTS, FedRKMGCSolver, variant_components
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import RelaxedAggregation, numpy_to_record, plain_mean, reply_metrics


@dataclass(frozen=True)
class FedRKMGCParams:
    """``fedrkmgc.beta``, ``.rho``, ``.gamma`` and ``.variant``.

    Defaults: the paper's, section 4 (training settings: beta 0.03, rho 1.5,
    gamma 500) and appendix D.2 (beta from the grid of Table 7; rho and gamma
    fixed after Figure 4); ``full`` is Algorithm 1.

    Ranges: any ``rho > 0`` and ``gamma > 0``. The paper recommends
    ``rho in (0, 2]`` and ``gamma >= 2`` (section 3.3 and appendix D.3, from
    the theory it builds on), but its appendix D.3 (Figure 5) also runs
    ``rho in {2.1, 2.2, 2.4, 2.5, 3.0, 4.0}`` and ``gamma in {0.1, ..., 10}``
    to show what happens outside them, so those values are accepted.
    """

    beta: float = 0.03
    rho: float = 1.5
    gamma: float = 500.0
    variant: str = "full"

    def validate(self, prefix: str) -> None:
        require(self.beta > 0, f"{prefix}.beta", self.beta, "must be > 0")
        require(self.rho > 0, f"{prefix}.rho", self.rho, "must be > 0 (the paper recommends (0, 2])")
        require(self.gamma > 0, f"{prefix}.gamma", self.gamma, "must be > 0 (the paper recommends >= 2)")
        require(self.variant in VARIANTS, f"{prefix}.variant", self.variant,
                f"allowed: {', '.join(VARIANTS)}")

    @property
    def effective_rho(self) -> float:
        """``rho`` when the variant relaxes, else 1 (plain mean)."""
        relaxed, _ = variant_components(self.variant)
        return float(self.rho) if relaxed else 1.0


class MeanStrategy(FedAccelStrategy, FedAvg):
    """Unweighted mean of the replies' models (no Flower FedAvg validation)."""

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        mean = plain_mean(replies)
        like = self.global_arrays if self.global_arrays is not None else replies[0].content["arrays"]
        return numpy_to_record(mean, like=like), reply_metrics(replies, self.weighted_by_key)


class FedRKMGCStrategy(RelaxedAggregation, MeanStrategy):
    """Plain mean then relaxation with the variant's ``rho``."""

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.relaxation_rho = run_cfg.algo_params.effective_rho


def build(cfg: RunConfig, federation: Federation) -> FedRKMGCStrategy:
    return FedRKMGCStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedrkmgc", build_strategy=build, solver=FedRKMGCSolver, params=FedRKMGCParams,
    summary="FedRKMGC: gradient correction g - delta with fast-KM updates, relaxed server mean",
)
