"""Reusable server steps (pure functions + one mixin); registers no algorithm.

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
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedaccel import arrays as arrays_codec
from fedaccel.arrays import record_to_numpy, to_numpy

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


def plain_mean(replies: list[Message], record: str = "arrays") -> dict[str, np.ndarray]:
    """Unweighted float64 mean over replies of ``content[record]``."""
    if not replies:
        raise ValueError("plain_mean needs at least one reply")
    total: dict[str, np.ndarray] = {}
    for reply in replies:
        for k, a in reply.content[record].items():
            v = np.asarray(to_numpy(a), dtype=np.float64)
            total[k] = total[k] + v if k in total else v.copy()
    return {k: v / len(replies) for k, v in total.items()}


def reply_metrics(replies: list[Message], weighted_by_key: str) -> MetricRecord:
    """The example-weighted mean of the replies' metrics (as Flower's FedAvg)."""
    return aggregate_metricrecords([r.content for r in replies], weighted_by_key)


class RelaxedAggregation:
    """Mixin: ``theta <- (1 - rho) theta_sent + rho combine(...)``.

    Place it before :class:`strategies.base.FedAccelStrategy` in the MRO and
    set ``self.relaxation_rho``. ``self.global_arrays`` (the model sent this
    round) is the ``theta^t`` of the relaxation.
    """

    relaxation_rho: float = 1.0

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().combine(server_round, replies)  # type: ignore[misc]
        rho = float(self.relaxation_rho)
        if arrays is None or rho == 1.0:
            return arrays, metrics
        sent: Any = getattr(self, "global_arrays", None)
        if sent is None:
            raise RuntimeError("RelaxedAggregation needs global_arrays (the model sent this round)")
        theta, tilde = record_to_numpy(sent), record_to_numpy(arrays)
        new = {k: relax(theta[k].astype(np.float64), tilde[k].astype(np.float64), rho) for k in tilde}
        return numpy_to_record(new, like=arrays), metrics
