"""FedProx (Li et al. 2020): FedAvg aggregation, proximal local objective.

Flower's ``FedProx`` strategy sends ``proximal-mu`` with every training
message; :class:`fedaccel.clients.fedprox.FedProxSolver` adds ``mu (w - w^t)`` to the
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedProx

from fedaccel.clients.fedprox import FedProxSolver
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation


@dataclass(frozen=True)
class FedProxParams:
    """``fedprox.mu``: weight of the proximal term mu/2 ||w - w^t||^2.

    Default 0.1: the value the FedRKMGC paper selected for FedProx by grid
    search over {0.01, 0.05, 0.1, 0.3} (its Appendix D.2, Table 7; CIFAR-100,
    ResNet). FedProx's own paper (Li et al. 2020) uses mu = 1 on its synthetic
    data with multinomial logistic regression, 20 local epochs; on the fast
    runner's default experiment (MLP, 2 local epochs) mu = 1 measured about
    1 point lower (docs/gradient-correction.md, "Where the defaults come from").
    """

    mu: float = 0.1

    def validate(self, prefix: str) -> None:
        require(self.mu >= 0, f"{prefix}.mu", self.mu, "must be >= 0 (0 = FedAvg)")


class FedProxStrategy(FedAccelStrategy, FedProx):
    """Flower's FedProx with fedaccel's seeded sampling and accounting."""

    messages = FedProxSolver.messages  # proximal-mu in the config


def build(cfg: RunConfig, federation: Federation) -> FedProxStrategy:
    return FedProxStrategy(run_cfg=cfg, federation=federation, proximal_mu=cfg.algo_params.mu)


# straggler-policy='auto' keeps stragglers' partial work: FedProx is built
# for it (Li et al., "Federated Optimization in Heterogeneous Networks",
# MLSys 2020, arXiv:1812.06127: variable amounts of local work per device,
# each a gamma-inexact solution of its local problem; its experiments run
# FedProx on the stragglers' partial updates where FedAvg drops them)
ALGORITHM = AlgorithmSpec(
    name="fedprox", build_strategy=build, solver=FedProxSolver, params=FedProxParams,
    summary="FedProx: local SGD with a proximal pull to the global model",
    default_straggler_policy="partial",
)
