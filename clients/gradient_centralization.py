"""Gradient centralization (GC) for federated learning: GC-Fed's building blocks.

GC-Fed paper (gc-fed-gradient-centralization.txt), section 3.1, eqs. (1)-(3):
for a weight gradient whose rows are indexed by the *output* channel/feature
(PyTorch's dim 0), subtract from every output row its mean over the inputs,
``G~ = G - mean(G, every dim but 0)``; this is the projection ``P = I - e e^T``
onto the zero-mean hyperplane, so it is linear and idempotent (``P P = P``).

- Local GC (Definition 1): the client centralizes the gradients of the first
  ``floor(lambda * L)`` parameter tensors (``named_parameters()`` order, ``L``
  tensors) before every optimizer step (Algorithm 1, lines 7-10).
- Global GC (Definition 2): the server centralizes the aggregated update of the
  other tensors: ``w <- w + P(w_new - w)`` (Algorithm 1, lines 13-15).

1-D tensors (biases, GroupNorm scales/shifts) are left unchanged by default
(``vectors='keep'``). A bias has one input per output (``m = 1`` in eq. (1)),
so "the mean over every dimension but the first" of a bias row is the element
itself and the literal projection would zero every bias gradient, freezing
the biases; the original GC (Yong et al. 2020, the paper's ref. [22]) applies
GC only to weights with more than one dimension. The authors' GC-Fed code
instead removes the vector's scalar mean (a mean *across outputs*, a
different projection); ``vectors='mean'`` gives that variant.

This module is pure (no run config); :mod:`fedaccel.composition` wires it to
the ``gc.*`` run-config keys so GC composes with every algorithm.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

GC_MODES = ("none", "local", "global", "hybrid")
VECTOR_RULES = ("keep", "mean")


def centralize(tensor: torch.Tensor, vectors: str = "keep") -> torch.Tensor:
    """``tensor`` minus its mean over every dim but dim 0 (a new tensor).

    Tensors with ``dim() > 1`` get zero mean per output row. 0-D and 1-D
    tensors are returned unchanged (a copy) with ``vectors='keep'``; with
    ``vectors='mean'`` a 1-D tensor has its scalar mean removed (authors' code).
    """
    if tensor.dim() > 1:
        dims = tuple(range(1, tensor.dim()))
        return tensor - tensor.mean(dim=dims, keepdim=True)
    if tensor.dim() == 1 and vectors == "mean":
        return tensor - tensor.mean()
    if vectors not in VECTOR_RULES:
        raise ValueError(f"vectors must be one of {VECTOR_RULES}, got {vectors!r}")
    return tensor.clone()


def parse_layers(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``'fc, fc2'`` -> ``('fc', 'fc2')`` (empty entries dropped)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return tuple(s.strip() for s in items if s.strip())


def in_layers(name: str, layers: Iterable[str]) -> bool:
    """Whether tensor ``name`` belongs to one of ``layers`` (a module path such as
    ``fc`` matches ``fc.weight`` and ``fc.bias`` but not ``fc1.weight``)."""
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def _names(named: Iterable[Any]) -> list[str]:
    return [item if isinstance(item, str) else item[0] for item in named]


def local_gc_split(
    named_parameters: Iterable[Any], lam: float, global_layers: str | Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """(local names, global names): the first ``floor(lam * L)`` tensors are local
    (Algorithm 1, line 8), except those in ``global_layers``, which go global
    explicitly (the paper's "explicitly select the last fully-connected layer");
    every other tensor is global. Accepts names or ``(name, tensor)`` pairs.

    ``floor`` gets a 1e-9 tolerance so that e.g. ``0.29 * 100`` counts 29.
    """
    names = _names(named_parameters)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    count = math.floor(lam * len(names) + 1e-9)
    layers = parse_layers(global_layers)
    local = [n for i, n in enumerate(names) if i < count and not in_layers(n, layers)]
    chosen = set(local)
    return local, [n for n in names if n not in chosen]


def gc_partition(
    mode: str, named_parameters: Iterable[Any], lam: float = 1.0,
    global_layers: str | Sequence[str] = (),
) -> tuple[list[str], list[str]]:
    """(local, global) tensor names for a ``gc.mode``.

    ``none``: nothing; ``local`` (LocalGC, lambda = 1): every tensor local;
    ``global`` (GlobalGC, lambda = 0): every tensor global; ``hybrid`` (GC-Fed):
    :func:`local_gc_split` with ``lam`` and ``global_layers``. ``lam`` and
    ``global_layers`` only matter for ``hybrid``.
    """
    names = _names(named_parameters)
    if mode == "none":
        return [], []
    if mode == "local":
        return names, []
    if mode == "global":
        return [], names
    if mode == "hybrid":
        return local_gc_split(names, lam, global_layers)
    raise ValueError(f"gc mode must be one of {GC_MODES}, got {mode!r}")


# --------------------------------------------------------------------------- #
# transforms
# --------------------------------------------------------------------------- #
def local_gc_transform(
    model: torch.nn.Module, names: Iterable[str], vectors: str = "keep"
) -> Callable[[torch.nn.Module], None]:
    """Client gradient transform: centralize ``p.grad`` in place for ``names``.

    Runs after backward and before ``optimizer.step()``, so momentum and weight
    decay act on the centralized gradient (weight decay's own term is not
    centralized, as in GC for centralized training).
    """
    wanted = set(names)
    params = [p for n, p in model.named_parameters() if n in wanted]

    def transform(_: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.copy_(centralize(p.grad, vectors))

    return transform


def global_gc_update(old: ArrayRecord, new: ArrayRecord, names: Iterable[str],
                     vectors: str = "keep") -> ArrayRecord:
    """``new[k] <- old[k] + P(new[k] - old[k])`` for ``k`` in ``names``; other
    entries of ``new`` are returned as they are (same objects, same order)."""
    wanted = set(names)
    out: OrderedDict[str, Array] = OrderedDict()
    for key, array in new.items():
        if key not in wanted:
            out[key] = array
            continue
        n = np.asarray(array.numpy())
        o = np.asarray(old[key].numpy())
        delta = torch.from_numpy(np.array(n - o))
        out[key] = Array(np.asarray(o + centralize(delta, vectors).numpy()).astype(n.dtype, copy=False))
    return ArrayRecord(out)


def global_gc_transform(mode: str, lam: float, global_layers: str | Sequence[str],
                        vectors: str = "keep") -> Callable[[ArrayRecord, ArrayRecord], ArrayRecord]:
    """Server update transform ``f(old, new) -> new`` applying Global GC to the
    global tensors. The split is computed from the ArrayRecord's key order,
    which is ``named_parameters()`` order for this repo's models (they hold no
    buffers: no BatchNorm, see models/__init__.py)."""

    def transform(old: ArrayRecord, new: ArrayRecord) -> ArrayRecord:
        _, global_names = gc_partition(mode, list(new.keys()), lam, global_layers)
        if not global_names:
            return new
        return global_gc_update(old, new, global_names, vectors)

    return transform
