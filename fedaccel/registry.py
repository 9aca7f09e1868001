"""Algorithm registry: ``algo`` name -> (strategy factory, local solver, typed params).

An algorithm ``X`` is the module ``fedaccel/strategies/X.py`` that assigns a module-level
``ALGORITHM`` (an :class:`fedaccel.algorithm.AlgorithmSpec` named ``X``), so
adding an algorithm means adding one strategy module and one solver module and
touching nothing else.

Lazy by design: the names are read from the modules' source (a top-level
``ALGORITHM =`` assignment, found with :mod:`ast`) without importing them, and
:func:`get_algorithm` imports only the one module asked for. A ClientApp
therefore imports its own algorithm's strategy module and solver, never the
other algorithms' code. Nothing is cached here beyond Python's own
``sys.modules`` and a memo of which source files declare an algorithm.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from functools import cache
from pathlib import Path

from fedaccel.algorithm import AlgorithmSpec
from fedaccel.config import config_error, did_you_mean

ALGORITHMS_PACKAGE = "fedaccel.strategies"


@cache
def _declares_algorithm(path: str, mtime_ns: int) -> bool:
    """Whether a module's source assigns ``ALGORITHM`` at top level.

    Memoized on (path, modification time): a pure function of the file, so the
    registry stays a read of the folder, at a stat per module per call.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "ALGORITHM" for t in targets):
            return True
    return False


def algorithm_names() -> tuple[str, ...]:
    """All registered algorithm names, sorted (no algorithm module is imported)."""
    package = importlib.util.find_spec(ALGORITHMS_PACKAGE)
    if package is None or not package.submodule_search_locations:
        raise RuntimeError(f"the {ALGORITHMS_PACKAGE!r} package is not importable")
    names = set()
    for folder in package.submodule_search_locations:
        for path in Path(folder).glob("*.py"):
            if not path.stem.startswith("_") and _declares_algorithm(str(path), path.stat().st_mtime_ns):
                names.add(path.stem)
    return tuple(sorted(names))


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec of algorithm ``name``, importing only ``fedaccel/strategies/<name>.py``.

    An unknown name is a :class:`fedaccel.errors.ConfigError` listing the
    registered ones (with a did-you-mean).
    """
    names = algorithm_names()
    if name not in names:
        raise config_error("algo", name, f"allowed: {', '.join(names)}{did_you_mean(name, names)}")
    return _import_spec(name)


def _import_spec(name: str) -> AlgorithmSpec:
    """Import ``fedaccel/strategies/<name>.py`` (a listed name) and check its ``ALGORITHM``."""
    module = importlib.import_module(f"{ALGORITHMS_PACKAGE}.{name}")
    spec = getattr(module, "ALGORITHM", None)
    if not isinstance(spec, AlgorithmSpec) or spec.name != name:
        raise RuntimeError(f"{module.__name__}.ALGORITHM must be an AlgorithmSpec named {name!r} "
                           f"(the module's name is the algorithm's name), got {spec!r}")
    return spec


def all_algorithms() -> dict[str, AlgorithmSpec]:
    """Every algorithm's spec (imports them all: for listings and checks, not clients)."""
    return {name: _import_spec(name) for name in algorithm_names()}


def describe() -> list[tuple[str, str]]:
    """(name, one-line summary) for every algorithm, for ``--list`` output."""
    return [(name, spec.summary) for name, spec in all_algorithms().items()]
