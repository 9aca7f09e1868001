"""Transforms that compose with every algorithm, without the algorithm knowing.

Some methods are not algorithms of their own but layers on top of any of
them (GC-Fed's gradient centralization is applied to FedAvg, FedProx, ... in
its Table 7). They plug in here:

- :func:`client_gradient_transforms`: callables ``f(model)`` run on every
  local step after the algorithm's own ``transform_gradients`` and before the
  optimizer step;
- :func:`server_update_transforms`: callables ``f(old, new) -> new`` applied
  to the global model after the algorithm's aggregation, ``old`` being the
  model that was sent.

Both return empty lists unless a run-config key switches a layer on.

Layers wired here:

- GC-Fed's gradient centralization, ``gc.mode`` in none | local | global |
  hybrid | local-only (``gc.lambda``, ``gc.global-layers``, ``gc.vectors``,
  ``gc.weight-decay``, ``gc.global-scope``): local GC is a client gradient transform on the local
  tensors, global GC a server update transform on the global ones
  (fedaccel/clients/gradient_centralization.py, docs/fedacg-gcfed.md).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from flwr.app import ArrayRecord

from fedaccel.clients.gradient_centralization import gc_partition, global_gc_transform, local_gc_transform
from fedaccel.config import RunConfig

GradientTransform = Callable[[torch.nn.Module], None]
UpdateTransform = Callable[[ArrayRecord, ArrayRecord], ArrayRecord]


def client_gradient_transforms(cfg: RunConfig, model: torch.nn.Module,
                               optimizer: torch.optim.Optimizer,
                               params: Sequence[torch.Tensor] | None = None,
                               leading: int = 0) -> list[GradientTransform]:
    """Gradient transforms for this run's local steps (local GC); ``optimizer``
    is the one the solver steps with (its weight decay matters, see
    :func:`optimizer_weight_decay`).

    They act on ``model``'s parameters, or on ``params`` (aligned with
    ``model.parameters()``, each with ``leading`` batch dims in front: the
    cohort trainer's stacked clients), which ``optimizer`` then steps."""
    out: list[GradientTransform] = []
    names = [n for n, _ in model.named_parameters()]
    named = list(zip(names, params)) if params is not None else list(model.named_parameters())
    gc = getattr(cfg, "gc", None)
    if gc is not None and gc.mode != "none":
        local, _ = gc_partition(gc.mode, names, gc.lam, gc.global_layers)
        if local:
            decay = optimizer_weight_decay(optimizer, named) if gc.weight_decay == "centralized" else None
            out.append(local_gc_transform(named, local, gc.vectors, decay, leading))
    return out


def optimizer_weight_decay(optimizer: torch.optim.Optimizer,
                           model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per tensor name, the weight decay ``optimizer`` adds to ``p.grad``
    inside ``optimizer.step()``, i.e. after the gradient transforms
    (``model``: a module, or ``(name, tensor)`` pairs the optimizer steps).

    Read from the optimizer the solver built (its param groups), not from
    ``weight-decay``: a solver may build its optimizer without decay and add
    the decay to ``p.grad`` itself before the transforms (FedPM does, to
    precondition it), in which case GC already sees it and nothing is to be
    corrected (an empty dict).
    """
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    by_id = {id(p): float(group.get("weight_decay", 0.0))
             for group in optimizer.param_groups for p in group["params"]}
    return {n: by_id[id(p)] for n, p in named if by_id.get(id(p), 0.0)}


def server_update_transforms(cfg: RunConfig) -> list[UpdateTransform]:
    """Global-update transforms for this run (global GC)."""
    out: list[UpdateTransform] = []
    gc = getattr(cfg, "gc", None)
    if gc is not None and gc.mode in ("global", "hybrid"):
        out.append(global_gc_transform(gc.mode, gc.lam, gc.global_layers, gc.vectors, gc.global_scope))
    return out
