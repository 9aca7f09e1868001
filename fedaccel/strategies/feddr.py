"""FedDR (Tran-Dinh, Pham, Phan, Nguyen, "FedDR - Randomized Douglas-Rachford
Splitting Algorithms for Nonconvex Federated Composite Optimization", NeurIPS
2021, arXiv:2103.03452) without its regularizer: the Douglas-Rachford client
rule of FedCDR with ordinary random client sampling (``sampler='uniform'``).

``feddr.init='zeros'`` starts a client's ``y_i`` and ``xhat_i`` at zero and
its ``x_i`` at the initial model x0, as the public FedDR code does; the server
sends x0 in round 1 with either init. What still differs from that code (1/n
instead of sample-count weights on the server, the run's momentum and weight
decay in the prox solver, ``prox-start='server'`` by default) is listed in
:mod:`fedaccel.strategies.douglas_rachford` and docs/fedcdr.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedaccel.clients.douglas_rachford import DouglasRachfordSolver
from fedaccel.config import RunConfig
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.membership import Federation
from fedaccel.strategies.douglas_rachford import DOUGLAS_RACHFORD_GLOBAL_GC, DouglasRachfordParams, DouglasRachfordStrategy


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
