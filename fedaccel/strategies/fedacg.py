"""FedACG (Kim et al., CVPR 2024): lookahead server momentum, Algorithm 1.

Server state: momentum ``m`` (``m^0 = 0``). Round ``t``:

- broadcast ``b = theta^{t-1} + lam * m^{t-1}`` (the lookahead / accelerated
  client gradient; :meth:`FedACGStrategy.broadcast_arrays`);
- clients train from ``b`` with the pull ``beta/2 ||w - b||^2``
  (:class:`fedaccel.clients.fedacg.FedACGSolver`) and reply their weights;
- ``Delta^t = sum_i omega_i (w_i - b)``, ``m^t = lam * m^{t-1} + Delta^t``,
  ``theta^t = theta^{t-1} + m^t``.

With the lookahead on, ``theta^t = b + Delta^t`` is the (weighted) mean of the
clients' models, which is how it is computed (FedAvg's aggregation applied
from ``b``; no round-off from adding and subtracting ``b``).

Table 4's components are switches: ``server-momentum`` (off: ``m`` stays 0 and
``theta^t = theta^{t-1} + Delta^t``, FedAvg's server), ``lookahead`` (off:
``b = theta``) and ``local-regularizer`` (off: ``beta`` = 0). The lookahead
needs the momentum (Table 4 has no lookahead-only row), so
``lookahead = true`` with ``server-momentum = false`` is a config error.

Relation to FedAvgM: with ``lookahead = false`` and ``beta = 0`` the server
trajectory is exactly Flower's FedAvgM with server lr 1 and momentum ``lam``
(its ``v`` is ``-m``); with ``lam = 0`` and ``beta = 0`` it is FedAvg.

``weighting``: ``examples`` (paper: omega_i proportional to |D_i|, the same
weights as Flower's FedAvg and FedAvgM) or ``uniform`` (the authors' code:
unweighted mean over the sampled clients).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.fedacg import FedACGSolver
from fedaccel.config import RunConfig, require
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.server_steps import WEIGHTINGS, mean_of_replies, reply_metrics

@dataclass(frozen=True)
class FedACGParams:
    """``fedacg.*``: ``lam`` (momentum / lookahead), ``beta`` (local pull), the
    three Table 4 switches and the aggregation ``weighting``.

    Defaults from the paper: ``lam`` 0.85 and ``beta`` 0.01 are the best
    values of Table 5a/5b (section 4.3); all three components on and
    example-weighted ``omega_i`` are Algorithm 1 and eq. (1) (section 3).
    """

    lam: float = 0.85
    beta: float = 0.01
    server_momentum: bool = True
    lookahead: bool = True
    local_regularizer: bool = True
    weighting: str = "examples"

    def validate(self, prefix: str) -> None:
        require(0 <= self.lam < 1, f"{prefix}.lam", self.lam, "must be in [0, 1)")
        require(self.beta >= 0, f"{prefix}.beta", self.beta, "must be >= 0 (0 = no local pull)")
        require(self.weighting in WEIGHTINGS, f"{prefix}.weighting", self.weighting,
                f"allowed: {', '.join(WEIGHTINGS)}")
        require(self.server_momentum or not self.lookahead, f"{prefix}.lookahead", self.lookahead,
                f"needs {prefix}.server-momentum = true (the lookahead is theta + lam * m); "
                f"set {prefix}.lookahead = false for the rows without server momentum")


class FedACGStrategy(FedAccelStrategy, FedAvg):
    """Lookahead broadcast and momentum server update (Algorithm 1)."""

    carried_state = ("momentum",)  # checkpointed (fedaccel.checkpoint); theta is the model sent

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        super().__init__(run_cfg=run_cfg, federation=federation)
        self.params = run_cfg.algo_params
        self.theta: dict[str, np.ndarray] | None = None  # theta^{t-1}, the global model
        self.momentum: dict[str, np.ndarray] | None = None  # m^{t-1}

    def broadcast_arrays(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """``b = theta + lam * m`` (Algorithm 1: "Server sends theta^{t-1} + lam m^{t-1}")."""
        self.theta = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
        if self.momentum is None:
            self.momentum = {k: np.zeros_like(v) for k, v in self.theta.items()}
        if not (self.params.lookahead and self.params.server_momentum):
            return arrays
        lam = self.params.lam
        return ArrayRecord({k: Array(np.asarray(v + lam * self.momentum[k]).astype(v.dtype, copy=False))
                            for k, v in self.theta.items()})

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The ``weighting`` mean of the clients' models (``b + Delta^t``)."""
        mean = mean_of_replies(replies, self.params.weighting, self.weighted_by_key)
        return mean, reply_metrics(replies, self.weighted_by_key)

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        """``m^t = lam m^{t-1} + Delta^t``, ``theta^t = theta^{t-1} + m^t`` with
        ``Delta^t = aggregate - b`` (after the update transforms: with global GC
        the momentum only ever holds centralized updates)."""
        if self.theta is None or self.momentum is None:
            raise RuntimeError("FedACG: server_step before broadcast_arrays (no theta^{t-1})")
        p = self.params
        if not p.server_momentum:
            return aggregate  # theta^t = theta^{t-1} + Delta^t, b = theta^{t-1}
        sent = {k: np.asarray(a.numpy()) for k, a in self.global_arrays.items()}
        new: dict[str, Array] = {}
        for k, b in sent.items():
            avg = np.asarray(aggregate[k].numpy())
            delta = avg - b  # Delta^t, measured from the broadcast model
            m_new = p.lam * self.momentum[k] + delta  # m^t = lam m^{t-1} + Delta^t
            self.momentum[k] = m_new
            if p.lookahead:
                new[k] = Array(avg)  # theta^{t-1} + m^t = b + Delta^t = the aggregate
            else:
                new[k] = Array(np.asarray(self.theta[k] + m_new))  # theta^t = theta^{t-1} + m^t
        return ArrayRecord(new)


def build(cfg: RunConfig, federation: Federation) -> FedACGStrategy:
    return FedACGStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedacg", build_strategy=build, solver=FedACGSolver, params=FedACGParams,
    summary="FedACG: lookahead server momentum, local pull to the broadcast model",
)
