"""Algorithm registry: ``algo`` name -> (strategy factory, local solver, typed params).

Each module in ``strategies/`` defines a module-level ``ALGORITHM`` (an
:class:`AlgorithmSpec`); the registry discovers them, so adding an algorithm
means adding one strategy module and one solver module and touching nothing
else.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from flwr.serverapp.strategy import Strategy

    from clients.base import LocalSolver


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: how the server aggregates and how a client trains.

    ``build_strategy(cfg, federation)`` returns a Flower ``Strategy``;
    ``solver`` is the client-side :class:`clients.base.LocalSolver` subclass;
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


@lru_cache(maxsize=1)
def _discover() -> dict[str, AlgorithmSpec]:
    import strategies

    found: dict[str, AlgorithmSpec] = {}
    for info in sorted(pkgutil.iter_modules(strategies.__path__), key=lambda i: i.name):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"strategies.{info.name}")
        spec = getattr(module, "ALGORITHM", None)
        if isinstance(spec, AlgorithmSpec):
            if spec.name in found:
                raise RuntimeError(f"algorithm {spec.name!r} registered twice")
            found[spec.name] = spec
    return found


def algorithm_names() -> tuple[str, ...]:
    """All registered algorithm names, sorted."""
    return tuple(sorted(_discover()))


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec for ``name`` (validated by the caller against :func:`algorithm_names`)."""
    try:
        return _discover()[name]
    except KeyError:
        from fedaccel.config import config_error

        raise config_error("algo", name, f"allowed: {', '.join(algorithm_names())}") from None


def describe() -> list[tuple[str, str]]:
    """(name, one-line summary) for every algorithm, for ``--list`` output."""
    return [(name, spec.summary) for name, spec in sorted(_discover().items())]
