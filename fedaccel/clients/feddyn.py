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

from fedaccel.clients.stacked_solver import StackedStateSolver
from fedaccel.clients.stacked_state import member_rows
from fedaccel.clients.state import ClientState, flat_groups, tensor_layout
from fedaccel.contract import TrainConfig

T = TypeVar("T")


def dynamic_gradient(theta: T, theta_server: T, grad_prev: T, alpha: float) -> T:
    """Gradient of ``-<grad_prev, theta> + alpha/2 ||theta - theta_server||^2``:
    ``alpha (theta - theta_server) - grad_prev``, formed in the one new array
    ``theta - theta_server`` (the same operations in the same order, in
    place, as FedDC's :func:`fedaccel.clients.scaffold.drift_gradient`: the
    cohort trainer applies it to a whole cohort every step)."""
    drift = theta - theta_server  # type: ignore[operator]
    drift *= alpha
    drift -= grad_prev
    return drift


def grad_prev_update(grad_prev: T, theta_local: T, theta_server: T, alpha: float) -> T:
    """``grad_prev - alpha (theta_local - theta_server)`` (Acar et al., Alg. 1)."""
    return grad_prev - alpha * (theta_local - theta_server)  # type: ignore[operator]


class FedDynSolver(StackedStateSolver):
    """Local SGD on FedDyn's dynamically regularised objective; ``feddyn.alpha``.
    The saved ``grad_prev`` is a row of the cohort's stacks in a cohort begun
    together on the fast runner's stacked store (:class:`StackedStateSolver`)."""

    state_copies = 1
    state_name = "feddyn"
    saved_groups = state_attributes = ("grad_prev",)

    def begin_solver(self, train: TrainConfig, anchor: OrderedDict) -> None:
        """``alpha``; the anchor ``theta^{t-1}`` is ``self.anchor``."""
        self.alpha = float(self.params.alpha)

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        self._own_tensors()
        return {"anchor": list(self.anchor.values()), "grad_prev": list(self.grad_prev.values())}

    def cohort_step_tensors(self, members: list) -> dict[str, list[torch.Tensor]] | None:
        """The members' ``grad_prev`` as rows of :meth:`cohort_begin_round`'s
        stacks, in the trainer's order, and the anchor: one received model
        (the usual round) expanded over the members, not copied, else each
        member's stacked (None: each member's own tensors)."""
        rows = member_rows(members, ("grad_prev",))
        if rows is None:
            return None
        grad_prev = rows["grad_prev"]
        solvers = [m.solver for m in members]
        anchor = [self.shared_or_stacked([s.anchor[name] for s in solvers]) for name in self.anchor]
        anchor = [a.expand(len(solvers), *a.shape) if a.dim() == g.dim() - 1 else a for a, g in zip(anchor, grad_prev)]
        return {"anchor": anchor, "grad_prev": grad_prev}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + alpha (w - w^t) - grad_prev`` (:func:`dynamic_gradient`); ``g``
        updated in place (the value ``g + ...`` gives, without a new tensor and a copy)."""
        return g.add_(dynamic_gradient(w, tensors["anchor"], tensors["grad_prev"], self.alpha))

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict:
        if self.store_formed(state) is not None:  # the cohort trainer's (cohort_after_steps): one flat row
            return {}
        self._own_tensors()
        formed = OrderedDict((k, grad_prev_update(self.grad_prev[k], p.detach(), self.anchor[k], self.alpha))
                             for k, p in model.named_parameters())
        state.put(self.state_name, flat_groups({"grad_prev": formed}))
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
        index = torch.tensor(rows, dtype=torch.long, device=weights[0].device)
        saved = self.members_saved(members, ("grad_prev",))["grad_prev"]
        news = [grad_prev_update(grad_prev, w.detach().index_select(0, index),
                                 self.shared_or_stacked([s.anchor[name] for s in solvers]), self.alpha)
                for (name, _), w, grad_prev in zip(model.named_parameters(), weights, saved)]
        # what put(flat_groups({'grad_prev': ...})) stores, as one row per member
        self.hand_formed_rows(solvers, news, tensor_layout(flat_groups({"grad_prev": self.anchor})))
