"""FedACG's local solver (Kim et al. 2024, Algorithm 1, client lines).

The client starts from the received lookahead model ``b = theta + lam * m``
(the server's broadcast) and minimises
``l_i(w) + beta/2 * ||w - b||^2``; the regulariser's gradient ``beta (w - b)``
is added to ``p.grad`` before the optimizer step, exactly like FedProx's
proximal term, so it goes through momentum and weight decay like the task
gradient. ``fedacg.local-regularizer = false`` (Table 4 ablation) sets the
pull to zero. The reply carries the trained weights; the server forms
``Delta_i = w_K - b`` itself (same bytes as sending the delta).
"""

from __future__ import annotations


import torch

from fedaccel.clients.base import LocalSolver
from fedaccel.clients.state import ClientState
from fedaccel.contract import TrainConfig


class FedACGSolver(LocalSolver):
    """Local SGD with the pull ``beta (w - b)`` toward the broadcast model ``b``."""

    anchor: list[torch.Tensor]

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        p = self.params
        self.beta = float(p.beta) if p.local_regularizer else 0.0
        self.anchor = [w.detach().clone() for w in model.parameters()] if self.beta else []

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"anchor": self.anchor} if self.beta else {}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + beta (w - b)``: the gradient of the local regularizer."""
        return g if self.beta == 0.0 else g.add(w - tensors["anchor"], alpha=self.beta)
