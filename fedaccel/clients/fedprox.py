"""FedProx's local solver (Li et al. 2020, eq. 2).

The client minimises ``F_k(w) + mu/2 * ||w - w^t||^2`` from the received
model ``w^t``. The proximal term's gradient ``mu * (w - w^t)`` is added to
``p.grad`` before the optimizer step (identical to adding the term to the
loss, without a second autograd pass), so it goes through momentum and
weight decay like the task gradient.
"""

from __future__ import annotations


import torch

from fedaccel.clients.base import LocalSolver
from fedaccel.clients.state import ClientState
from fedaccel.contract import MessageContract, TrainConfig


class FedProxSolver(LocalSolver):
    """Local SGD on the proximal objective; ``mu`` from ``fedprox.mu``."""

    anchor: list[torch.Tensor]
    # Flower's FedProx strategy adds ``proximal-mu`` (= fedprox.mu) to every training config.
    messages = MessageContract(config=("proximal-mu",))

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        self.mu = float(config.get("proximal-mu"))
        self.anchor = [p.detach().clone() for p in model.parameters()]

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"anchor": self.anchor}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + mu (w - w^t)``, the gradient of eq. 2's proximal objective."""
        return g if self.mu == 0.0 else g.add(w - tensors["anchor"], alpha=self.mu)
