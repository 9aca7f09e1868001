"""Gradient centralization (GC) for federated learning: GC-Fed's building blocks.

Paper: "GC-Fed: Gradient Centralized Federated Learning with Partial Client
Participation", Seo, Catak, Rong, Hong, Kim, 2025, arXiv:2503.13180.

Section 3.1, eqs. (1)-(3): the paper writes a layer's gradient as
``G in R^{m x n}`` (``m`` inputs, ``n`` outputs) and removes from every output
column its mean over the ``m`` inputs, ``G~ = G - 1_m mu_G = P G`` with
``P = I_m - e e^T``, ``e = 1_m / sqrt(m)``. PyTorch stores weights as
``(out, in, ...)``, so here every *output row* (dim 0) loses its mean over
every other dim: ``G~ = G - mean(G, every dim but 0)``. ``P`` is linear and
idempotent (``P P = P``).

- Local GC (Definition 1): a client centralizes its local gradient. Algorithm 1
  (lines 7-10) applies it to the first ``floor(lambda * L)`` parameter tensors
  (``L`` = number of tensors, ``named_parameters()`` order here) before every
  local step.
- Global GC (Definition 2): the server centralizes the aggregated update,
  ``w <- w + P(w_new - w)`` (Algorithm 1, lines 13-15). Line 14 applies ``P``
  to the whole aggregated update, noting that the locally centralized tensors
  are unaffected by it (section 3.3); we apply it to the non-local tensors
  only, which is the same whenever the local tensors' aggregated update is
  already centralized (it is with ``weight_decay='centralized'``, below, and a
  server that averages client updates).

``gc.mode`` (:func:`gc_partition`) picks which tensors get which: ``local``
(LocalGC, lambda = 1), ``global`` (GlobalGC, lambda = 0), ``hybrid`` (GC-Fed)
and ``local-only``, the "Local GC only" curves of the paper's Figure 9
(section 4.3.2): Local GC on the same first ``floor(lambda * L)`` tensors as
``hybrid``, and *no* GC at all on the rest (lambda = 0 is FedAvg, lambda = 1
with no ``global_layers`` is LocalGC).

**1-D tensors** (biases, GroupNorm scales/shifts) are left unchanged by
default (``vectors='keep'``). A bias has one input per output (``m = 1`` in
eq. (1)), so "the mean over every dimension but the first" of a bias row is
the element itself and the literal projection would zero every bias
gradient, freezing the biases; the original GC ("Gradient Centralization: A
New Optimization Technique for Deep Neural Networks", Yong, Huang, Hua, Zhang,
2020, arXiv:2004.01461; GC-Fed's ref. [22]) centralizes only tensors with
more than one dimension (its code tests ``len(size) > 1``). The GC-Fed
authors' code instead removes a 1-D tensor's scalar mean (``mean(dim=())``
reduces over every dim), locally and globally: a mean *across outputs*, a
different projection; ``vectors='mean'`` (run config ``gc.vectors``) gives
that variant.

**Weight decay** (``weight_decay``, run config ``gc.weight-decay``). Torch's
SGD adds ``wd * w`` to the gradient inside ``optimizer.step()``, i.e. *after*
the gradient transforms, so a plain transform would centralize the loss
gradient only and leave the decay term as it is: the update direction is
``P g + wd w``. That is what the GC-Fed authors' code does (``raw``). The
original GC code (Yong et al.'s ``SGD_GC``) adds ``wd * w`` to the gradient
*before* centralizing, so the whole step is ``P (g + wd w)``; this is also
Definition 1 applied to the L2-regularized local objective, and it is what
keeps every weight row's mean at its initial value (the GC paper's
projected-gradient view) and what makes the paper's remark that Global GC
leaves locally centralized tensors unaffected exact. ``centralized`` (default)
gives it: the transform writes ``P g - wd (w - P w)`` into ``p.grad`` so that
the optimizer's ``+ wd w`` turns it into ``P (g + wd w)``; momentum then
accumulates centralized steps, as in ``SGD_GC``.

This module is pure (no run config); :mod:`fedaccel.clients.composition` wires it to
the ``gc.*`` run-config keys so GC composes with every algorithm.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedaccel.config import config_error

GC_MODES = ("none", "local", "global", "hybrid", "local-only")
VECTOR_RULES = ("keep", "mean")
WEIGHT_DECAY_RULES = ("centralized", "raw")
# gc.global-scope: which tensors of the aggregated update Global GC centralizes
# in hybrid mode: the global tensors of the split (the paper's section 3.3
# text, the default) or every tensor (Algorithm 1, line 14, "P Delta", and the
# authors' code). Identical unless the local tensors' mean update is not
# already centralized (gc.weight-decay='raw' with weight decay, clipping).
GLOBAL_SCOPES = ("split", "all")


def centralize(tensor: torch.Tensor, vectors: str = "keep", leading: int = 0) -> torch.Tensor:
    """``tensor`` minus its mean over every dim but dim 0 (a new tensor).

    Tensors with ``dim() > 1`` get zero mean per output row. 0-D and 1-D
    tensors are returned unchanged (a copy) with ``vectors='keep'``; with
    ``vectors='mean'`` a 1-D tensor has its scalar mean removed (the GC-Fed
    authors' code).

    ``leading`` dims in front are batch dims (the cohort trainer stacks the
    clients of a round along one): each slice along them is centralized on
    its own, exactly as above.
    """
    if vectors not in VECTOR_RULES:
        raise ValueError(f"vectors must be one of {VECTOR_RULES}, got {vectors!r}")
    own = tensor.dim() - leading  # the dims of one parameter
    if own > 1:
        dims = tuple(range(leading + 1, tensor.dim()))
        return tensor - tensor.mean(dim=dims, keepdim=True)
    if own == 1 and vectors == "mean":
        if leading == 0:
            return tensor - tensor.mean()
        return tensor - tensor.mean(dim=leading, keepdim=True)
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
    explicitly (section 3.3: "we explicitly select the last fully-connected
    layer"); every other tensor is global. Accepts names or ``(name, tensor)``
    pairs. (The authors' code, given a target layer, ignores lambda and takes
    every tensor but the last one, skipping names that *contain* the layer
    name; ``in_layers`` matches whole module paths instead.)

    ``floor`` gets a 1e-9 tolerance so that e.g. ``0.29 * 100`` counts 29.
    """
    names = _names(named_parameters)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    count = math.floor(lam * len(names) + 1e-9)
    layers = parse_layers(global_layers)
    unknown = [layer for layer in layers if not any(in_layers(n, (layer,)) for n in names)]
    if unknown:  # a misspelt layer would leave the split as if it were not named
        modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))
        raise config_error("gc.global-layers", ",".join(layers),
                           f"{unknown[0]!r} is no layer of this model (its layers: {', '.join(modules)})")
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
    :func:`local_gc_split` with ``lam`` and ``global_layers``; ``local-only``:
    the local part of that same split and no global tensors, i.e. the tensors
    past the borderline get no GC at all (the "Local GC only" ablation of the
    GC-Fed paper's Figure 9, section 4.3.2, where lambda = 0 is FedAvg and
    lambda = 1 is LocalGC). ``lam`` and ``global_layers`` only matter for
    ``hybrid`` and ``local-only``.
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
    if mode == "local-only":
        return local_gc_split(names, lam, global_layers)[0], []
    raise ValueError(f"gc mode must be one of {GC_MODES}, got {mode!r}")


# --------------------------------------------------------------------------- #
# transforms
# --------------------------------------------------------------------------- #
def local_gc_transform(
    named_parameters: Iterable[tuple[str, torch.Tensor]], names: Iterable[str], vectors: str = "keep",
    weight_decay: Mapping[str, float] | None = None, leading: int = 0,
) -> Callable[[torch.nn.Module], None]:
    """Client gradient transform: centralize ``p.grad`` in place for the
    parameters of ``named_parameters`` named in ``names``.

    Runs after backward (and after the algorithm's own ``transform_gradients``,
    e.g. FedProx's ``mu (w - w^t)``, which is centralized with the loss
    gradient) and before ``optimizer.step()``.

    ``weight_decay`` maps a tensor name to the decay ``wd`` that the optimizer
    adds to ``p.grad`` *inside* ``step()``, after this transform (torch SGD's
    ``weight_decay``). Without it (or ``wd = 0``) the step is ``P g + wd w``:
    the decay term is not centralized (the GC-Fed authors' code,
    ``gc.weight-decay='raw'``). With it, ``p.grad <- P g - wd (w - P w)``, so
    that the optimizer's ``+ wd w`` makes the step ``P (g + wd w)``: the decay
    term is centralized with the gradient, as in the original GC's ``SGD_GC``
    (``gc.weight-decay='centralized'``; module docstring). Momentum, applied by
    the optimizer after both, accumulates the centralized step either way.

    ``leading``: batch dims in front of each parameter (1 for the cohort
    trainer's stacked clients, :func:`centralize`).

    The correction assumes ``p.grad`` reaches ``step()`` unscaled. A gradient
    clip run between this transform and the step (``clip-norm > 0``) scales
    it by the clip factor ``c`` too, so the step is then
    ``c P g + wd P w + (1 - c) wd (w - P w)``: the decay is centralized
    exactly only in the steps where the clip does not act.
    """
    wanted = set(names)
    decay = dict(weight_decay or {})
    params = [(p, float(decay.get(n, 0.0))) for n, p in named_parameters if n in wanted]

    def transform(_: torch.nn.Module | None = None) -> None:
        with torch.no_grad():
            for p, wd in params:
                if p.grad is None:
                    continue  # the optimizer skips p (no decay either)
                g = centralize(p.grad, vectors, leading)
                if wd:
                    g.sub_(p - centralize(p, vectors, leading), alpha=wd)  # p - P p: what P removes from p
                p.grad.copy_(g)

    return transform


def global_gc_update(old: ArrayRecord, new: ArrayRecord, names: Iterable[str],
                     vectors: str = "keep") -> ArrayRecord:
    """``new[k] <- old[k] + P(new[k] - old[k])`` for ``k`` in ``names`` (Definition
    2 on the aggregated update ``new - old``; Algorithm 1, lines 14-15); other
    entries of ``new`` are returned as they are (same objects, same order).
    ``vectors`` as in :func:`centralize`."""
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
                        vectors: str = "keep", scope: str = "split"
                        ) -> Callable[[ArrayRecord, ArrayRecord], ArrayRecord]:
    """Server update transform ``f(old, new) -> new`` applying Global GC to the
    global tensors of ``mode`` (:func:`gc_partition`; none for ``none``,
    ``local`` and ``local-only``), or with ``scope='all'`` (``global`` and
    ``hybrid`` only) to every tensor of the update, Algorithm 1 line 14's
    ``P Delta`` as written. The split is computed from the ArrayRecord's
    key order, which is ``named_parameters()`` order for this repo's models
    (they hold no buffers: no BatchNorm, see fedaccel/models/__init__.py)."""
    if scope not in GLOBAL_SCOPES:
        raise ValueError(f"scope must be one of {GLOBAL_SCOPES}, got {scope!r}")
    if scope == "all" and mode not in ("global", "hybrid"):
        raise ValueError(f"scope 'all' needs a mode with Global GC (global, hybrid), got {mode!r}")

    def transform(old: ArrayRecord, new: ArrayRecord) -> ArrayRecord:
        global_names = (list(new.keys()) if scope == "all"
                        else gc_partition(mode, list(new.keys()), lam, global_layers)[1])
        if not global_names:
            return new
        return global_gc_update(old, new, global_names, vectors)

    return transform
