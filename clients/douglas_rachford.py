"""Douglas-Rachford local solver shared by FedCDR and FedDR.

FedCDR paper (fedcdr-client-reshuffling-dr.txt), Algorithm 1, line 7: a
selected client ``i`` receiving the server model ``x`` does

    y_i    <- y_i + alpha (x - x_i)              (relax)
    x_i    ~= prox_{eta f_i}(y_i)                 (inexact prox, SGD)
    xhat'  =  2 x_i - y_i                         (reflect)
    g_i    =  xhat' - xhat_i ;  xhat_i <- xhat'   (sent to the server)

and the server (line 8-9) does ``x <- x + (1/n) sum_{i in S} g_i`` with ``n``
the total number of clients, which keeps ``x`` equal to the mean of all
clients' ``xhat_i``. The prox is solved inexactly by ``local-epochs`` of SGD
on ``f_i(z) + 1/(2 eta) ||z - y_i||^2``; the proximal gradient
``(z - y_i) / eta`` is added to ``p.grad`` before the optimizer step, so it
goes through momentum and weight decay like the task gradient.

The paper does not say where the inexact prox solver starts. ``prox-start``
chooses: ``local`` warm-starts from the client's previous ``x_i`` (as the
FedDR public code does; the first time that is the received model), and
``server`` starts from the received model ``x``. The implementation notes
measured ``local`` at ~16% and ``server`` at ~60% accuracy on
Synthetic-(1,1) after 150 rounds, so ``server`` is the default; see
docs/fedcdr.md for our own measurements.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, TypeVar

import torch
from flwr.app import ArrayRecord

from clients.base import LocalSolver
from clients.state import ClientState
from fedaccel.arrays import tensors_to_record

T = TypeVar("T")


def relax(y: T, x_server: T, x_local: T, alpha: float) -> T:
    """``y + alpha (x - x_i)`` (Algorithm 1, line 7, first update)."""
    return y + alpha * (x_server - x_local)  # type: ignore[operator]


def reflect(x_local: T, y: T) -> T:
    """``xhat = 2 x_i - y`` (Algorithm 1, line 7, third update)."""
    return 2 * x_local - y  # type: ignore[operator]


def server_step(x: T, g_sum: T, num_clients: int) -> T:
    """``x + (1/n) sum_{i in S} g_i`` with ``n`` all clients (Algorithm 1, lines 8-9)."""
    return x + g_sum / num_clients  # type: ignore[operator]


def initial_point(initial_model: OrderedDict[str, torch.Tensor] | None,
                  received: OrderedDict[str, torch.Tensor], init: str) -> OrderedDict[str, torch.Tensor]:
    """Where a client's y, x_i and xhat start: x0 for every client.

    Algorithm 1 (line 2, appendix A) starts *all* clients at the initial model
    x0, and the server step ``x += (1/n) sum g_i`` keeps ``x = mean_i xhat_i``
    only if every client's ``xhat_i`` really was x0 until it first trains. A
    client first selected in a later round therefore initialises from x0
    (rebuilt from the seed), not from the model it receives then. With
    ``init='zeros'`` (FedDR's public code) the start, and the server's initial
    model, are zero.
    """
    if init == "zeros":
        return OrderedDict((k, torch.zeros_like(v)) for k, v in received.items())
    if initial_model is None:
        raise RuntimeError("the ClientApp must set solver.initial_model (x0) before training")
    return OrderedDict((k, initial_model[k].to(received[k].device)) for k in received)


class DouglasRachfordSolver(LocalSolver):
    """Inexact-prox DR client; params ``eta``, ``alpha``, ``prox_start``, ``init``.

    State per client (``dr``): ``y``, ``x`` (= x_i) and ``xhat``, one tensor each
    per model entry, created the first time the client is selected at the
    run's initial point (:func:`initial_point`).
    """

    state_copies = 3

    def begin_round(self, model: torch.nn.Module, config: dict[str, Any], state: ClientState) -> None:
        device = next(model.parameters()).device
        # the model's own tensors, read before training starts: relax() makes new ones
        received = OrderedDict((k, v.detach()) for k, v in model.state_dict().items())
        saved = state.get("dr", device)
        if saved is None:
            start = initial_point(self.initial_model, received, self.params.init)
            y = OrderedDict((k, v.clone()) for k, v in start.items())
            x_local = OrderedDict((k, v.clone()) for k, v in start.items())
            xhat = OrderedDict((k, v.clone()) for k, v in start.items())
        else:
            y = OrderedDict((k, saved[f"y.{k}"]) for k in received)
            x_local = OrderedDict((k, saved[f"x.{k}"]) for k in received)
            xhat = OrderedDict((k, saved[f"xhat.{k}"]) for k in received)
        alpha = float(self.params.alpha)
        self.y = OrderedDict((k, relax(y[k], received[k], x_local[k], alpha)) for k in received)
        self.xhat = xhat
        self.inv_eta = 1.0 / float(self.params.eta)
        if self.params.prox_start == "local":
            model.load_state_dict(x_local)
        names = dict(model.named_parameters())
        self._pairs = [(p, self.y[name]) for name, p in names.items()]

    def transform_gradients(self, model: torch.nn.Module) -> None:
        for p, y in self._pairs:
            p.grad.add_(p.detach() - y, alpha=self.inv_eta)

    def upload(self, model: torch.nn.Module, state: ClientState) -> ArrayRecord:
        x_new = OrderedDict((k, v.detach()) for k, v in model.state_dict().items())  # put() copies
        xhat_new = OrderedDict((k, reflect(x_new[k], self.y[k])) for k in x_new)
        g = OrderedDict((k, (xhat_new[k] - self.xhat[k]).cpu()) for k in x_new)
        saved = {}
        for k in x_new:
            saved[f"y.{k}"], saved[f"x.{k}"], saved[f"xhat.{k}"] = self.y[k], x_new[k], xhat_new[k]
        state.put("dr", saved)
        self._pairs = []
        return tensors_to_record(g)
