"""SCAFFOLD's local solver (Karimireddy et al. 2020, Algorithm 1, option II).

Client ``i`` keeps its control variate ``c_i`` (zero at the start, via
:class:`fedaccel.clients.state.ClientState` under ``scaffold``, keys ``c.<name>``)
and receives the server's ``c`` with the model. Local steps use the corrected
gradient ``g_i(y) + c - c_i``: the correction is added to ``p.grad`` after
``backward()`` and before ``optimizer.step()``, so **it goes through momentum
and weight decay** like the task gradient (:func:`corrected_gradient`).

New control variate (``scaffold.cv-update``):

- ``mean-gradient`` (default): ``c_i+ = (1/K) sum_k (g_i(y_k) + wd * y_k)``,
  the mean of the *uncorrected* stochastic gradients actually evaluated along
  the local trajectory (weight decay included, since it is part of the local
  objective SGD minimises). With plain SGD (no momentum) this equals option II
  exactly: ``y_K = x - lr sum_k (g_k + c - c_i)`` gives
  ``c_i - c + (x - y_K)/(K lr) = (1/K) sum_k g_k``.
- ``option-ii``: the paper's formula ``c_i+ = c_i - c + (x - y_i)/(K lr)``
  (:func:`option_ii_control_variate`). With local momentum ``m`` the model
  moves about ``1/(1-m)`` times further than plain SGD would, so this formula
  overstates the gradient by up to that factor (5x at m = 0.8; measured in
  tests/test_scaffold_feddyn.py). Kept for momentum-free runs and comparison.

Transport: the server's ``c`` arrives as the ArrayRecord ``scaffold.c`` beside
the model (``LocalSolver.received``), and ``c_i+ - c_i`` goes back as the
ArrayRecord ``scaffold.dc``; the framework counts both in bytes_down/bytes_up.

FedDC's solver (:class:`FedDCSolver`, below) is SCAFFOLD's with a local
drift variable: its gradient state is SCAFFOLD's control variate, sent
and returned under the same record names.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedaccel.arrays import StackedRows, arrays_to_record, deferred_row, numpy_to_record, to_numpy
from fedaccel.clients.base import AnchoredSolver
from fedaccel.clients.stacked_solver import StackedStateSolver
from fedaccel.clients.stacked_state import member_rows, select_rows
from fedaccel.clients.state import ClientState, Layout, flat_groups, tensor_layout
from fedaccel.config import require
from fedaccel.contract import ContractError, MessageContract, TrainConfig

T = TypeVar("T")

CV_UPDATES = ("mean-gradient", "option-ii")
C_RECORD = "scaffold.c"
DC_RECORD = "scaffold.dc"


def validate_cv_update(value: str, prefix: str) -> None:
    """``<prefix>.cv-update`` is one of :data:`CV_UPDATES` (SCAFFOLD's and FedDC's key)."""
    require(value in CV_UPDATES, f"{prefix}.cv-update", value, f"allowed: {', '.join(CV_UPDATES)}")


def corrected_gradient(g: T, c: T, c_i: T) -> T:
    """``g + c - c_i`` (Algorithm 1, line 10)."""
    return g + c - c_i  # type: ignore[operator]


def option_ii_control_variate(c_i: T, c: T, x: T, y: T, steps: int, lr: float) -> T:
    """``c_i - c + (x - y) / (K lr)`` (Algorithm 1, line 12, option II)."""
    return c_i - c + (x - y) / (steps * lr)  # type: ignore[operator]


def control_variate_record(c: Mapping[str, np.ndarray]) -> ArrayRecord:
    """The server control variate as the ArrayRecord sent beside the model."""
    return numpy_to_record(OrderedDict((k, np.ascontiguousarray(v)) for k, v in c.items()))


def received_control_variate(received: Mapping[str, ArrayRecord], model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``c`` for every parameter of ``model``, from the received ``scaffold.c`` record."""
    return control_variate_like(received[C_RECORD], OrderedDict(model.named_parameters()))


def control_variate_like(record: ArrayRecord, like: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """The tensors of a ``scaffold.c`` record for the parameters ``like``
    (by name; each on its parameter's device, in its dtype). A record
    without one of them, or with another shape, is a :class:`ContractError`
    (that client's own error reply), never broadcast into a wrong correction."""
    out = OrderedDict()
    for k, p in like.items():
        if k not in record:
            raise ContractError(f"scaffold: the server's control variate ({C_RECORD}) has no {k!r}; "
                                "client and server run different models")
        values = to_numpy(record[k])
        if values.shape != tuple(p.shape):
            raise ContractError(f"scaffold: the server's control variate {k!r} has shape {values.shape}, the "
                                f"parameter {tuple(p.shape)}; client and server run different models")
        out[k] = torch.from_numpy(values.copy()).to(device=p.device, dtype=p.dtype)
    return out


def stored_layout(params: Mapping[str, torch.Tensor]) -> Layout:
    """The layout of the saved ``c_i`` of parameters ``params``: ``c.<name>``
    for each (what ``state.put('scaffold', flat_groups({'c': ...}))`` stores)."""
    return tensor_layout(flat_groups({"c": params}))


class ControlVariateSolver(StackedStateSolver):
    """Local SGD on ``g + c - c_i``; ``<algo>.cv-update`` picks the c_i rule:
    SCAFFOLD's solver (:class:`ScaffoldSolver`) and the part of FedDC's
    (:class:`FedDCSolver`) that is SCAFFOLD's. It declares no saved state:
    each algorithm's class declares its own (``state_name``, its groups),
    so each is the class whose hooks keep rows of the cohort's stacks
    (:func:`fedaccel.clients.stacked_solver.keeps_rows_of_stacks`). The
    saved ``c_i``, ``c - c_i`` and the running ``grad_sum`` are rows of
    the cohort's stacks in a cohort begun together on the fast runner's
    stacked store (:class:`StackedStateSolver`)."""

    messages = MessageContract(to_client=(C_RECORD,), to_server=(DC_RECORD,))
    accumulators = ("grad_sum",)  # mean-gradient's running sum, per step

    def begin_solver(self, train: TrainConfig, anchor: OrderedDict) -> None:
        """The round's ``lr``, the anchor ``x`` (the received parameters) and
        the server's ``c`` (as :meth:`cohort_begin_round` converted it for
        the cohort, or from this client's record)."""
        given = self.__dict__.pop("_given_c", None)  # taken before anything can raise (never left for a next round)
        self._grad_sum_at = None
        self.lr = train.lr
        self.wd = float(self.cfg.weight_decay)
        self.x = anchor
        self.c = given if given is not None else control_variate_like(self.received[C_RECORD], anchor)

    def begin_own_state(self) -> None:
        """A zero ``grad_sum`` and the correction ``c - c_i``."""
        self.grad_sum = OrderedDict((k, torch.zeros_like(v)) for k, v in self.x.items())
        self.correction = [self.c[k] - self.c_i[k] for k in self.x]

    def stacks_made(self, stacks: dict[str, list[torch.Tensor]], solvers: list, params: OrderedDict) -> None:
        """``c - c_i`` for the whole cohort, one stack per parameter: elementwise
        (one ``c``, the usual round, broadcast), the bits of each client's own."""
        stacks["correction"] = [self.shared_or_stacked([s.c[name] for s in solvers]) - block
                                for name, block in zip(params, stacks["c_i"])] if solvers else []

    def own_rows(self, stacks: dict[str, list[torch.Tensor]]) -> None:
        """This client's ``c - c_i`` and ``grad_sum`` as tensors of its own:
        views of its rows (the trainer's ``grad_sum`` rows, if it asked for
        them: :meth:`cohort_step_tensors`), else zeros."""
        self.correction = [block[self._row] for block in stacks["correction"]]
        at, self._grad_sum_at = self._grad_sum_at, None
        self.grad_sum = (OrderedDict((n, block[at[1]]) for n, block in zip(self.x, at[0])) if at is not None
                         else OrderedDict((n, torch.zeros_like(v)) for n, v in self.x.items()))

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:class:`StackedStateSolver`'s, with the server's ``c`` converted once
        per received record, not per client."""
        if type(self).begin_round is not AnchoredSolver.begin_round:
            return None  # a begin_round of its own: each client's, as it is written
        params = OrderedDict(model.named_parameters())
        converted: dict[int, OrderedDict[str, torch.Tensor] | None] = {}
        for o in openings:
            record = o.solver.received.get(C_RECORD)
            if record is not None and id(record) not in converted:
                try:
                    converted[id(record)] = control_variate_like(record, params)
                except ContractError:  # each client's own begin reports it
                    converted[id(record)] = None
            o.solver._given_c = converted.get(id(record))
        return super().cohort_begin_round(model, openings)

    def cohort_step_tensors(self, members: list) -> dict[str, list[torch.Tensor]] | None:
        """The members' ``c - c_i`` as rows of :meth:`cohort_begin_round`'s
        stacks (in the trainer's order) and a zero ``grad_sum`` stack per
        parameter, which the trainer's steps add into and
        :meth:`cohort_after_steps` reads (each member's rows noted, so that
        its own :meth:`end_round` reads them too)."""
        rows = member_rows(members, ("correction",))
        if rows is None:
            return None
        solvers, correction = [m.solver for m in members], rows["correction"]
        grad_sum = [torch.zeros_like(block) for block in correction]
        for pos, s in enumerate(solvers):
            s._grad_sum_at = (grad_sum, pos)
        return {"correction": correction, "grad_sum": grad_sum}

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        self._own_tensors()
        return {"correction": self.correction, "grad_sum": list(self.grad_sum.values())}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + c - c_i`` (:func:`corrected_gradient`, with ``c - c_i`` made
        at the round's start); adds the uncorrected ``g + wd w`` to the
        running ``grad_sum`` of ``mean-gradient`` first, then ``g`` is
        updated in place (the value ``g + (c - c_i)`` gives, without a new tensor)."""
        grad_sum = tensors["grad_sum"]
        grad_sum.add_(g)
        if self.wd:
            grad_sum.add_(w, alpha=self.wd)
        return g.add_(tensors["correction"])

    def new_control_variate(self, model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
        self._own_tensors()
        steps = self.local_steps
        if steps == 0:
            return OrderedDict((k, v.clone()) for k, v in self.c_i.items())
        if self.params.cv_update == "option-ii":
            return OrderedDict(
                (k, option_ii_control_variate(self.c_i[k], self.c[k], self.x[k], p.detach(), steps, self.lr))
                for k, p in model.named_parameters())
        return OrderedDict((k, s / steps) for k, s in self.grad_sum.items())

    def saved_after_round(self, model: torch.nn.Module, new_c: OrderedDict) -> dict[str, OrderedDict]:
        """The groups :meth:`end_round` stores, client by client: the new ``c_i``
        (FedDC adds its drift; a class whose ``saved_after_round`` has no
        batched twin, :meth:`cohort_saved_after_round`, ends client by client)."""
        return {"c": new_c}

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict[str, ArrayRecord]:
        formed = self.store_formed(state)  # the cohort trainer's (cohort_after_steps): c_i+ as one flat row
        if formed is None:
            self._own_tensors()
            new = self.new_control_variate(model)
            dc = numpy_to_record(OrderedDict((k, (new[k] - self.c_i[k]).cpu().numpy()) for k in new))
            state.put(self.state_name, flat_groups(self.saved_after_round(model, new)))
        else:
            (dc,) = formed
        self.correction, self.grad_sum = [], OrderedDict()
        self._rows_of = self._grad_sum_at = None  # the cohort's stacks are not kept past the round
        return {DC_RECORD: dc}

    def cohort_after_steps(self, model: torch.nn.Module, members: list, weights: list[torch.Tensor],
                           rows: list[int], layer_inputs=None) -> None:
        """:meth:`end_round`'s new ``c_i`` (:meth:`new_control_variate`) and
        ``dc = c_i+ - c_i`` for every member at once, from the stacked
        trained weights and running sums: elementwise, so the same values as
        one client at a time; each reply's ``scaffold.dc`` Arrays are rows of
        one stack per parameter (what ``numpy_to_record`` builds, byte for
        byte), and ``end_round`` only stores the new ``c_i``. The division
        by each client's ``K`` (or ``K lr``) is by a tensor of them: on a CPU
        the bits of one client's division by the number; on a CUDA GPU,
        which divides by a number as a product with its reciprocal, within
        one float32 rounding of it."""
        if type(self).end_round is not ControlVariateSolver.end_round or not self.batches_saved_after_round() or any(
                type(m.solver).new_control_variate is not ControlVariateSolver.new_control_variate
                or m.solver.params.cv_update != self.params.cv_update or m.solver.lr != self.lr for m in members):
            return
        solvers = [m.solver for m in members]
        steps = [s.local_steps for s in solvers]
        if 0 in steps:  # a client without steps keeps its c_i: one client at a time
            return
        index = torch.tensor(rows, device=weights[0].device)
        c_is, grad_sums = self._cohort_rows(members, index)
        news, dcs = OrderedDict(), OrderedDict()
        for i, ((name, _), w) in enumerate(zip(model.named_parameters(), weights)):
            c_i = c_is[i]
            shape = (len(solvers),) + (1,) * (c_i.dim() - 1)
            if self.params.cv_update == "option-ii":
                # the per-client divisor steps * lr (a Python float), rounded to the tensor's dtype as there
                scale = torch.tensor([k * self.lr for k in steps], dtype=c_i.dtype, device=c_i.device).view(shape)
                new = option_ii_control_variate(c_i, self.shared_or_stacked([s.c[name] for s in solvers]),
                                                self.shared_or_stacked([s.x[name] for s in solvers]),
                                                w.detach().index_select(0, index), scale, 1.0)
            else:
                scale = torch.tensor(steps, dtype=c_i.dtype, device=c_i.device).view(shape)
                new = grad_sums[i] / scale
            news[name] = new
            dcs[name] = StackedRows((new - c_i).detach().cpu().contiguous())
        replies = [arrays_to_record((k, deferred_row(stack, c)) for k, stack in dcs.items()) for c in range(len(solvers))]
        blocks, layout = self.cohort_saved_after_round(members, list(news.values()), weights, index)
        self.hand_formed_rows(solvers, blocks, layout, replies)

    def batches_saved_after_round(self) -> bool:
        """Whether :meth:`cohort_saved_after_round` forms what this class's
        ``saved_after_round`` stores (not for a subclass with its own: its
        members end client by client)."""
        return type(self).saved_after_round is ControlVariateSolver.saved_after_round

    def cohort_saved_after_round(self, members: list, new_c: list[torch.Tensor], weights: list[torch.Tensor],
                                 index: torch.Tensor) -> tuple[list[torch.Tensor], Layout]:
        """:meth:`saved_after_round` for every member at once: the ``[C, ...]``
        blocks of what ``end_round`` stores, in the order of their layout
        (``new_c``: the members' new ``c_i``, one block per parameter;
        ``weights`` and ``index``: the trained weights and the members' rows)."""
        # c_i+ as what put stores, row by row (stored_layout: the parameters' names, shapes and dtype)
        return new_c, stored_layout(self.x)

    def _cohort_rows(self, members: list, index: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The members' ``c_i`` and ``grad_sum``, one ``[C, ...]`` stack per
        parameter in the members' order: rows of the cohort's stacks where
        every member's are (the trainer's ``grad_sum`` rows are its weights'
        rows, ``index``), else each member's own tensors stacked."""
        solvers = [m.solver for m in members]
        names = list(solvers[0].x)
        c_i = self.members_saved(members, ("c_i",))["c_i"]
        at = [s._grad_sum_at for s in solvers]
        if all(a is not None and a[0] is at[0][0] and a[1] == r for a, r in zip(at, index.tolist())):
            return c_i, select_rows(at[0][0], index.tolist())
        for s in solvers:  # (the trainer did not ask for the stacks: each member's own, zero without steps)
            s._own_tensors()
        return c_i, [torch.stack([s.grad_sum[name] for s in solvers]) for name in names]


class ScaffoldSolver(ControlVariateSolver):
    """SCAFFOLD's local solver (this module's docstring): ``c_i`` saved under
    ``scaffold``; ``scaffold.cv-update`` picks its rule."""

    state_copies = 1
    state_name = "scaffold"
    saved_groups, state_attributes = ("c",), ("c_i",)


# ------------------------------------------------------------------- FedDC
def drift_gradient(theta: T, x: T, h_i: T, alpha: float) -> T:
    """Gradient of ``alpha/2 ||theta - (x - h_i)||^2``: ``alpha (theta - x + h_i)``,
    formed in the one new array ``theta - x`` (the same operations in the
    same order, in place: where the cohort trainer applies it to a whole
    cohort a step, three new arrays made FedDC's rule and step about a
    third slower, its batched steps about 7 %)."""
    drift = theta - x  # type: ignore[operator]
    drift += h_i
    drift *= alpha
    return drift


def drift_update(h_i: T, theta: T, x: T) -> T:
    """``h_i + (theta_i - x)`` (the code's ``parameter_drifts[i] += delta``)."""
    return h_i + (theta - x)  # type: ignore[operator]


class FedDCSolver(ControlVariateSolver):
    """FedDC's local solver: SCAFFOLD's gradient correction plus a local drift variable.

    Paper: "FedDC: Federated Learning with Non-IID Data via Local Drift
    Decoupling and Correction" (Gao, Fu, Li, Chen, Xu, Xu; CVPR 2022,
    arXiv:2203.11751); the rules below are those of the authors' public code
    (github.com/gaoliang13/FedDC, ``train_FedDC`` and ``train_model_FedDC``),
    which the FedCDR paper runs as its CR+FedDC baseline ("the rigorous
    implementation": each client's gradient state travels both ways).

    Client ``i`` keeps two model-shaped states under ``feddc`` (zero at the
    start): its drift ``h_i`` (keys ``h.<name>``) and its gradient state ``c_i``
    (keys ``c.<name>``; the code's ``state_gadient_diffs[i]``), and receives
    the server's ``x`` and its gradient state ``c`` (the ArrayRecord
    ``scaffold.c``, SCAFFOLD's). It minimises

        f_i(theta) + alpha/2 ||theta - (x - h_i)||^2 + <theta, c - c_i>

    by local SGD: the extra gradient ``alpha (theta - x + h_i)`` (:func:`drift_gradient`)
    and SCAFFOLD's correction ``c - c_i`` are added to ``p.grad`` after
    ``backward()`` and before ``optimizer.step()``, so they go through momentum
    and weight decay like the task gradient. After the round:

        h_i <- h_i + (theta_i - x)                       (:func:`drift_update`)
        c_i <- c_i - c + (x - theta_i) / (K lr)          (option II, as the code)

    and ``c_i+ - c_i`` goes back as ``scaffold.dc``. ``feddc.cv-update``
    picks the ``c_i`` rule as SCAFFOLD's ``cv-update`` does:
    ``mean-gradient`` (default) is the mean over the round's ``K`` steps of
    every gradient except the correction (task gradient, weight decay and the
    drift term), taken before ``clip-norm`` and local GC act: equal to
    option II without momentum, clipping or local GC, and the right
    estimate with momentum (this module's docstring); ``option-ii`` is the
    code's formula (use it to follow the code with clipping).

    Differences from the authors' code, all stated: ``K`` is each client's own
    number of local steps (the code uses one ``n_minibatch`` for every client);
    clients are weighted equally (the code divides ``alpha`` and ``c`` by each
    client's share of the data, ``n_i / mean n``); no gradient clipping unless
    the run's ``clip-norm`` asks (the code clips to 10); option II divides by
    the round's lr (the code by the undecayed lr while it trains with a
    per-round decayed one). Server: :mod:`fedaccel.strategies.feddc`.

    In a batched cohort the steps and the end of the round are batched, and
    on the fast runner's stacked store ``c_i`` and ``h_i`` are rows of the
    cohort's stacks, as SCAFFOLD's ``c_i`` (:mod:`fedaccel.clients.stacked_solver`).
    """

    state_copies = 2
    state_name = "feddc"
    saved_groups, state_attributes = ("c", "h"), ("c_i", "h_i")

    def begin_solver(self, train: TrainConfig, anchor: OrderedDict) -> None:
        """SCAFFOLD's round (lr, ``x``, the server's ``c``) and ``alpha``."""
        super().begin_solver(train, anchor)
        self.alpha = float(self.params.alpha)

    def cohort_step_tensors(self, members: list) -> dict[str, list[torch.Tensor]] | None:
        """SCAFFOLD's stacks (``c - c_i``, ``grad_sum``), the members' ``h_i``
        as rows of the cohort's stacks and the anchor ``x``: one received
        model (the usual round) expanded over the members, not copied, else
        each member's stacked (None: each member's own tensors)."""
        tensors = super().cohort_step_tensors(members)
        if tensors is None:
            return None
        h_i = member_rows(members, ("h_i",))["h_i"]
        solvers = [m.solver for m in members]
        anchor = [self.shared_or_stacked([s.x[name] for s in solvers]) for name in self.x]
        anchor = [a.expand(len(solvers), *a.shape) if a.dim() == h.dim() - 1 else a for a, h in zip(anchor, h_i)]
        return {**tensors, "anchor": anchor, "h_i": h_i}

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().step_tensors()
        return {**tensors, "anchor": list(self.x.values()), "h_i": list(self.h_i.values())}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + alpha (w - x + h_i)`` (:func:`drift_gradient`), then SCAFFOLD's
        rule: that sum (and ``wd w``) into ``mean-gradient``'s running sum,
        then ``+ c - c_i``."""
        g = g.add_(drift_gradient(w, tensors["anchor"], tensors["h_i"], self.alpha))
        return super().gradient_rule(w, g, tensors)

    def saved_after_round(self, model: torch.nn.Module, new_c: OrderedDict) -> dict[str, OrderedDict]:
        """The new ``c_i`` and ``h_i`` (:func:`drift_update`), stored together
        by :meth:`ControlVariateSolver.end_round`, which sends ``dc = c_i+ - c_i``."""
        return {"c": new_c, "h": OrderedDict((k, drift_update(self.h_i[k], p.detach(), self.x[k]))
                                             for k, p in model.named_parameters())}

    def batches_saved_after_round(self) -> bool:
        return type(self).saved_after_round is FedDCSolver.saved_after_round

    def cohort_saved_after_round(self, members: list, new_c: list[torch.Tensor], weights: list[torch.Tensor],
                                 index: torch.Tensor) -> tuple[list[torch.Tensor], Layout]:
        """:meth:`saved_after_round` for every member at once: the new ``c_i``
        and ``h_i + (theta_i - x)`` (:func:`drift_update`, elementwise: the
        values one client at a time gives), in the layout ``end_round``
        stores (``c.<name>`` then ``h.<name>``)."""
        solvers = [m.solver for m in members]
        h_i = self.members_saved(members, ("h_i",))["h_i"]
        new_h = [drift_update(h, w.detach().index_select(0, index), self.shared_or_stacked([s.x[name] for s in solvers]))
                 for name, w, h in zip(self.x, weights, h_i)]
        return new_c + new_h, tensor_layout(flat_groups({"c": self.x, "h": self.x}))
