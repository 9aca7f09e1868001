"""LocalNewton, as the FedPM paper runs it (its conventional SOPM baseline, eq. (5)).

"FedPM: Federated Learning Using Second-order Optimization with Preconditioned
Mixing of Local Parameters" (Ishii et al., 2025, arXiv:2511.09100) compares
against LocalNewton ("LocalNewton: Reducing Communication Bottleneck for
Distributed Learning", Gupta et al., 2021) with the same local steps as FedPM
(:class:`fedaccel.clients.fedpm.LocalNewtonSolver`: FOOF in Test 2, exact Newton on
logistic regression in Test 1) and simple mixing: the server takes the
sample-weighted mean of the local models (Flower's FedAvg), so clients upload
weights only. The original LocalNewton takes a fresh local second-order
direction at every local iteration; here that is ``refresh-every = 1``, while
the default 0 keeps one preconditioner per round as the FedPM paper does for
its second-order methods in Test 2. See docs/fedpm.md.
"""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedpm import LocalNewtonSolver, SecondOrderParams, check_exact_mode
from fedaccel.config import RunConfig
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation


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
