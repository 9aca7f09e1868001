"""What one algorithm is: the record each strategy module exports as ``ALGORITHM``.

A plain type at the config-schema layer, so strategies can declare
themselves without importing the registry that discovers them
(fedaccel/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from flwr.serverapp.strategy import Strategy

    from fedaccel.clients.base import LocalSolver


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: how the server aggregates and how a client trains.

    ``build_strategy(cfg, federation)`` returns a Flower ``Strategy``;
    ``solver`` is the client-side :class:`fedaccel.clients.base.LocalSolver` subclass;
    ``params`` is a frozen dataclass read from ``<config_prefix>.<field>`` keys.
    """

    name: str
    build_strategy: Callable[..., "Strategy"]
    solver: type["LocalSolver"]
    params: type
    summary: str
    config_prefix: str = ""
    default_sampler: str = "uniform"  # what sampler='auto' means for this algorithm
    default_straggler_policy: str = "drop"  # what straggler-policy='auto' means
    # Why gc.mode global/hybrid cannot be computed correctly with this
    # algorithm ("" = it can); such runs are refused with this reason.
    global_gc_refused: str = ""

    @property
    def prefix(self) -> str:
        return self.config_prefix or self.name
