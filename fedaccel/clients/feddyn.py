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
from fedaccel.clients.stacked_state import begun_rows, gathered_groups, member_rows, select_rows
from fedaccel.clients.state import ClientState, flat_groups, groups_or_zeros, tensor_layout
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
        """``alpha``, the anchor ``theta^{t-1}`` and the saved ``grad_prev``
        (zero at the start); in a cohort begun together on the fast runner's
        stacked store, ``grad_prev`` is this client's row of the cohort's
        stacks (:meth:`cohort_begin_round`, :meth:`_own_tensors`)."""
        given = self.__dict__.pop("_given_state", None)  # taken before anything can raise
        self._formed = None  # the new grad_prev the cohort trainer forms (cohort_after_steps)
        self._rows_of = None
        self.alpha = float(self.params.alpha)
        self.anchor = anchor
        if given is not None:
            self._rows_of = given  # this client's row: its _row, set once the cohort's stacks are made
            return
        self.grad_prev = groups_or_zeros(state, "feddyn", ("grad_prev",), anchor)["grad_prev"]

    def _own_tensors(self) -> None:
        """This client's ``grad_prev`` as tensors of its own (views of its
        row) when it is a row of the cohort's stacks: for per-client code
        (:meth:`step_tensors`, :meth:`end_round`)."""
        stacks, self._rows_of = getattr(self, "_rows_of", None), None
        if stacks is not None:
            self.grad_prev = OrderedDict((n, block[self._row]) for n, block in zip(self.anchor, stacks["grad_prev"]))

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:meth:`begin_at_anchor` of every opening (no model loaded); when
        the fast runner keeps the clients' states stacked, their saved
        ``grad_prev`` is read in one gather and kept as one stack per
        parameter (a subclass: tensors of each client's own)."""
        if type(self).begin_round is not AnchoredSolver.begin_round:
            return None
        params = OrderedDict(model.named_parameters())
        # (a subclass, whose own hooks may read grad_prev: each client's own tensors)
        stacks = None if any(type(o.solver) is not FedDynSolver for o in openings) else gathered_groups(
            [o.state for o in openings], "feddyn", ("grad_prev",), params, next(iter(params.values())).device)
        for o in openings:
            o.solver._given_state = stacks
        begun = super().cohort_begin_round(model, openings)
        if stacks is not None:  # the begun clients' rows, in order
            stacks["grad_prev"] = select_rows(stacks["grad_prev"], begun_rows(openings, begun))
        return begun

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
        """``g + alpha (w - w^t) - grad_prev`` (:func:`dynamic_gradient`)."""
        return g + dynamic_gradient(w, tensors["anchor"], tensors["grad_prev"], self.alpha)

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict:
        formed, self._formed = getattr(self, "_formed", None), None
        if formed is not None:  # the cohort trainer's, for the whole batch (cohort_after_steps): one flat row
            self._rows_of = None  # the cohort's stacks are not kept past the round
            state.put_flat("feddyn", *formed)
            return {}
        self._own_tensors()
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
        index = torch.tensor(rows, dtype=torch.long, device=weights[0].device)
        rows = member_rows(members, ("grad_prev",))
        if rows is not None:
            saved = rows["grad_prev"]
        else:  # each member's own tensors, stacked
            for s in solvers:
                s._own_tensors()
            saved = [torch.stack([s.grad_prev[name] for s in solvers]) for name, _ in model.named_parameters()]
        news = [grad_prev_update(grad_prev, w.detach().index_select(0, index),
                                 self.shared_or_stacked([s.anchor[name] for s in solvers]), self.alpha)
                for (name, _), w, grad_prev in zip(model.named_parameters(), weights, saved)]
        # what put(flat_groups({'grad_prev': ...})) stores, as one row per member
        flat = torch.cat([v.reshape(len(solvers), -1) for v in news], dim=1)
        layout = tensor_layout(flat_groups({"grad_prev": self.anchor}))
        for c, s in enumerate(solvers):
            s._formed = (flat[c], layout)

    def reads_trained_model(self) -> bool:
        """Not once :meth:`cohort_after_steps` formed the new ``grad_prev``."""
        return getattr(self, "_formed", None) is None
