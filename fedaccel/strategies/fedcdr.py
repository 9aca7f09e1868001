"""FedCDR: Federated Client Reshuffling Douglas-Rachford ("Mitigating Data
Heterogeneity Effect in Client-Reshuffling-Based Federated Learning",
anonymous, under double-blind review).

Algorithm 1: reshuffled cohorts (every client once per meta-epoch), a
Douglas-Rachford step with an inexact prox on each selected client
(:mod:`fedaccel.clients.douglas_rachford`), and ``x <- x + (1/n) sum g_i`` on the
server (:mod:`fedaccel.strategies.douglas_rachford`). Stragglers' partial updates are
used (appendix F.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedaccel.clients.douglas_rachford import DouglasRachfordSolver
from fedaccel.config import RunConfig
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.membership import Federation
from fedaccel.strategies.douglas_rachford import DOUGLAS_RACHFORD_GLOBAL_GC, DouglasRachfordParams, DouglasRachfordStrategy


@dataclass(frozen=True)
class FedCDRParams(DouglasRachfordParams):
    """``fedcdr.eta``, ``fedcdr.alpha``, ``fedcdr.prox-start``, ``fedcdr.init``."""


def build(cfg: RunConfig, federation: Federation) -> DouglasRachfordStrategy:
    return DouglasRachfordStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedcdr", build_strategy=build, solver=DouglasRachfordSolver, params=FedCDRParams,
    summary="FedCDR: Douglas-Rachford splitting with reshuffled client cohorts",
    default_sampler="reshuffle", default_straggler_policy="partial",
    global_gc_refused=DOUGLAS_RACHFORD_GLOBAL_GC,
)
