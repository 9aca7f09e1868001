"""Algorithm registry: ``algo`` name -> (strategy factory, local solver, typed params).

Each module in ``strategies/`` defines a module-level ``ALGORITHM`` (an
:class:`fedaccel.algorithm.AlgorithmSpec`); the registry discovers them, so adding an algorithm
means adding one strategy module and one solver module and touching nothing
else.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from fedaccel.algorithm import AlgorithmSpec


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
