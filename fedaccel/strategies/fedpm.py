"""FedPM (federated preconditioned mixing): second-order local steps, preconditioned mixing.

Paper: "FedPM: Federated Learning Using Second-order Optimization with
Preconditioned Mixing of Local Parameters" (Ishii, Niwa, Sawada, Fujino,
Harada, Yokota, 2025, arXiv:2511.09100), eq. (10) (FOOF form: eqs. (11),
(12)). Clients (:class:`fedaccel.clients.fedpm.FedPMSolver`) take FOOF-preconditioned
local steps (or exact Newton steps on logistic regression with
``fedpm.mode='exact'``) and upload their layer preconditioners beside the
weights (upper triangles, counted in bytes_up); the server mixes each layer as
``W = (sum_i n_i W_i M_i)(sum_i n_i M_i)^-1`` with ``M_i = P_i + damping I``
(:mod:`fedaccel.strategies.preconditioned_mixing`). The paper's equations average the N
clients' terms with equal weights; the weights ``n_i / n`` (sample counts of
the replies) make one local step the centralized step of the sample-weighted
objective, which is what the exact mode is tested against. See docs/fedpm.md.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedaccel.clients import foof
from fedaccel.clients.fedpm import PRECOND_KEY, FedPMParams, FedPMSolver, check_exact_mode
from fedaccel.arrays import numpy_to_record, record_to_numpy, to_numpy
from fedaccel.config import RunConfig
from fedaccel.errors import RejectedReplies, RoundFailedError
from fedaccel.algorithm import AlgorithmSpec
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.preconditioned_mixing import preconditioned_mix, preconditioner_layout
from fedaccel.strategies.server_steps import reply_metrics


class FedPMStrategy(FedAccelStrategy, FedAvg):
    """Preconditioned mixing of the replies' layers; weighted mean of the rest."""

    messages = FedPMSolver.messages  # preconditioners up

    def __init__(self, *, run_cfg: RunConfig, federation: Federation) -> None:
        check_exact_mode(run_cfg)
        super().__init__(run_cfg=run_cfg, federation=federation)

    def extra_layouts(self) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """The preconditioners hold one upper triangle per preconditioned layer
        of the sent model, of its size (:func:`preconditioner_layout`): a
        reply with a layer missing or a triangle cut short is rejected alone
        instead of stopping the round's mixing."""
        sent = self.sent_model()
        cached = getattr(self, "_precond_layout_of", None)
        if cached is None or cached[0] is not sent:
            full = self.run_cfg.algo_params.mode == "exact"
            cached = (sent, preconditioner_layout([(k, tuple(a.shape)) for k, a in sent.items()], full))
            self._precond_layout_of = cached
        return {PRECOND_KEY: cached[1]}

    def reply_problem(self, reply: Message) -> str | None:
        """The shared checks, then (FOOF mode) each uploaded matrix's
        diagonal: a FOOF matrix's diagonal holds means of squares, so a
        negative entry is an upload no FOOF pass makes (a faulty or forged
        client). Rejected alone, whatever the other replies hold; a subtler
        indefinite matrix (a nonnegative diagonal) is found only if it makes
        the round's mix fail (:meth:`combine`): telling it from rounding
        needs a factorization per reply, as costly as the mix itself on a
        wide layer."""
        problem = super().reply_problem(reply)
        if problem is not None or self.run_cfg.algo_params.mode != "foof":
            return problem
        for layer, array in reply.content[PRECOND_KEY].items():
            values = to_numpy(array)
            lowest = float(values[foof.diagonal_of_packed(foof.triangle_side(values.size))].min())
            if lowest < 0:
                return (f"its {layer} preconditioner has a negative diagonal entry ({lowest:.3g}): no FOOF "
                        "pass uploads such a matrix (its diagonal holds means of squares)")
        return None

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        clients = []
        for reply in replies:
            content = reply.content
            arrays = record_to_numpy(content["arrays"])
            packed = record_to_numpy(content[PRECOND_KEY])
            n = float(content["metrics"][self.weighted_by_key])
            clients.append((arrays, packed, n))
        damping = float(self.run_cfg.algo_params.damping)
        try:
            mixed = preconditioned_mix(clients, damping)
        except ValueError as err:  # not positive definite: stop with one line, not a traceback
            # a client whose own damped preconditioner has no Cholesky factor
            # (an upload no sound FOOF pass makes: A is a mean of a a^T)
            # is rejected alone, as a NaN reply is, when others are sound
            # (the FOOF mode only: the exact mode's Hessians, uploaded in the model's
            # dtype with damping 0 allowed, can round to indefinite without any fault)
            unsound = ({i: why for i, (_, pre, _) in enumerate(clients)
                        if (why := unsound_preconditioner(pre, damping)) is not None}
                       if self.run_cfg.algo_params.mode == "foof" else {})
            if unsound and len(unsound) < len(clients):
                raise RejectedReplies(unsound) from None
            largest = max(float(np.abs(v).max()) for _, pre, _ in clients for v in pre.values())
            raise RoundFailedError(
                f"round {server_round}: {err} (damping {damping:g}, largest preconditioner entry "
                f"{largest:.3g}). Huge entries mean a client's training diverged: lower lr "
                f"(second-order steps need a smaller one at strong heterogeneity) or raise "
                f"{self.run_cfg.algo}.damping") from None
        new = numpy_to_record(mixed)
        metrics = reply_metrics(replies, self.weighted_by_key)
        return new, metrics


def unsound_preconditioner(packed: dict[str, np.ndarray], damping: float) -> str | None:
    """Why a reply's packed preconditioners cannot be mixed (a layer's
    ``P + damping I`` without a Cholesky factor), or None."""
    for layer, values in packed.items():
        matrix = foof.unpack_upper(torch.from_numpy(np.asarray(values, dtype=np.float64)))
        if int(foof.damped_cholesky_ex(matrix, damping)[1]) != 0:
            return (f"its {layer} preconditioner plus damping {damping:g} is not positive definite "
                    f"(largest entry {float(np.abs(values).max()):.3g}): no FOOF pass uploads such a matrix")
    return None


def build(cfg: RunConfig, federation: Federation) -> FedPMStrategy:
    return FedPMStrategy(run_cfg=cfg, federation=federation)


ALGORITHM = AlgorithmSpec(
    name="fedpm", build_strategy=build, solver=FedPMSolver, params=FedPMParams,
    summary="FedPM: FOOF/Newton local steps, preconditioned mixing (W A)(A)^-1 on the server",
)
