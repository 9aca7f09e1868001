"""FedDyn's local solver (Acar et al. 2021, "Federated Learning Based on
Dynamic Regularization", Algorithm 1).

Client ``k`` keeps ``grad_prev`` (``nabla L_k(theta_k^{t-1})``, zero at the
start) and, receiving the server model ``theta^{t-1}``, minimises

    L_k(theta) - <grad_prev, theta> + alpha/2 ||theta - theta^{t-1}||^2

by local SGD. The extra gradient ``-grad_prev + alpha (theta - theta^{t-1})``
(:func:`dynamic_gradient`) is added to ``p.grad`` after ``backward()`` and
before ``optimizer.step()``, so **it goes through momentum and weight decay**
like the task gradient (identical to adding the terms to the loss). After
training: ``grad_prev <- grad_prev - alpha (theta_k^t - theta^{t-1})``
(:func:`grad_prev_update`), kept via :class:`fedaccel.clients.state.ClientState`
under ``feddyn`` (keys ``grad_prev.<name>``). Server: :mod:`fedaccel.strategies.feddyn`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

import torch

from fedaccel.clients.base import LocalSolver
from fedaccel.clients.state import ClientState, flat_groups, groups_or_zeros
from fedaccel.contract import TrainConfig

T = TypeVar("T")


def dynamic_gradient(theta: T, theta_server: T, grad_prev: T, alpha: float) -> T:
    """Gradient of ``-<grad_prev, theta> + alpha/2 ||theta - theta_server||^2``."""
    return alpha * (theta - theta_server) - grad_prev  # type: ignore[operator]


def grad_prev_update(grad_prev: T, theta_local: T, theta_server: T, alpha: float) -> T:
    """``grad_prev - alpha (theta_local - theta_server)`` (Acar et al., Alg. 1)."""
    return grad_prev - alpha * (theta_local - theta_server)  # type: ignore[operator]


class FedDynSolver(LocalSolver):
    """Local SGD on FedDyn's dynamically regularised objective; ``feddyn.alpha``."""

    state_copies = 1

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        self.alpha = float(self.params.alpha)
        params = OrderedDict(model.named_parameters())
        self.anchor = OrderedDict((k, p.detach().clone()) for k, p in params.items())
        self.grad_prev = groups_or_zeros(state, "feddyn", ("grad_prev",), self.anchor)["grad_prev"]

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"anchor": list(self.anchor.values()), "grad_prev": list(self.grad_prev.values())}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + alpha (w - w^t) - grad_prev`` (:func:`dynamic_gradient`)."""
        return g + dynamic_gradient(w, tensors["anchor"], tensors["grad_prev"], self.alpha)

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict:
        state.put("feddyn", flat_groups({"grad_prev": {
            k: grad_prev_update(self.grad_prev[k], p.detach(), self.anchor[k], self.alpha)
            for k, p in model.named_parameters()
        }}))
        return {}
