"""FedNova: federated normalized averaging.

Paper: "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization" (Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent
Poor, NeurIPS 2020, arXiv:2007.07481). Equation numbers are the paper's main
text. Authors' code: github.com/JYWa/FedNova, ``distoptim/FedNova.py``.

The objective is ``F(x) = sum_i p_i F_i(x)``, ``p_i = n_i / n`` (eq. (1)).
FedAvg's ``x <- x + sum_i p_i Delta_i`` (eq. (2)) is, by eq. (6), the general
rule (4)

    x <- x - tau_eff sum_i w_i eta d_i,   d_i = G_i a_i / ||a_i||_1 = (x - y_i) / (eta ||a_i||_1),

with ``w_i = p_i ||a_i||_1 / sum_j p_j ||a_j||_1``: a client that took more
local steps weighs more, and Theorem 1 shows the rule optimizes the surrogate
``sum_i w_i F_i`` instead of ``F`` (objective inconsistency; eq. (3) and
Lemma 1: ``w_i ~ tau_i`` for plain SGD). FedNova (Section 5, eq. (11)) sets
``w_i = p_i``:

    d_i      = (x - y_i) / ||a_i||_1                (eta folded in)
    tau_eff  = sum_i p_i ||a_i||_1
    x_new    = x - tau_eff * sum_i p_i d_i

``||a_i||_1`` is the client's normalizing factor (fedaccel/clients/fednova.py: ``tau_i``
for plain SGD, the Section 4.1 momentum formula otherwise), uploaded in the
record ``fednova.a-norm`` beside its weights ``y_i``. ``tau_eff = sum_i p_i
||a_i||_1`` is the value eq. (6) gives FedAvg, which Section 5 ("Flexibility
in Choosing Hyper-parameters") calls the default (FedNova moves as far as
FedAvg would, in the consistent direction); for plain SGD it is eq. (11)'s
``sum_i p_i tau_i``, and with momentum it is what the authors' code uses
(``tau_eff = sum ratio * local_normalizing_vec`` in ``average()``). With equal
``||a_i||_1`` the rule is FedAvg's mean exactly.

Choices the paper leaves to the implementation:

- ``p_i = n_i / sum_{j in S} n_j`` over the replies ``S`` that are aggregated
  (``num-examples``), the weighting of the project's FedAvg (Flower's
  example-weighted mean), so ``sum_i p_i = 1`` every round. The paper states
  the rule for full participation; its footnote 1 (client sampling) instead
  re-scales ``p_i`` to ``p_i m / q`` for ``q`` clients sampled uniformly
  without replacement, an unbiased but unnormalized weighting not used here.
  Lost, rejected and dropped replies are not in ``S``. With
  ``straggler-policy='partial'`` stragglers' replies are in ``S`` with their
  smaller ``||a_i||_1``: the unequal local work FedNova is built for (Section
  1; Theorem 3 allows any ``tau_i(t)`` per round). ``straggler-policy='auto'``
  therefore means ``partial`` for FedNova, as for FedCDR/FedDR (``drop`` stays
  available for comparisons with the baselines);
- no server learning rate and no server momentum: eq. (11) has neither, and
  the authors' code has no server lr (with its global momentum factor
  ``gmf = 0`` it applies ``x - tau_eff sum_i p_i (x - y_i)/||a_i||_1``
  exactly); server momentum is the combination Section 5 ("Combination with
  Acceleration Techniques") and Section 6 (hybrid momentum) describe on top of
  FedNova. So FedNova has no hyperparameters of its own
  (:class:`FedNovaParams` is empty, like FedAvg's, and pyproject.toml has no
  ``fednova`` table);
- the rule runs as :meth:`FedNovaStrategy.combine` (replies -> the normalized
  aggregate), so ``gc.mode`` global/hybrid centralizes FedNova's update
  ``x_new - x`` and the default ``server_step`` keeps it. It is computed in
  float64 and returned in the dtypes that were sent;
- every array of the model record follows the rule (the models in fedaccel/models/
  have no buffers; an array no step changes has ``x - y_i = 0`` and stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fednova import A_NORM_KEY, A_NORM_RECORD, FedNovaSolver
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.arrays import record_to_numpy, to_numpy
from fedaccel.config import RunConfig
from fedaccel.contract import MODEL_RECORD
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import numpy_to_record, reply_metrics


@dataclass(frozen=True)
class FedNovaParams:
    """FedNova has no hyperparameters of its own (the paper's rule has no
    server lr; its code's server momentum ``gmf`` is not part of FedNova)."""


def normalized_average(x: Mapping[str, np.ndarray], ys: Sequence[Mapping[str, np.ndarray]],
                       a_norms: Sequence[float], examples: Sequence[float]) -> dict[str, np.ndarray]:
    """FedNova's server rule (Section 5, eq. (11), ``tau_eff = sum_i p_i ||a_i||_1``),
    in float64: ``x - tau_eff * sum_i p_i (x - y_i) / ||a_i||_1`` with
    ``p_i = n_i / sum_j n_j``."""
    if not ys or len(ys) != len(a_norms) or len(ys) != len(examples):
        raise ValueError(f"FedNova: {len(ys)} models, {len(a_norms)} normalizing factors and "
                         f"{len(examples)} example counts; need the same non-zero number")
    a = np.asarray(a_norms, dtype=np.float64)
    n = np.asarray(examples, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(a > 0)):
        raise ValueError(f"FedNova: every ||a_i||_1 must be finite and > 0 (got {a.tolist()})")
    if not (np.all(np.isfinite(n)) and np.all(n > 0)):
        raise ValueError(f"FedNova: every example count must be > 0 (got {n.tolist()})")
    p = n / n.sum()
    tau_eff = float(np.dot(p, a))
    new = {}
    for key, value in x.items():
        x64 = np.asarray(value, dtype=np.float64)
        direction = np.zeros_like(x64)
        for p_i, a_i, y in zip(p, a, ys):
            direction += (p_i / a_i) * (x64 - np.asarray(y[key], dtype=np.float64))
        new[key] = x64 - tau_eff * direction
    return new


def a_norm_of(reply: Message) -> float:
    """The ``||a_i||_1`` a reply carries (checked by :meth:`FedNovaStrategy.reply_problem`)."""
    return float(to_numpy(reply.content[A_NORM_RECORD][A_NORM_KEY])[0])


class FedNovaStrategy(FedAccelStrategy, FedAvg):
    """Normalized averaging of the replies (eq. (11)); FedAvg's sampling and accounting."""

    messages = FedNovaSolver.messages  # ||a_i||_1 up

    def reply_problem(self, reply: Message) -> str | None:
        """The common checks, then: ``fednova.a-norm`` holds exactly one finite
        value > 0 (a zero would divide the update by zero)."""
        problem = super().reply_problem(reply)
        if problem is not None:
            return problem
        record = reply.content[A_NORM_RECORD]
        if list(record.keys()) != [A_NORM_KEY]:
            return f"{A_NORM_RECORD} holds {sorted(record.keys())}, expected [{A_NORM_KEY!r}]"
        values = to_numpy(record[A_NORM_KEY])
        if values.shape != (1,) or values.dtype.kind != "f":
            return f"{A_NORM_RECORD}/{A_NORM_KEY} has shape {values.shape} and dtype {values.dtype}, " \
                   "expected one float"
        if not float(values[0]) > 0:
            return f"{A_NORM_RECORD}/{A_NORM_KEY}={float(values[0])}, must be > 0"
        return None

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1`` over the replies, ``x``
        the model sent this round (float64, cast back to the sent dtypes)."""
        x = record_to_numpy(self.sent_model())
        ys = [record_to_numpy(r.content[MODEL_RECORD]) for r in replies]
        examples = [float(next(iter(r.content.metric_records.values()))[self.weighted_by_key])
                    for r in replies]
        new = normalized_average(x, ys, [a_norm_of(r) for r in replies], examples)
        return numpy_to_record(new, like=self.sent_model()), reply_metrics(replies, self.weighted_by_key)


def build(cfg: RunConfig, federation: Federation) -> FedNovaStrategy:
    return FedNovaStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fednova", build_strategy=build, solver=FedNovaSolver, params=FedNovaParams,
    summary="FedNova: normalized averaging of updates by each client's local work ||a_i||_1",
    default_straggler_policy="partial",
)
