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
"""

from __future__ import annotations

from typing import Callable

import torch
from flwr.app import ArrayRecord

from fedaccel.config import RunConfig

GradientTransform = Callable[[torch.nn.Module], None]
UpdateTransform = Callable[[ArrayRecord, ArrayRecord], ArrayRecord]


def client_gradient_transforms(cfg: RunConfig, model: torch.nn.Module) -> list[GradientTransform]:
    """Gradient transforms for this run's local steps (none yet)."""
    return []


def server_update_transforms(cfg: RunConfig) -> list[UpdateTransform]:
    """Global-update transforms for this run (none yet)."""
    return []
