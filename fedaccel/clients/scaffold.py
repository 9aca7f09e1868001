"""SCAFFOLD's local solver (Karimireddy et al. 2020, Algorithm 1, option II).

Client ``i`` keeps its control variate ``c_i`` (zero at the start, via
:class:`fedaccel.clients.state.ClientState` under ``scaffold``, keys ``c.<name>``)
and receives the server's ``c`` with the model. Local steps use the corrected
gradient ``g_i(y) + c - c_i``: the correction is added to ``p.grad`` after
``backward()`` and before ``optimizer.step()``, so **it goes through momentum
and weight decay** like the task gradient (:func:`corrected_gradient`).

New control variate (``scaffold.cv-update``):

- ``mean-gradient`` (default): ``c_i+ = (1/K) sum_k (g_i(y_k) + wd * y_k)``,
  the mean of the *uncorrected* stochastic gradients actually evaluated along
  the local trajectory (weight decay included, since it is part of the local
  objective SGD minimises). With plain SGD (no momentum) this equals option II
  exactly: ``y_K = x - lr sum_k (g_k + c - c_i)`` gives
  ``c_i - c + (x - y_K)/(K lr) = (1/K) sum_k g_k``.
- ``option-ii``: the paper's formula ``c_i+ = c_i - c + (x - y_i)/(K lr)``
  (:func:`option_ii_control_variate`). With local momentum ``m`` the model
  moves about ``1/(1-m)`` times further than plain SGD would, so this formula
  overstates the gradient by up to that factor (5x at m = 0.8; measured in
  tests/test_scaffold_feddyn.py). Kept for momentum-free runs and comparison.

Transport: the server's ``c`` arrives as the ArrayRecord ``scaffold.c`` beside
the model (``LocalSolver.received``), and ``c_i+ - c_i`` goes back as the
ArrayRecord ``scaffold.dc``; the framework counts both in bytes_down/bytes_up.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedaccel.arrays import numpy_to_record, to_numpy
from fedaccel.clients.base import LocalSolver
from fedaccel.clients.state import ClientState, flat_groups, groups_or_zeros
from fedaccel.contract import MessageContract, TrainConfig

T = TypeVar("T")

CV_UPDATES = ("mean-gradient", "option-ii")
C_RECORD = "scaffold.c"
DC_RECORD = "scaffold.dc"


def corrected_gradient(g: T, c: T, c_i: T) -> T:
    """``g + c - c_i`` (Algorithm 1, line 10)."""
    return g + c - c_i  # type: ignore[operator]


def option_ii_control_variate(c_i: T, c: T, x: T, y: T, steps: int, lr: float) -> T:
    """``c_i - c + (x - y) / (K lr)`` (Algorithm 1, line 12, option II)."""
    return c_i - c + (x - y) / (steps * lr)  # type: ignore[operator]


def control_variate_record(c: Mapping[str, np.ndarray]) -> ArrayRecord:
    """The server control variate as the ArrayRecord sent beside the model."""
    return numpy_to_record(OrderedDict((k, np.ascontiguousarray(v)) for k, v in c.items()))


def received_control_variate(received: Mapping[str, ArrayRecord], model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``c`` for every parameter of ``model``, from the received ``scaffold.c`` record."""
    record = received[C_RECORD]
    return OrderedDict((k, torch.from_numpy(to_numpy(record[k]).copy()).to(device=p.device, dtype=p.dtype))
                       for k, p in model.named_parameters())


class ScaffoldSolver(LocalSolver):
    """Local SGD on ``g + c - c_i``; ``scaffold.cv-update`` picks the c_i rule."""

    state_copies = 1
    messages = MessageContract(to_client=(C_RECORD,), to_server=(DC_RECORD,))
    accumulators = ("grad_sum",)  # mean-gradient's running sum, per step

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        self.lr = config.lr
        self.wd = float(self.cfg.weight_decay)
        params = OrderedDict(model.named_parameters())
        self.x = OrderedDict((k, p.detach().clone()) for k, p in params.items())
        self.c = received_control_variate(self.received, model)
        self.c_i = groups_or_zeros(state, "scaffold", ("c",), self.x)["c"]
        self.grad_sum = OrderedDict((k, torch.zeros_like(v)) for k, v in self.x.items())
        self.correction = [self.c[k] - self.c_i[k] for k in params]

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"correction": self.correction, "grad_sum": list(self.grad_sum.values())}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + c - c_i`` (:func:`corrected_gradient`); adds the uncorrected
        ``g + wd w`` to the running ``grad_sum`` of ``mean-gradient``."""
        grad_sum = tensors["grad_sum"]
        grad_sum.add_(g)
        if self.wd:
            grad_sum.add_(w, alpha=self.wd)
        return g + tensors["correction"]

    def new_control_variate(self, model: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
        steps = self.local_steps
        if steps == 0:
            return OrderedDict((k, v.clone()) for k, v in self.c_i.items())
        if self.params.cv_update == "option-ii":
            return OrderedDict(
                (k, option_ii_control_variate(self.c_i[k], self.c[k], self.x[k], p.detach(), steps, self.lr))
                for k, p in model.named_parameters())
        return OrderedDict((k, s / steps) for k, s in self.grad_sum.items())

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict[str, ArrayRecord]:
        new = self.new_control_variate(model)
        dc = numpy_to_record(OrderedDict((k, (new[k] - self.c_i[k]).cpu().numpy()) for k in new))
        state.put("scaffold", flat_groups({"c": new}))
        self.correction, self.grad_sum = [], OrderedDict()
        return {DC_RECORD: dc}
