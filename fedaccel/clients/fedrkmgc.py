"""FedRKMGC's local solver (fedrkmgc-relaxation-fast-km.txt, Algorithm 1).

Client ``n`` keeps two model-sized tensors between rounds (both zero at the
start, Algorithm 1 line 1): the correction ``delta`` (``Delta_n``) and the
previous raw correction ``raw_prev`` (``Delta~_n``). In the round with paper
index ``t``:

- lines 6-8: local SGD on the corrected gradient ``g_n(theta) - delta``.
  The correction is subtracted from ``p.grad`` after ``backward()`` and
  before ``optimizer.step()``, so **it goes through momentum and weight
  decay** exactly like the task gradient: with momentum ``m`` the buffer
  accumulates ``g + wd*theta - delta``. (Algorithm 1 is written for plain
  SGD, where both readings coincide; the paper trains with momentum 0.8 and
  does not say more.)
- line 10: ``raw = delta - beta (theta_local - theta_global)``
  (:func:`raw_correction`);
- line 11: the correction update, by variant (:func:`correction_update`):
  ``fast-km`` (:func:`fast_km_update`)
  ``delta' = c1 (raw + delta) - c2 raw_prev``,
  ``c1 = (2(t+1)+gamma) / (2(t+1+gamma))``, ``c2 = (t+1)/(t+1+gamma)``;
  ``km`` (appendix D.6, :func:`km_update`)
  ``delta' = c1 delta + gamma/(2(t+1+gamma)) raw``;
  ``raw`` (ablation rows "raw" and "w Re": no KM) ``delta' = raw``.
  Then ``raw_prev = raw`` and ``delta = delta'``.

Round index: Algorithm 1 loops ``t = 0, ..., T-1`` and the update after
round ``t`` uses ``t+1`` in its coefficients. Flower numbers rounds from 1, so
``t = server-round - 1`` (:func:`paper_round_index`): in the first round
``c1 = (2+gamma)/(2(1+gamma))`` and ``c2 = 1/(1+gamma)``. ``t`` is the
*global* round even for a client that skipped rounds (the paper's
``Delta_n^t`` notation is indexed by the global round). Which variant runs
is decided by ``fedrkmgc.variant`` (table in :mod:`fedaccel.strategies.fedrkmgc`).

The state covers ``model.named_parameters()`` (the models here have no
buffers) and goes through :class:`fedaccel.clients.state.ClientState` under the name
``fedrkmgc`` with keys ``delta.<name>`` and ``raw_prev.<name>``.
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

CORRECTIONS = ("raw", "km", "fast-km")

#: ``fedrkmgc.variant`` -> (server relaxation with ``rho``?, correction update).
#: The paper's ablation rows (section 4.4 / Table 3, appendix D.6 / Table 9);
#: "fast KM removed" means ``delta = raw`` (no KM of any kind); "relaxation
#: removed" means ``rho = 1`` (plain mean, FedAvg-style aggregation).
VARIANTS: dict[str, tuple[bool, str]] = {
    "raw": (False, "raw"),        # raw (w/o KM & Re)
    "re": (True, "raw"),          # w Re
    "km": (False, "km"),          # w KM
    "fast-km": (False, "fast-km"),  # w fast KM
    "re-km": (True, "km"),        # w Re & KM
    "full": (True, "fast-km"),    # w Re & fast KM = FedRKMGC
}


def variant_components(variant: str) -> tuple[bool, str]:
    """(relaxation on?, correction kind) of an ablation variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    return VARIANTS[variant]


def paper_round_index(server_round: int) -> int:
    """Algorithm 1's ``t`` (0-based) of Flower's 1-based ``server-round``."""
    if server_round < 1:
        raise ValueError(f"server-round must be >= 1 (got {server_round})")
    return server_round - 1


def fast_km_coefficients(t: int, gamma: float) -> tuple[float, float]:
    """``(c1, c2) = ((2(t+1)+gamma) / (2(t+1+gamma)), (t+1)/(t+1+gamma))`` (Alg. 1 line 11)."""
    c1 = (2.0 * (t + 1) + gamma) / (2.0 * (t + 1 + gamma))
    c2 = (t + 1) / (t + 1 + gamma)
    return c1, c2


def km_coefficients(t: int, gamma: float) -> tuple[float, float]:
    """``(a, b) = ((2(t+1)+gamma) / (2(t+1+gamma)), gamma / (2(t+1+gamma)))``; ``a + b = 1`` (D.6)."""
    a = (2.0 * (t + 1) + gamma) / (2.0 * (t + 1 + gamma))
    b = gamma / (2.0 * (t + 1 + gamma))
    return a, b


def raw_correction(delta: T, theta_local: T, theta_global: T, beta: float) -> T:
    """``Delta~^{t+1} = Delta^t - beta (theta_n^{t+1} - theta^t)`` (Alg. 1 line 10)."""
    return delta - beta * (theta_local - theta_global)  # type: ignore[operator]


def fast_km_update(delta: T, raw: T, raw_prev: T, t: int, gamma: float) -> T:
    """``c1 (raw + delta) - c2 raw_prev`` (Alg. 1 line 11)."""
    c1, c2 = fast_km_coefficients(t, gamma)
    return c1 * (raw + delta) - c2 * raw_prev  # type: ignore[operator]


def km_update(delta: T, raw: T, t: int, gamma: float) -> T:
    """``a delta + b raw`` (appendix D.6, the "(standard) KM" ablation)."""
    a, b = km_coefficients(t, gamma)
    return a * delta + b * raw  # type: ignore[operator]


def correction_update(kind: str, delta: T, raw: T, raw_prev: T, t: int, gamma: float) -> T:
    """The new ``delta`` for correction ``kind`` in :data:`CORRECTIONS`."""
    if kind == "fast-km":
        return fast_km_update(delta, raw, raw_prev, t, gamma)
    if kind == "km":
        return km_update(delta, raw, t, gamma)
    if kind == "raw":
        return raw
    raise ValueError(f"unknown correction {kind!r}; allowed: {', '.join(CORRECTIONS)}")


STATE_GROUPS = ("delta", "raw_prev")  # a client's saved state, in this order


class FedRKMGCSolver(AnchoredSolver):
    """Local SGD on ``g - delta``, then the (fast-)KM correction update."""

    state_copies = 2

    def begin_at_anchor(self, train: TrainConfig, state: ClientState, anchor: OrderedDict) -> None:
        """Round ``t``, the variant's correction, the anchor ``theta^t`` and the
        saved ``delta``, ``raw_prev`` (zero at the start); in a cohort begun
        together on the fast runner's stacked store, those two are this
        client's rows of the cohort's stacks (:meth:`cohort_begin_round`,
        :meth:`_own_tensors`)."""
        given = self.__dict__.pop("_given_state", None)  # taken before anything can raise
        self._formed = None  # the new corrections the cohort trainer forms (cohort_after_steps)
        self._rows_of = None
        self.t = paper_round_index(train.server_round)
        _, self.correction = variant_components(self.params.variant)
        self.anchor = anchor
        if given is not None:
            self._rows_of = given  # this client's rows: its _row, set once the cohort's stacks are made
            return
        saved = groups_or_zeros(state, "fedrkmgc", STATE_GROUPS, anchor)
        self.delta, self.raw_prev = saved["delta"], saved["raw_prev"]

    def _own_tensors(self) -> None:
        """This client's ``delta`` and ``raw_prev`` as tensors of its own
        (views of its rows) when they are rows of the cohort's stacks: for
        per-client code (:meth:`step_tensors`, :meth:`end_round`)."""
        stacks, self._rows_of = getattr(self, "_rows_of", None), None
        if stacks is not None:
            self.delta, self.raw_prev = (OrderedDict((n, block[self._row]) for n, block in zip(self.anchor, stacks[g]))
                                         for g in STATE_GROUPS)

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:meth:`begin_at_anchor` of every opening (no model loaded); when
        the fast runner keeps the clients' states stacked, their saved
        ``delta`` and ``raw_prev`` are read in one gather and kept as one
        stack per parameter (a subclass: tensors of each client's own)."""
        if type(self).begin_round is not AnchoredSolver.begin_round:
            return None
        params = OrderedDict(model.named_parameters())
        # (a subclass, whose own hooks may read delta or raw_prev: each client's own tensors)
        stacks = None if any(type(o.solver) is not FedRKMGCSolver for o in openings) else gathered_groups(
            [o.state for o in openings], "fedrkmgc", STATE_GROUPS, params, next(iter(params.values())).device)
        for o in openings:
            o.solver._given_state = stacks
        begun = super().cohort_begin_round(model, openings)
        if stacks is not None:  # the begun clients' rows, in order
            ok = begun_rows(openings, begun)
            for g in STATE_GROUPS:
                stacks[g] = select_rows(stacks[g], ok)
        return begun

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        self._own_tensors()
        return {"delta": list(self.delta.values())}

    def cohort_step_tensors(self, members: list) -> dict[str, list[torch.Tensor]] | None:
        """The members' ``delta`` as rows of :meth:`cohort_begin_round`'s
        stacks, in the trainer's order (None: each member's own)."""
        return member_rows(members, ("delta",))

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g - delta``: the corrected local gradient (Alg. 1 lines 6-8)."""
        return g - tensors["delta"]

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict:
        formed, self._formed = getattr(self, "_formed", None), None
        if formed is not None:  # the cohort trainer's, for the whole batch (cohort_after_steps): one flat row
            self._rows_of = None  # the cohort's stacks are not kept past the round
            state.put_flat("fedrkmgc", *formed)
            return {}
        self._own_tensors()
        beta, gamma = float(self.params.beta), float(self.params.gamma)
        delta, raw_prev = OrderedDict(), OrderedDict()
        for k, p in model.named_parameters():
            raw_prev[k] = raw_correction(self.delta[k], p.detach(), self.anchor[k], beta)
            delta[k] = correction_update(self.correction, self.delta[k], raw_prev[k], self.raw_prev[k],
                                         self.t, gamma)
        state.put("fedrkmgc", flat_groups({"delta": delta, "raw_prev": raw_prev}))
        return {}

    def cohort_after_steps(self, model: torch.nn.Module, members: list, weights: list[torch.Tensor],
                           rows: list[int], layer_inputs=None) -> None:
        """:meth:`end_round`'s corrections (Alg. 1 lines 10-11) for every member
        at once, from the stacked trained weights: elementwise, so the same
        values as one client at a time; ``end_round`` then only stores them."""
        if type(self).end_round is not FedRKMGCSolver.end_round:
            return
        solvers = [m.solver for m in members]
        if any((s.t, s.correction, s.params) != (self.t, self.correction, self.params) for s in solvers):
            return
        beta, gamma = float(self.params.beta), float(self.params.gamma)
        index = torch.tensor(rows, dtype=torch.long, device=weights[0].device)
        saved = member_rows(members, STATE_GROUPS)
        if saved is None:  # each member's own tensors, stacked
            for s in solvers:
                s._own_tensors()
            saved = {g: [torch.stack([getattr(s, g)[name] for s in solvers]) for name, _ in model.named_parameters()]
                     for g in STATE_GROUPS}
        news, raws = [], []
        for (name, _), w, delta, raw_prev in zip(model.named_parameters(), weights, saved["delta"], saved["raw_prev"]):
            anchor = self.shared_or_stacked([s.anchor[name] for s in solvers])
            raw = raw_correction(delta, w.detach().index_select(0, index), anchor, beta)
            news.append(correction_update(self.correction, delta, raw, raw_prev, self.t, gamma))
            raws.append(raw)
        # what put(flat_groups({'delta': ..., 'raw_prev': ...})) stores, as one row per member
        flat = torch.cat([v.reshape(len(solvers), -1) for v in news + raws], dim=1)
        layout = tensor_layout(flat_groups({g: self.anchor for g in STATE_GROUPS}))
        for c, s in enumerate(solvers):
            s._formed = (flat[c], layout)

    def reads_trained_model(self) -> bool:
        """Not once :meth:`cohort_after_steps` formed the corrections."""
        return getattr(self, "_formed", None) is None
