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

from fedaccel.clients.stacked_solver import StackedStateSolver
from fedaccel.clients.stacked_state import member_rows
from fedaccel.clients.state import ClientState, flat_groups, tensor_layout
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


class FedRKMGCSolver(StackedStateSolver):
    """Local SGD on ``g - delta``, then the (fast-)KM correction update. The
    saved ``delta`` and ``raw_prev`` are rows of the cohort's stacks in a
    cohort begun together on the fast runner's stacked store
    (:class:`StackedStateSolver`)."""

    state_copies = 2
    state_name = "fedrkmgc"
    saved_groups = state_attributes = STATE_GROUPS

    def begin_solver(self, train: TrainConfig, anchor: OrderedDict) -> None:
        """Round ``t`` and the variant's correction; the anchor ``theta^t`` is ``self.anchor``."""
        self.t = paper_round_index(train.server_round)
        _, self.correction = variant_components(self.params.variant)

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
        if self.store_formed(state) is not None:  # the cohort trainer's (cohort_after_steps): one flat row
            return {}
        self._own_tensors()
        beta, gamma = float(self.params.beta), float(self.params.gamma)
        delta, raw_prev = OrderedDict(), OrderedDict()
        for k, p in model.named_parameters():
            raw_prev[k] = raw_correction(self.delta[k], p.detach(), self.anchor[k], beta)
            delta[k] = correction_update(self.correction, self.delta[k], raw_prev[k], self.raw_prev[k],
                                         self.t, gamma)
        state.put(self.state_name, flat_groups({"delta": delta, "raw_prev": raw_prev}))
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
        saved = self.members_saved(members, STATE_GROUPS)
        news, raws = [], []
        for (name, _), w, delta, raw_prev in zip(model.named_parameters(), weights, saved["delta"], saved["raw_prev"]):
            anchor = self.shared_or_stacked([s.anchor[name] for s in solvers])
            raw = raw_correction(delta, w.detach().index_select(0, index), anchor, beta)
            news.append(correction_update(self.correction, delta, raw, raw_prev, self.t, gamma))
            raws.append(raw)
        # what put(flat_groups({'delta': ..., 'raw_prev': ...})) stores, as one row per member
        self.hand_formed_rows(solvers, news + raws, tensor_layout(flat_groups({g: self.anchor for g in STATE_GROUPS})))
