"""FedDR (Tran-Dinh et al. 2021): the Douglas-Rachford rule of FedCDR with
ordinary random client sampling (``sampler='uniform'``).

``feddr.init='zeros'`` reproduces the public FedDR code, which starts ``y``
and ``xhat`` at zero instead of at the initial model.
"""

from __future__ import annotations

from dataclasses import dataclass

from clients.douglas_rachford import DouglasRachfordSolver
from fedaccel.config import RunConfig
from fedaccel.registry import AlgorithmSpec
from strategies.base import Federation
from strategies.douglas_rachford import DOUGLAS_RACHFORD_GLOBAL_GC, DouglasRachfordParams, DouglasRachfordStrategy


@dataclass(frozen=True)
class FedDRParams(DouglasRachfordParams):
    """``feddr.eta``, ``feddr.alpha``, ``feddr.prox-start``, ``feddr.init``."""


def build(cfg: RunConfig, federation: Federation) -> DouglasRachfordStrategy:
    return DouglasRachfordStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="feddr", build_strategy=build, solver=DouglasRachfordSolver, params=FedDRParams,
    summary="FedDR: Douglas-Rachford splitting with uniform client sampling",
    default_sampler="uniform", default_straggler_policy="partial",
    global_gc_refused=DOUGLAS_RACHFORD_GLOBAL_GC,
)
