"""Reusable server steps (pure functions + one mixin); registers no algorithm.

- :func:`weighted_mean_of_replies` / :func:`mean_of_replies`: the replies'
  example-weighted mean (Flower's ``aggregate_arrayrecords``, bit-identical)
  or unweighted mean (``WEIGHTINGS``), through :func:`fedaccel.arrays.mean_of_records`.
- :func:`plain_mean`: the unweighted mean of the replies' model records
  (FedRKMGC section 3.3 sets every weight to ``1/|C_t|``; SCAFFOLD and FedDyn
  also average uniformly), computed in float64 with NumPy, so it never goes
  through Flower's FedAvg validation (which rejects replies carrying extra
  ArrayRecords such as SCAFFOLD's ``delta c``).
- :func:`relax`: global relaxation, FedRKMGC Algorithm 1 line 15 / eq. in
  section 3.3: ``theta^{t+1} = (1 - rho) theta^t + rho theta_tilde^{t+1}``.
  ``rho = 1`` returns ``theta_tilde`` itself (bit-identical), ``rho > 1``
  over-relaxes, ``rho < 1`` damps.
- :class:`RelaxedAggregation`: a mixin that applies :func:`relax` to whatever
  the strategy's ``combine`` produced, so any algorithm can be relaxed:
  ``class S(RelaxedAggregation, FedAccelStrategy, FedAvg)`` with
  ``self.relaxation_rho`` set.
- :class:`ControlVariateServer`: a mixin with SCAFFOLD's control variate
  ``c`` (sent beside the model, stepped by the replies' ``delta c_i``),
  shared by SCAFFOLD and FedDC (whose gradient state is the same variable).
- :func:`momentum_step`: FedAvgM's server SGD with momentum, in Flower's
  convention and arithmetic (bit-identical to Flower's ``FedAvgM``, tested).
- :func:`adam_step`: FedAdam's server Adam, either Reddi et al.'s Algorithm 2
  (``variant='paper'``) or Flower's bias-corrected rule (``'flower'``,
  bit-identical to Flower's ``FedAdam``, tested).

The server optimizers are written here because Flower's strategies fuse the
mean and the step in one ``aggregate_train``: GC-Fed's projection must act on
the aggregated update before the step updates its state
(:meth:`fedaccel.strategies.base.FedAccelStrategy.server_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies

from fedaccel import arrays as arrays_codec
from fedaccel.arrays import add_records, mean_of_records, record_to_numpy, records_of
from fedaccel.clients.scaffold import C_RECORD, DC_RECORD, control_variate_record

T = TypeVar("T")


def relax(theta: T, theta_tilde: T, rho: float) -> T:
    """``(1 - rho) theta + rho theta_tilde``; ``rho == 1`` returns ``theta_tilde`` unchanged."""
    if rho == 1.0:
        return theta_tilde
    return (1.0 - rho) * theta + rho * theta_tilde  # type: ignore[operator]


def numpy_to_record(arrays: Mapping[str, np.ndarray], like: ArrayRecord | None = None) -> ArrayRecord:
    """An ArrayRecord of ``arrays``, cast to ``like``'s dtypes when given."""
    if like is None:
        return arrays_codec.numpy_to_record(arrays)
    return arrays_codec.numpy_to_record({k: np.asarray(arrays[k]).astype(a.dtype, copy=False)
                                         for k, a in like.items()})


def weighted_mean_of_replies(contents: list[RecordDict], weighted_by_key: str) -> ArrayRecord:
    """Flower's ``aggregate_arrayrecords`` (example-weighted, bit-identical),
    through :func:`fedaccel.arrays.mean_of_records` on zero-copy views."""
    weights = [float(next(iter(records_of(c, MetricRecord).values()))[weighted_by_key]) for c in contents]
    arrays = [{k: a for record in records_of(c, ArrayRecord).values() for k, a in record.items()}
              for c in contents]
    return numpy_to_record(mean_of_records(arrays, weights))


WEIGHTINGS = ("examples", "uniform")  # how mean_of_replies weights the clients


def mean_of_replies(replies: list[Message], weighting: str, weighted_by_key: str) -> ArrayRecord:
    """Mean of the replies' ``arrays``: example-weighted (Flower's
    ``aggregate_arrayrecords``, bit-identical) or unweighted, in reply order
    (:func:`fedaccel.arrays.mean_of_records`)."""
    contents = [m.content for m in replies]
    if weighting == "examples":
        return weighted_mean_of_replies(contents, weighted_by_key)
    return numpy_to_record(mean_of_records([next(iter(records_of(c, ArrayRecord).values())) for c in contents]))


def plain_mean(replies: list[Message], record: str = "arrays") -> dict[str, np.ndarray]:
    """Unweighted float64 mean over replies of ``content[record]``
    (:func:`fedaccel.arrays.mean_of_records`, which refuses an empty list)."""
    return mean_of_records([reply.content[record] for reply in replies], dtype=np.float64)


def reply_metrics(replies: list[Message], weighted_by_key: str) -> MetricRecord:
    """The example-weighted mean of the replies' metrics (as Flower's FedAvg)."""
    return mean_metric_records([r.content for r in replies], weighted_by_key)


# Flower's ``aggregate_metricrecords`` and ``validate_message_reply_consistency``
# (flwr.serverapp.strategy.strategy_utils) read every reply through
# ``RecordDict.metric_records`` / ``array_records``, synced views that rebuild
# and re-check the whole RecordDict on each access (about 20 us a reply each
# time, a tenth of a batched round at 100 clients). The two functions below are
# theirs, step for step, on plain reads of the records (:func:`records_of`):
# the same arithmetic in the same order (bit-identical results), the same
# exception with the same reason (tests/test_reply_aggregation.py compares them).

def mean_metric_records(contents: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Flower's ``aggregate_metricrecords``: the ``weighted_by_key``-weighted
    mean of every metric of the replies (lists element by element), without
    the weighting key itself."""
    metric_records = [list(records_of(c, MetricRecord).values()) for c in contents]
    weights = [records[0][weighted_by_key] for records in metric_records]
    total = sum(weights)
    out: dict[str, Any] = {}
    for records, factor in zip(metric_records, [w / total for w in weights], strict=True):
        for record in records:
            for key, value in record.items():
                if key == weighted_by_key:
                    continue
                if key not in out:
                    out[key] = [v * factor for v in value] if isinstance(value, list) else value * factor
                elif isinstance(value, list):
                    out[key] = [c + v * factor for c, v in zip(out[key], value, strict=True)]
                else:
                    out[key] = out[key] + value * factor
    return arrays_codec.metric_record(out)


def check_reply_consistency(contents: list[RecordDict], weighted_by_key: str, check_arrays: bool = True) -> None:
    """Flower's ``validate_message_reply_consistency``: one ArrayRecord (when
    ``check_arrays``) and one MetricRecord per reply, the same keys in all,
    and a single-valued ``weighted_by_key``; else Flower's
    ``InconsistentMessageReplies`` with Flower's reason."""
    if not contents:
        return
    if check_arrays:
        _one_record_with_same_keys(
            contents, ArrayRecord, "Expected exactly one ArrayRecord in replies. Skipping aggregation.",
            "All ArrayRecords must have the same keys for aggregation. "
            "This condition wasn't met. Skipping aggregation.")
    name, keys = _one_record_with_same_keys(
        contents, MetricRecord, "Expected exactly one MetricRecord in replies, but found more. Skipping aggregation.",
        "All MetricRecords must have the same keys for aggregation. "
        "This condition wasn't met. Skipping aggregation.")
    if weighted_by_key not in keys:
        raise InconsistentMessageReplies(
            reason=f"Missing required key `{weighted_by_key}` in the MetricRecord of "
            "reply messages. Cannot average ArrayRecords and MetricRecords. Skipping "
            "aggregation.")
    if any(isinstance(c[name][weighted_by_key], list) for c in contents):
        raise InconsistentMessageReplies(
            reason=f"Key `{weighted_by_key}` in the MetricRecord of reply messages "
            "must be a single value (int or float), but a list was found. Skipping "
            "aggregation.")


def _one_record_with_same_keys(contents: list[RecordDict], kind: type, not_one: str,
                               keys_differ: str) -> tuple[str, set[str]]:
    """The name and keys of the one record of type ``kind`` in the first
    reply, after checking that every reply has exactly one (else
    ``InconsistentMessageReplies(not_one)``) and that every reply's record of
    that name has the same keys (else ``keys_differ``)."""
    if any(len(records_of(c, kind)) != 1 for c in contents):
        raise InconsistentMessageReplies(reason=not_one)
    name = next(iter(records_of(contents[0], kind)))
    keys = set(contents[0][name].keys())
    if any(set(c[name].keys() if name in c else {}) != keys for c in contents[1:]):
        raise InconsistentMessageReplies(reason=keys_differ)
    return name, keys


class RelaxedAggregation:
    """Mixin: ``theta <- (1 - rho) theta_sent + rho aggregate``.

    Place it before :class:`fedaccel.strategies.base.FedAccelStrategy` in the MRO and
    set ``self.relaxation_rho``. ``self.global_arrays`` (the model sent this
    round) is the ``theta^t`` of the relaxation; ``aggregate`` is the mean
    after the update transforms (global GC), so relaxation scales the
    centralized update.
    """

    relaxation_rho: float = 1.0

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        aggregate = super().server_step(server_round, aggregate)  # type: ignore[misc]
        rho = float(self.relaxation_rho)
        if rho == 1.0:
            return aggregate
        sent: Any = getattr(self, "global_arrays", None)
        if sent is None:
            raise RuntimeError("RelaxedAggregation needs global_arrays (the model sent this round)")
        theta, tilde = record_to_numpy(sent), record_to_numpy(aggregate)
        new = {k: relax(theta[k].astype(np.float64), tilde[k].astype(np.float64), rho) for k in tilde}
        return numpy_to_record(new, like=aggregate)


def control_step(c: T, dc_sum: T, num_clients: int) -> T:
    """``c + (|S|/N) mean(dc) = c + sum(dc) / N`` (SCAFFOLD, Algorithm 1, line 17)."""
    return c + dc_sum / num_clients  # type: ignore[operator]


class ControlVariateServer:
    """Mixin: the server control variate ``c`` of SCAFFOLD (Karimireddy et
    al. 2020, Algorithm 1) and FedDC: zero at the start, sent to every client
    as the ArrayRecord ``scaffold.c``, and stepped by the ``delta c_i`` the
    replies carry as ``scaffold.dc`` (:meth:`step_control_variate`). The
    strategy sets ``self.c = None`` in its ``__init__`` and lists ``"c"`` in
    its ``carried_state``."""

    c: dict[str, np.ndarray] | None

    def broadcast_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """The server control variate ``c`` (zero at the start), sent to every client."""
        if self.c is None:
            self.c = {k: np.zeros_like(v) for k, v in record_to_numpy(self.sent_model()).items()}  # type: ignore[attr-defined]
        return {C_RECORD: control_variate_record(self.c)}

    def extra_layouts(self) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """``dc`` holds exactly ``c``'s entries and shapes (the model's): one
        of another shape would be broadcast into ``c``, a missing one counted
        as zero, and the client would commit a ``c_i`` the server never summed."""
        return {DC_RECORD: [(k, tuple(v.shape)) for k, v in self.c.items()]} if self.c is not None else {}

    def step_control_variate(self, replies: list[Message]) -> None:
        """``c <- c + sum_{i in S} delta c_i / N`` (float64 sums, ``c`` kept in its dtype)."""
        if self.c is None:
            raise RuntimeError(f"{type(self).__name__}: combine before the control variate c was sent")
        dc_sum = {k: np.zeros_like(v, dtype=np.float64) for k, v in self.c.items()}
        add_records(dc_sum, [reply.content[DC_RECORD] for reply in replies])  # in reply order, float64
        n = self.federation.num_clients  # type: ignore[attr-defined]
        self.c = {k: control_step(v.astype(np.float64), dc_sum[k], n).astype(v.dtype) for k, v in self.c.items()}


def momentum_step(x: dict[str, np.ndarray], aggregate: dict[str, np.ndarray],
                  velocity: dict[str, np.ndarray] | None, lr: float,
                  momentum: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data
    Distribution for Federated Visual Classification", arXiv:1909.06335):
    ``d = x - aggregate`` (pseudo-gradient), ``v = momentum v + d`` (``v = d``
    the first round, which is the same as starting from ``v = 0``),
    ``x <- x - lr v``; with ``momentum = 0`` no velocity is kept.

    Returns ``(new x, new v)``. Same operations and dtypes as Flower's
    ``FedAvgM.aggregate_train``, so the result is bit-identical to it.
    """
    if momentum == 0.0 and lr == 1.0:
        return dict(aggregate), velocity  # Flower's FedAvgM returns the mean itself here
    d = {k: x[k] - aggregate[k] for k in x}
    if momentum > 0.0:
        velocity = d if velocity is None else {k: momentum * velocity[k] + d[k] for k in d}
        d = velocity
    return {k: x[k] - lr * d[k] for k in x}, velocity


ADAM_VARIANTS = ("paper", "flower")


@dataclass
class AdamState:
    """FedAdam's server moments ``m`` and ``v`` (created on the first step)."""

    m: dict[str, np.ndarray] | None = None
    v: dict[str, np.ndarray] | None = None


def adam_step(x: dict[str, np.ndarray], aggregate: dict[str, np.ndarray], state: AdamState,
              server_round: int, lr: float, beta1: float, beta2: float, tau: float,
              variant: str) -> dict[str, np.ndarray]:
    """One FedAdam server step from ``x`` with ``Delta = aggregate - x``; updates ``state``.

    ``variant='paper'``: Reddi et al. 2021 ("Adaptive Federated Optimization",
    arXiv:2003.00295), Algorithm 2 with the Adam line::

        m = beta1 m + (1 - beta1) Delta            (m_{-1} = 0)
        v = beta2 v + (1 - beta2) Delta^2          (v_{-1} = tau^2)
        x <- x + lr m / (sqrt(v) + tau)

    no bias correction; ``v_{-1} = tau^2`` is the smallest value the algorithm's
    input ``v_{-1} >= tau^2`` allows. Computed in float64.

    ``variant='flower'``: Flower's ``FedAdam`` (``m``, ``v`` from zero, then the
    step size ``lr sqrt(1 - beta2^(r+1)) / (1 - beta1^(r+1))`` with ``r`` the
    1-based round number), with Flower's dtypes, so bit-identical to it. Its
    first step is 0.74x Algorithm 2's at the default betas (``|Delta| >> tau``).
    """
    if variant not in ADAM_VARIANTS:
        raise ValueError(f"unknown FedAdam variant {variant!r}; allowed: {', '.join(ADAM_VARIANTS)}")
    if variant == "paper":
        x64 = {k: np.asarray(v, dtype=np.float64) for k, v in x.items()}
        delta = {k: np.asarray(aggregate[k], dtype=np.float64) - x64[k] for k in x64}
        if state.m is None or state.v is None:
            state.m = {k: np.zeros_like(v) for k, v in delta.items()}
            state.v = {k: np.full_like(v, tau * tau) for k, v in delta.items()}
        state.m = {k: beta1 * state.m[k] + (1.0 - beta1) * delta[k] for k in delta}
        state.v = {k: beta2 * state.v[k] + (1.0 - beta2) * delta[k] ** 2 for k in delta}
        return {k: x64[k] + lr * state.m[k] / (np.sqrt(state.v[k]) + tau) for k in x64}
    # Flower's FedOpt._compute_deltat_and_mt and FedAdam.aggregate_train, in order
    delta = {k: aggregate[k] - x[k] for k in x}
    if not state.m:
        state.m = {k: np.zeros_like(v) for k, v in aggregate.items()}
    state.m = {k: beta1 * v + (1 - beta1) * delta[k] for k, v in state.m.items()}
    if not state.v:
        state.v = {k: np.zeros_like(v) for k, v in aggregate.items()}
    state.v = {k: beta2 * v + (1 - beta2) * (delta[k] ** 2) for k, v in state.v.items()}
    eta_norm = lr * np.sqrt(1 - np.power(beta2, server_round + 1.0)) / (1 - np.power(beta1, server_round + 1.0))
    return {k: v + eta_norm * state.m[k] / (np.sqrt(state.v[k]) + tau) for k, v in x.items()}
