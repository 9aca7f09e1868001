"""A local solver whose saved state is a few model-shaped groups, kept as
rows of the cohort's stacks when a cohort begins together on the fast
runner's stacked store (FedDyn's ``grad_prev``; FedRKMGC's ``delta`` and
``raw_prev``; SCAFFOLD's ``c_i``; FedDC's ``c_i`` and ``h_i``).

Client by client, :meth:`StackedStateSolver.begin_at_anchor` reads the
groups as tensors of the client's own (zeros before its first round).
When the fast runner keeps every client's state as a row of one store
(:mod:`fedaccel.clients.stacked_state`), :meth:`~StackedStateSolver.cohort_begin_round`
reads the whole cohort's groups in one gather and keeps them as one
``[C, ...]`` stack per group and parameter; each client holds its row
(``_rows_of`` and ``_row``), and the cohort trainer reads the members' rows
(:func:`~fedaccel.clients.stacked_state.member_rows`). A client gets tensors
of its own only when per-client code asks (:meth:`~StackedStateSolver._own_tensors`).
The batched end of the round (the algorithm's ``cohort_after_steps``) forms
every member's new state as one flat row (:meth:`~StackedStateSolver.hand_formed_rows`),
which ``end_round`` only stores (:meth:`~StackedStateSolver.store_formed`).

Only the class that first declares ``state_name`` keeps rows of the stacks
(:func:`keeps_rows_of_stacks`); any subclass of it keeps tensors of each
client's own, since any of its own hooks may read or write them (also one
that declares ``state_name`` again).

Written by hand: the stacked store is this project's (Flower keeps one
RecordDict per Context).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

import torch

from fedaccel.clients.base import AnchoredSolver
from fedaccel.clients.stacked_state import begun_rows, gathered_groups, member_rows, select_rows
from fedaccel.clients.state import ClientState, Layout, groups_or_zeros
from fedaccel.contract import TrainConfig


def keeps_rows_of_stacks(cls: type) -> bool:
    """Whether ``cls`` is the class that first declares ``state_name`` (no
    class above it does): its hooks are the ones written for rows of the
    cohort's stacks. A subclass of it is not, even one that declares
    ``state_name`` again."""
    return "state_name" in vars(cls) and not any("state_name" in vars(base) for base in cls.__mro__[1:])


class StackedStateSolver(AnchoredSolver):
    """An :class:`AnchoredSolver` whose saved state is ``saved_groups`` under
    ``state_name`` (what ``state.put(state_name, flat_groups({group: tensors
    like the parameters}))`` stores), kept as the attributes
    ``state_attributes`` (one OrderedDict per group, by parameter name).

    A subclass writes :meth:`begin_solver` (what its round needs besides
    the saved state), and may write :meth:`begin_own_state` and
    :meth:`stacks_made` for state of its own derived from the saved groups
    (SCAFFOLD's ``c - c_i``)."""

    state_name: ClassVar[str]
    saved_groups: ClassVar[tuple[str, ...]]
    state_attributes: ClassVar[tuple[str, ...]]  # the attribute each saved group is kept as, in that order

    def begin_solver(self, train: TrainConfig, anchor: OrderedDict) -> None:
        """What the round needs besides the saved state (``self.anchor`` is
        set): the algorithm's constants, the received extras."""
        raise NotImplementedError

    def begin_own_state(self) -> None:
        """Client by client, after the saved groups are read: state derived
        from them (the rows of the cohort's stacks instead: :meth:`stacks_made`)."""

    def stacks_made(self, stacks: dict[str, list[torch.Tensor]], solvers: list, params: OrderedDict) -> None:
        """The cohort's stacks narrowed to the begun ``solvers`` (in order):
        add stacks derived from the saved groups, for all of them at once."""

    def begin_at_anchor(self, train: TrainConfig, state: ClientState, anchor: OrderedDict) -> None:
        """The anchor, :meth:`begin_solver`, then the saved groups: tensors
        of this client's own (zeros before its first round), or, in a cohort
        begun together on the fast runner's stacked store, this client's row
        of the cohort's stacks (its ``_row``, set once they are narrowed to
        the begun clients: :meth:`cohort_begin_round`)."""
        given = self.__dict__.pop("_given_state", None)  # taken before anything can raise
        self._formed = None  # the new state the cohort trainer forms (hand_formed_rows)
        self._rows_of = None
        self.anchor = anchor
        self.begin_solver(train, anchor)
        if given is not None:
            self._rows_of = given
            return
        saved = groups_or_zeros(state, self.state_name, self.saved_groups, anchor)
        for group, attribute in zip(self.saved_groups, self.state_attributes):
            setattr(self, attribute, saved[group])
        self.begin_own_state()

    def _own_tensors(self) -> None:
        """This client's saved groups as tensors of its own (views of its
        rows) when they are rows of the cohort's stacks: for per-client code
        (``step_tensors``, ``end_round``); the values :meth:`begin_at_anchor`
        reads client by client."""
        stacks, self._rows_of = getattr(self, "_rows_of", None), None
        if stacks is None:
            return
        for attribute in self.state_attributes:
            setattr(self, attribute, OrderedDict((n, block[self._row]) for n, block in zip(self.anchor, stacks[attribute])))
        self.own_rows(stacks)

    def own_rows(self, stacks: dict[str, list[torch.Tensor]]) -> None:
        """:meth:`_own_tensors` of the stacks :meth:`stacks_made` added."""

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:meth:`begin_at_anchor` of every opening (no model loaded); when
        the fast runner keeps the clients' states stacked, their saved groups
        are read in one gather and kept as one stack per group and parameter,
        narrowed to the clients whose begin succeeded (a subclass of the
        declaring class: tensors of each client's own, :func:`keeps_rows_of_stacks`)."""
        if type(self).begin_round is not AnchoredSolver.begin_round:
            return None  # a begin_round of its own: each client's, as it is written
        params = OrderedDict(model.named_parameters())
        stacks = None
        if all(keeps_rows_of_stacks(type(o.solver)) for o in openings):
            gathered = gathered_groups([o.state for o in openings], self.state_name, self.saved_groups, params,
                                       next(iter(params.values())).device)
            if gathered is not None:
                stacks = {a: gathered[g] for g, a in zip(self.saved_groups, self.state_attributes)}
        for o in openings:
            o.solver._given_state = stacks
        begun = super().cohort_begin_round(model, openings)
        if stacks is not None:
            ok = begun_rows(openings, begun)
            for attribute in self.state_attributes:
                stacks[attribute] = select_rows(stacks[attribute], ok)
            self.stacks_made(stacks, [openings[k].solver for k in ok], params)
        return begun

    def members_saved(self, members: list, attributes: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
        """The members' ``attributes``, one ``[C, ...]`` stack per parameter
        in the members' order: rows of the cohort's stacks where every
        member's are, else each member's own tensors stacked."""
        rows = member_rows(members, attributes)
        if rows is not None:
            return rows
        solvers = [m.solver for m in members]
        for s in solvers:
            s._own_tensors()
        return {a: [torch.stack([getattr(s, a)[name] for s in solvers]) for name in self.anchor] for a in attributes}

    @staticmethod
    def hand_formed_rows(solvers: list, blocks: list[torch.Tensor], layout: Layout, *extras: list[Any]) -> None:
        """Each solver's new state as its row of one flat ``[C, D]`` stack of
        ``blocks`` (``[C, ...]`` each, in ``layout``'s order: what
        ``put(flat_groups(...))`` stores, row by row), and its item of each of
        ``extras``, for :meth:`store_formed`."""
        flat = torch.cat([b.reshape(len(solvers), -1) for b in blocks], dim=1)
        for c, s in enumerate(solvers):
            s._formed = (flat[c], layout, *(extra[c] for extra in extras))

    def store_formed(self, state: ClientState) -> tuple | None:
        """Store the new state the cohort trainer formed for this client
        (:meth:`hand_formed_rows`) as one flat row, and return what came
        with it (None: nothing formed; the caller forms it client by client)."""
        formed, self._formed = getattr(self, "_formed", None), None
        if formed is None:
            return None
        self._rows_of = None  # the cohort's stacks are not kept past the round
        state.put_flat(self.state_name, formed[0], formed[1])
        return formed[2:]

    def reads_trained_model(self) -> bool:
        """Not once the cohort trainer formed the new state."""
        return getattr(self, "_formed", None) is None
