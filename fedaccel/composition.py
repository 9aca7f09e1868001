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
  hybrid (``gc.lambda``, ``gc.global-layers``): local GC is a client gradient
  transform on the local tensors, global GC a server update transform on the
  global ones (clients/gradient_centralization.py, docs/fedacg-gcfed.md).
"""

from __future__ import annotations

from typing import Callable

import torch
from flwr.app import ArrayRecord

from fedaccel.config import RunConfig

GradientTransform = Callable[[torch.nn.Module], None]
UpdateTransform = Callable[[ArrayRecord, ArrayRecord], ArrayRecord]


def client_gradient_transforms(cfg: RunConfig, model: torch.nn.Module) -> list[GradientTransform]:
    """Gradient transforms for this run's local steps (local GC)."""
    from clients.gradient_centralization import gc_partition, local_gc_transform

    out: list[GradientTransform] = []
    gc = getattr(cfg, "gc", None)
    if gc is not None and gc.mode != "none":
        local, _ = gc_partition(gc.mode, list(model.named_parameters()), gc.lam, gc.global_layers)
        if local:
            out.append(local_gc_transform(model, local))
    return out


def server_update_transforms(cfg: RunConfig) -> list[UpdateTransform]:
    """Global-update transforms for this run (global GC)."""
    from clients.gradient_centralization import global_gc_transform

    out: list[UpdateTransform] = []
    gc = getattr(cfg, "gc", None)
    if gc is not None and gc.mode in ("global", "hybrid"):
        out.append(global_gc_transform(gc.mode, gc.lam, gc.global_layers))
    return out
