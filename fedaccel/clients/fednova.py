"""FedNova's local solver: FedAvg's SGD, plus the normalizing factor ``||a_i||_1``.

Paper: "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization" (Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent
Poor, NeurIPS 2020, arXiv:2007.07481). Equation numbers are the paper's main
text. Authors' code: github.com/JYWa/FedNova, ``distoptim/FedNova.py``.

Client ``i`` runs the shared loop unchanged (:class:`fedaccel.clients.base.LocalSolver`:
``local-epochs`` passes of mini-batch SGD with the run's momentum and weight
decay, from the received global model ``x``), so ``tau_i`` = epochs x number of
mini-batches of its split (a straggler runs fewer epochs, hence fewer steps).
Section 4.1 writes any such solver's cumulative change as

    Delta_i = y_i - x = -eta G_i a_i,                              (Section 4.1, item 1)

``G_i`` the ``tau_i`` stochastic gradients of the round (columns) and
``a_i >= 0`` the weight each one gets in the displacement; the server of eq.
(4)/(11) divides ``x - y_i`` by ``||a_i||_1``. This solver takes ``tau_i`` from the
trainer's step count (the per-client loop's or the cohort trainer's
``local-steps``) and uploads ``||a_i||_1``:

- plain SGD (``momentum = 0``): ``a_i = [1, ..., 1]``, ``||a_i||_1 = tau_i``
  (Section 4.1, "Vanilla SGD as Local Solver");
- momentum SGD with the buffer reset every round (the optimizer is fresh each
  round, as in the paper's "Momentum SGD as Local Solver" and the authors'
  code, which zeroes the buffer in ``average()``), torch's rule
  ``v_k = rho v_{k-1} + g_k`` (``v_0 = g_0``), ``w_{k+1} = w_k - eta v_k``:
  the gradient ``g_j`` of step ``j`` (0-based) enters every later step with
  weight ``rho^(k - j)``, so

      x - y_i = eta sum_j g_j sum_{k=j}^{tau-1} rho^(k-j) = eta sum_j g_j (1 - rho^(tau-j)) / (1 - rho),

  i.e. ``a_i = [1 - rho^tau, 1 - rho^(tau-1), ..., 1 - rho] / (1 - rho)`` and

      ||a_i||_1 = sum_{k=1}^{tau} (1 - rho^k) / (1 - rho) = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho),

  the paper's Section 4.1 "Momentum SGD as Local Solver" exactly, and the
  authors' code's ``local_normalizing_vec`` (the sum over steps of
  ``local_counter = rho * local_counter + 1``). ``rho = 0`` gives ``tau``.

Weight decay ``wd`` is part of the local gradient (``g_k + wd w_k``, what
torch's SGD steps with, as in the authors' code), so it changes ``G_i``, not
``a_i``; so do the gradient transforms of :mod:`fedaccel.clients.composition` (local
GC) and ``clip-norm``, which rescale or project each step's gradient but do
not change how the steps are accumulated.

Transport: the weights ``y_i`` go in ``arrays`` as for every algorithm;
``||a_i||_1`` goes in the extra ArrayRecord :data:`A_NORM_RECORD` (one float64
under :data:`A_NORM_KEY`, counted in bytes_up), declared in
:attr:`FedNovaSolver.messages`.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedaccel.clients.base import LocalSolver
from fedaccel.clients.state import ClientState
from fedaccel.contract import MessageContract

A_NORM_RECORD = "fednova.a-norm"  # the reply's extra record: ||a_i||_1
A_NORM_KEY = "a-norm"  # its one array, shape (1,), float64


def normalizing_factor(steps: int, momentum: float) -> float:
    """``||a_i||_1`` after ``steps`` local steps of SGD with momentum ``rho``
    (buffer from zero): ``tau`` for ``rho = 0``, else
    ``[tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho)`` (Section 4.1)."""
    if steps < 0:
        raise ValueError(f"FedNova: a step count cannot be negative (got {steps})")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"FedNova: momentum must be in [0, 1) (got {momentum})")
    if momentum == 0.0:
        return float(steps)
    rho = float(momentum)
    return (steps - rho * (1.0 - rho ** steps) / (1.0 - rho)) / (1.0 - rho)


def a_norm_record(value: float) -> ArrayRecord:
    """``||a_i||_1`` as the reply's :data:`A_NORM_RECORD` (one float64)."""
    return ArrayRecord(OrderedDict([(A_NORM_KEY, Array(np.array([value], dtype=np.float64)))]))


class FedNovaSolver(LocalSolver):
    """FedAvg's local SGD; uploads ``||a_i||_1`` from the round's step count
    (``local-steps`` as the trainer reports it, :attr:`LocalSolver.local_steps`)."""

    messages = MessageContract(to_server=(A_NORM_RECORD,))

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict[str, ArrayRecord]:
        if self.local_steps == 0:
            raise RuntimeError("FedNova: this client took no local step this round (empty training "
                               "split?), so ||a||_1 = 0 and its update cannot be normalized")
        return {A_NORM_RECORD: a_norm_record(normalizing_factor(self.local_steps, float(self.cfg.momentum)))}
