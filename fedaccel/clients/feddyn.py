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

from fedaccel.clients.base import AnchoredSolver
from fedaccel.clients.state import ClientState, flat_groups, groups_or_zeros
from fedaccel.contract import TrainConfig

T = TypeVar("T")


def dynamic_gradient(theta: T, theta_server: T, grad_prev: T, alpha: float) -> T:
    """Gradient of ``-<grad_prev, theta> + alpha/2 ||theta - theta_server||^2``."""
    return alpha * (theta - theta_server) - grad_prev  # type: ignore[operator]


def grad_prev_update(grad_prev: T, theta_local: T, theta_server: T, alpha: float) -> T:
    """``grad_prev - alpha (theta_local - theta_server)`` (Acar et al., Alg. 1)."""
    return grad_prev - alpha * (theta_local - theta_server)  # type: ignore[operator]


class FedDynSolver(AnchoredSolver):
    """Local SGD on FedDyn's dynamically regularised objective; ``feddyn.alpha``."""

    state_copies = 1

    def begin_at_anchor(self, train: TrainConfig, state: ClientState, anchor: OrderedDict) -> None:
        """``alpha``, the anchor ``theta^{t-1}`` and the saved ``grad_prev`` (zero at the start)."""
        self.alpha = float(self.params.alpha)
        self.anchor = anchor
        self.grad_prev = groups_or_zeros(state, "feddyn", ("grad_prev",), anchor)["grad_prev"]
        self._formed = None  # the new grad_prev the cohort trainer forms (cohort_after_steps)

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"anchor": list(self.anchor.values()), "grad_prev": list(self.grad_prev.values())}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + alpha (w - w^t) - grad_prev`` (:func:`dynamic_gradient`)."""
        return g + dynamic_gradient(w, tensors["anchor"], tensors["grad_prev"], self.alpha)

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict:
        formed, self._formed = getattr(self, "_formed", None), None
        if formed is None:
            formed = OrderedDict((k, grad_prev_update(self.grad_prev[k], p.detach(), self.anchor[k], self.alpha))
                                 for k, p in model.named_parameters())
        state.put("feddyn", flat_groups({"grad_prev": formed}))
        return {}

    def cohort_after_steps(self, model: torch.nn.Module, members: list, weights: list[torch.Tensor],
                           rows: list[int], layer_inputs=None) -> None:
        """:meth:`end_round`'s ``grad_prev`` update (:func:`grad_prev_update`)
        for every member at once, from the stacked trained weights:
        elementwise, so the same values as one client at a time;
        ``end_round`` then only stores them."""
        if type(self).end_round is not FedDynSolver.end_round:
            return
        solvers = [m.solver for m in members]
        if any(s.alpha != self.alpha for s in solvers):
            return
        index = torch.tensor(rows, device=weights[0].device)
        formed: list[OrderedDict] = [OrderedDict() for _ in solvers]
        for (name, _), w in zip(model.named_parameters(), weights):
            anchor = self.shared_or_stacked([s.anchor[name] for s in solvers])
            new = grad_prev_update(torch.stack([s.grad_prev[name] for s in solvers]),
                                   w.detach().index_select(0, index), anchor, self.alpha)
            for c in range(len(solvers)):
                formed[c][name] = new[c]
        for s, grad_prev in zip(solvers, formed):
            s._formed = grad_prev

    def reads_trained_model(self) -> bool:
        """Not once :meth:`cohort_after_steps` formed the new ``grad_prev``."""
        return getattr(self, "_formed", None) is None
