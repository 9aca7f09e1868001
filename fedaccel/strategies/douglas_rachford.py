"""Server side of the Douglas-Rachford methods (FedCDR, FedDR).

Clients reply with ``g_i = xhat_i' - xhat_i`` instead of weights; the server
adds ``(1/n) sum_{i in S} g_i`` with ``n`` the total number of clients
(FedCDR Algorithm 1, lines 8-9), which keeps the global model equal to the
unweighted mean of all clients' ``xhat_i`` (appendix A, eq. 17) from the
first aggregation on. This module registers no algorithm itself.

Where the public FedDR code (github.com/unc-optimization/FedDR,
``FedDR/flearn/trainers/feddr.py``) differs, and what we do:

- It recomputes the model every round as ``prox_{eta g}`` of the average of
  *all* clients' ``xhat_i`` (untrained clients' included), weighted by the
  clients' sample counts ``N_i / N``; without a regularizer ``g`` the prox is
  the identity. We keep the 1/n weights of FedCDR's Algorithm 1 (and of the
  objective ``f = (1/n) sum_i f_i`` both papers minimize) and update
  incrementally, because the server learns a client's sample count only
  from its replies, and ``N`` needs every client's.
- Its server starts at the model's initialization x0 while every client's
  ``xhat_i`` starts at zero, so its first model ``x0`` is not the mean of the
  ``xhat_i``; it does not need to be, because the next model is recomputed
  from the ``xhat_i``. ``init='zeros'`` does the same: round 1 sends x0, and
  the first aggregation adds the round's ``g_i`` to the mean of the initial
  ``xhat_i`` (zero), not to x0. With ``init='model'`` the initial ``xhat_i``
  are x0, so both bases agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients.douglas_rachford import server_step
from fedaccel.arrays import add_records, numpy_to_record, record_to_numpy
from fedaccel.config import LARGEST_NUMBER, require
from fedaccel.strategies.base import FedAccelStrategy
from fedaccel.strategies.server_steps import reply_metrics

PROX_STARTS = ("server", "local")
# gc.mode global/hybrid is refused for the DR methods (the registry's reason):
DOUGLAS_RACHFORD_GLOBAL_GC = (
    "the server model x must stay the mean of all clients' xhat_i (FedCDR Algorithm 1, lines 8-9), "
    "which the clients update from their own uncentralized steps; centralizing the server's update "
    "breaks x = mean(xhat)")
INITS = ("model", "zeros")


@dataclass(frozen=True)
class DouglasRachfordParams:
    """``eta`` (prox coefficient), ``alpha`` (relaxation), ``prox-start``, ``init``."""

    eta: float = 100.0  # best of {10, 100, 1000} on Synthetic-(1,1) (docs/fedcdr.md)
    alpha: float = 1.0
    prox_start: str = "server"
    init: str = "model"

    def validate(self, prefix: str) -> None:
        # the prox step divides by eta: 1 / eta must fit in a float32 too
        require(self.eta >= 1 / LARGEST_NUMBER, f"{prefix}.eta", self.eta,
                f"must be > 0 and at least {1 / LARGEST_NUMBER:.3g} (the prox step divides by it)")
        # FedCDR appendix A: "alpha in (0, 2] is a relaxation coefficient" (Themelis & Patrinos 2020)
        require(0 < self.alpha <= 2, f"{prefix}.alpha", self.alpha, "must be in (0, 2]")
        require(self.prox_start in PROX_STARTS, f"{prefix}.prox-start", self.prox_start,
                f"allowed: {', '.join(PROX_STARTS)}")
        require(self.init in INITS, f"{prefix}.init", self.init, f"allowed: {', '.join(INITS)}")


class DouglasRachfordStrategy(FedAccelStrategy, FedAvg):
    """``x <- x + (1/n) sum g_i`` over the replies of the round."""

    carried_state = ("aggregated",)  # checkpointed (fedaccel.checkpoint)

    aggregated = False  # set on the instance by the first combine()

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``mean_i xhat_i + (1/n) sum g_i``. The mean of the ``xhat_i`` before
        the round is the model that was sent, except in the first aggregation
        with ``init='zeros'``: the model sent was x0, the ``xhat_i`` are zero."""
        x = record_to_numpy(self.sent_model())
        if not self.aggregated and self.run_cfg.algo_params.init == "zeros":
            x = {k: np.zeros_like(v) for k, v in x.items()}
        self.aggregated = True
        g_sum = {k: np.zeros_like(v) for k, v in x.items()}
        add_records(g_sum, [reply.content["arrays"] for reply in replies])
        n = self.federation.num_clients
        new = numpy_to_record({k: np.asarray(server_step(v, g_sum[k], n)) for k, v in x.items()})
        metrics = reply_metrics(replies, self.weighted_by_key)
        return new, metrics
