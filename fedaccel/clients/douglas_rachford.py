"""Douglas-Rachford local solver shared by FedCDR and FedDR.

FedCDR ("Mitigating Data Heterogeneity Effect in Client-Reshuffling-Based
Federated Learning", anonymous, under double-blind review), Algorithm 1,
line 7: a selected client ``i`` receiving the server model ``x`` does

    y_i    <- y_i + alpha (x - x_i)              (relax)
    x_i    ~= prox_{eta f_i}(y_i)                 (inexact prox, SGD)
    xhat'  =  2 x_i - y_i                         (reflect)
    g_i    =  xhat' - xhat_i ;  xhat_i <- xhat'   (sent to the server)

and the server (lines 8-9) does ``x <- x + (1/n) sum_{i in S} g_i`` with
``n`` the total number of clients; appendix A derives this from
``x = (1/n) sum_i xhat_i`` (eq. 17), which it keeps as long as it held
before the round. FedDR (Tran-Dinh, Pham, Phan, Nguyen, NeurIPS 2021,
arXiv:2103.03452) has the same client rule.

The prox is solved inexactly by ``local-epochs`` of SGD on
``f_i(z) + 1/(2 eta) ||z - y_i||^2`` (section 6.1 and appendix G.2: SGD,
10 epochs, momentum 0.9, weight decay 5e-4). The proximal gradient
``(z - y_i) / eta`` is added to ``p.grad`` before the optimizer step, so the
momentum buffer accumulates it together with the task gradient and the
weight-decay term ``weight-decay * z`` that SGD adds to the gradient.

``prox-start`` says where the SGD prox solver starts. ``server`` (the
default) starts from the received model ``x``, which is what FedCDR's
appendix K (notation) describes: clients "perform several local
proximal-gradient iterations starting from x_r^t". ``local`` warm-starts
from the client's previous ``x_i`` (x0 before its first training), as the
public FedDR code does (``Client_DR.set_params`` loads a received model
into the client's model only on its first call, the round-0 evaluation
with x0, so every later prox solve continues from the client's own x_i). On Synthetic-(1,1) ``local`` stays at the
majority class (12-14 % at eta 10/100/1000) while ``server`` reaches 70-74 %
(docs/fedcdr.md, sweep at 100 rounds).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedaccel.clients.base import LocalSolver
from fedaccel.clients.stacked_state import gathered_rows
from fedaccel.clients.state import ClientState, Layout, split_plan, flat_size, tensor_layout, unflatten
from fedaccel.config import ConfigError
from fedaccel.contract import TrainConfig
from fedaccel.arrays import StackedRows, arrays_to_record, deferred_row, tensors_to_record

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


def initial_state(initial_model: Mapping[str, torch.Tensor] | None, keys: list[str], device: torch.device,
                  init: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y_i, x_i, xhat_i)`` of a client that has not trained yet, as flat
    vectors of the model's state tensors ``keys`` in order (new tensors).

    ``init='model'``: all three are x0, the run's initial model (rebuilt from
    the seed by the ClientApp), also for a client first selected in a later
    round, whatever model it receives then. This is FedCDR's main text
    ("we initialize both the server and clients at the same point x^0") and
    the initial state its proofs use (``x_{i,0}^0 = x_0^0 = x^0``, appendix B
    eq. 63 and appendix C eq. 103). Appendix A's initialization instead sets
    ``y_{i,0} = x^0``, ``x_{i,0} = prox_{eta f_i}(y_{i,0})``,
    ``xhat_{i,0} = 2 x_{i,0} - y_{i,0}``: that costs one prox solve on every
    client before round 1, and with the server at ``x_0^0 = x^0`` it breaks
    the ``x = mean_i xhat_i`` its own derivation of the server step needs
    (unless ``prox_{eta f_i}(x^0) = x^0`` for all i). We do not follow it.
    With ``x_i = y_i = x0`` the reflection gives ``xhat_i = 2 x0 - x0 = x0``,
    so the server's x0 is the mean of all initial ``xhat_i``.

    ``init='zeros'``: the public FedDR code (``Client_DR.__init__`` in
    ``FedDR/flearn/models/client_dr.py``): ``y_i = xhat_i = 0`` while ``x_i``,
    the client's model, starts at x0 (every model there is built with the same
    seed and is loaded with the server's initial model before round 1). The
    server's model stays x0, as in the FedDR code; only its first aggregation
    starts from the mean of the initial ``xhat_i``, zero
    (:meth:`fedaccel.strategies.douglas_rachford.DouglasRachfordStrategy.combine`).
    """
    if initial_model is None:
        raise RuntimeError("the ClientApp must set solver.initial_model (x0) before training")
    x0 = torch.cat([initial_model[k].to(device).reshape(-1) for k in keys])  # a new tensor
    if init == "zeros":
        return torch.zeros_like(x0), x0, torch.zeros_like(x0)
    return x0, x0.clone(), x0.clone()


@lru_cache(maxsize=64)
def stored_layout(layout: Layout) -> Layout:
    """The layout of the saved state ``y, x, xhat`` of a model of ``layout``:
    ``y.<key>`` for every key, then ``x.<key>``, then ``xhat.<key>`` (what
    ``state.put('dr', flat_groups(...))`` stored before the state was kept
    flat, so either code reads the other's state)."""
    return tuple((f"{group}.{k}", dtype, shape) for group in ("y", "x", "xhat") for k, dtype, shape in layout)


def _stacked_rows(members: list, which: int) -> torch.Tensor:
    """The members' ``y_i`` (``which=0``) or ``xhat_i`` (1) stacked ``[C, D]``:
    rows of the stacks :meth:`DouglasRachfordSolver.cohort_begin_round` made,
    when every member's are (the same values, without stacking them again)."""
    at = [getattr(m.solver, "_stacked_at", None) for m in members]
    if at[0] is not None and all(a is not None and a[which] is at[0][which] for a in at):
        stack, rows = at[0][which], [a[2] for a in at]
        if rows == list(range(len(stack))):
            return stack
        return stack.index_select(0, torch.tensor(rows, device=stack.device))
    return torch.stack([m.solver._xhat_flat if which else m.solver._y_flat for m in members])


class DouglasRachfordSolver(LocalSolver):
    """Inexact-prox DR client; params ``eta``, ``alpha``, ``prox_start``, ``init``.

    State per client (``dr``): ``y``, ``x`` (= x_i) and ``xhat``, one tensor each
    per model entry, created the first time the client is selected
    (:func:`initial_state`). The arithmetic runs on flat vectors of the
    model's state (one dtype) and the state is read and written as the one
    flat Array it is stored as (:meth:`~fedaccel.clients.state.ClientState.get_flat`):
    bit for bit the per-tensor arithmetic and record, without its per-tensor
    calls (about 140 us a client on the 60-32-10 MLP).
    """

    state_copies = 3

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        device = next(model.parameters()).device
        entries = model.state_dict()
        layout = tensor_layout(entries)
        dtypes = {dtype for _, dtype, _ in layout}
        if len(dtypes) > 1:
            raise ConfigError(f"{self.cfg.algo}: the model's state mixes dtypes ({sorted(dtypes)}); "
                              "Douglas-Rachford keeps y, x and xhat as flat vectors of one dtype")
        self._layout, size = layout, flat_size(layout)
        # the model's own tensors, read before training starts (a copy)
        received = torch.cat([v.detach().reshape(-1) for v in entries.values()])
        saved = state.get_flat("dr", stored_layout(layout), device)
        if saved is None:
            y, x_local, xhat = initial_state(self.initial_model, list(entries), device, self.params.init)
        else:
            y, x_local, xhat = saved[:size], saved[size:2 * size], saved[2 * size:]
        self._formed = None  # the upload the cohort trainer forms (cohort_after_steps)
        self._stacked_at = None  # (y, xhat, row) of cohort_begin_round's stacks
        self._y_flat = relax(y, received, x_local, float(self.params.alpha))
        self._xhat_flat = xhat
        self.inv_eta = 1.0 / float(self.params.eta)
        if self.params.prox_start == "local":
            model.load_state_dict(unflatten(x_local, layout))
        y = self.y  # views made once
        self._anchors = [y[name] for name, _ in model.named_parameters()]

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:meth:`begin_round` of every opening at once: each client's saved
        ``[y_i | x_i | xhat_i]`` read as before, the relax for all of them as
        one elementwise operation on the stacked ``[C, D]`` vectors (the same
        bits as client by client), no model loaded. Each client starts from
        the received model (``prox-start='server'``) or its own ``x_i``
        (``'local'``). Only for a model whose state is its parameters, of one
        dtype (else None: :meth:`begin_round` client by client, which reports
        a mixed-dtype model)."""
        if type(self).begin_round is not DouglasRachfordSolver.begin_round:
            return None
        entries = model.state_dict()
        layout = tensor_layout(entries)
        if ([k for k, _, _ in layout] != [name for name, _ in model.named_parameters()]
                or len({dtype for _, dtype, _ in layout}) > 1
                or any((o.solver.params.alpha, o.solver.params.init) != (self.params.alpha, self.params.init)
                       for o in openings)):
            return None
        device, size, stored = next(model.parameters()).device, flat_size(layout), stored_layout(layout)
        initial: dict[int, tuple] = {}  # (y, x, xhat) of a client without saved state, per x0
        begun: list = [None] * len(openings)
        rows, y_rows, x_rows, xhat_rows = [], [], [], []
        found = gathered_rows([o.state for o in openings], "dr", stored, device)  # fast runner: one read
        if found is not None and all(found[1]):  # every client's saved state: views of the one gathered stack
            return self._begin_gathered(openings, found[0], layout, size)
        gathered = None if found is None else [row if has else None for row, has in zip(found[0], found[1])]
        for k, o in enumerate(openings):
            try:
                saved = o.state.get_flat("dr", stored, device) if gathered is None else gathered[k]
                if saved is None:
                    x0 = o.solver.initial_model
                    if id(x0) not in initial:
                        initial[id(x0)] = initial_state(x0, list(entries), device, self.params.init)
                    y, x_local, xhat = initial[id(x0)]
                else:
                    y, x_local, xhat = saved[:size], saved[size:2 * size], saved[2 * size:]
            except Exception as err:  # noqa: BLE001 - returned as that client's own error
                begun[k] = err
                continue
            rows.append(k)
            y_rows.append(y), x_rows.append(x_local), xhat_rows.append(xhat)
        if not rows:
            return begun
        return self._begun(openings, rows, begun, layout, torch.stack(y_rows), torch.stack(x_rows),
                           torch.stack(xhat_rows))

    def _begin_gathered(self, openings: list, saved: torch.Tensor, layout: Layout, size: int) -> list:
        """:meth:`cohort_begin_round` when every opening's saved state is a row
        of ``saved`` (``[C, 3 D]``: ``y_i | x_i | xhat_i``): its column blocks
        are the stacks, copied as blocks, not stacked again row by row. The
        blocks kept through the round (``xhat_i``; ``x_i``, the clients'
        starts, with ``prox-start='local'``) are copies of their own, so that
        the gathered stack is freed after the relax (else its views would
        hold all of it, twice the state the round needs)."""
        x_local_all = saved[:, size:2 * size]
        if any(o.solver.params.prox_start == "local" for o in openings):
            x_local_all = x_local_all.clone()
        return self._begun(openings, list(range(len(openings))), [None] * len(openings), layout,
                           saved[:, :size], x_local_all, saved[:, 2 * size:].clone())

    def _begun(self, openings: list, rows: list[int], begun: list, layout: Layout, y_saved: torch.Tensor,
               x_local_all: torch.Tensor, xhat_all: torch.Tensor) -> list:
        """The relax for the begun ``rows`` of ``openings`` at once (their
        saved ``y_i``, ``x_i``, ``xhat_i`` stacked) against each one's
        received model (one flat copy per received record; the one received
        model of the usual round broadcast): elementwise, the same bits as
        client by client; each solver given its rows."""
        flat: dict[int, torch.Tensor] = {}
        for k in rows:
            received = openings[k].received
            if id(received) not in flat:
                flat[id(received)] = torch.cat([v.detach().reshape(-1) for v in received])
        server = self.shared_or_stacked([flat[id(openings[k].received)] for k in rows])
        y_all = relax(y_saved, server, x_local_all, float(self.params.alpha))
        for c, k in enumerate(rows):
            solver = openings[k].solver
            solver._layout, solver._formed = layout, None
            solver._y_flat, solver._xhat_flat = y_all[c], xhat_all[c]
            solver._stacked_at = (y_all, xhat_all, c)  # for cohort_step_tensors and cohort_after_steps
            solver.inv_eta = 1.0 / float(solver.params.eta)
            solver._anchors = None  # made when asked (step_tensors): the trainer reads the stack
            if solver.params.prox_start == "local":
                begun[k] = list(unflatten(x_local_all[c], layout).values())
            else:
                begun[k] = openings[k].received
        return begun

    @property
    def y(self) -> dict[str, torch.Tensor]:
        """The relaxed ``y_i`` of this round, per state tensor (views of the flat vector)."""
        return unflatten(self._y_flat, self._layout)

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self._anchors is None:
            y = self.y
            self._anchors = [y[key] for key, _, _ in self._layout]  # the parameters (cohort_begin_round)
        return {"y": self._anchors}

    def cohort_step_tensors(self, members: list) -> dict[str, list[torch.Tensor]] | None:
        """The members' anchors ``y_i`` as rows of :meth:`cohort_begin_round`'s
        stack (one gather for the cohort's order), viewed per parameter."""
        if any(getattr(m.solver, "_stacked_at", None) is None for m in members):
            return None
        y = _stacked_rows(members, 0)
        _, sizes, shapes = split_plan(self._layout)
        # each parameter's block made contiguous (a step reads it 50 times; column views were 10 % slower)
        return {"y": [piece.reshape(len(members), *shape).contiguous()
                      for piece, shape in zip(torch.split(y, sizes, dim=1), shapes)]}

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``g + (z - y_i) / eta``: the gradient of the prox objective
        ``f_i(z) + 1/(2 eta) ||z - y_i||^2`` (Algorithm 1, line 7, second update);
        ``g`` updated in place (the value ``g.add(...)`` gives, without a copy)."""
        return g.add_(w - tensors["y"], alpha=self.inv_eta)

    def upload(self, model: torch.nn.Module, state: ClientState) -> ArrayRecord:
        """Algorithm 1, line 7's reflect and the client's ``g_i``, from the
        trained weights in ``model``, or as the cohort trainer formed them
        for the whole batch (:meth:`cohort_after_steps`)."""
        formed, self._formed, self._stacked_at = getattr(self, "_formed", None), None, None
        if formed is None:
            x_new = torch.cat([v.detach().reshape(-1) for v in model.state_dict().values()])
            xhat_new = reflect(x_new, self._y_flat)
            g = xhat_new - self._xhat_flat
            formed = (torch.cat([self._y_flat, x_new, xhat_new]), tensors_to_record(unflatten(g.cpu(), self._layout)))
        saved, record = formed
        state.put_flat("dr", saved, stored_layout(self._layout))
        self._anchors = []
        return record

    def cohort_after_steps(self, model: torch.nn.Module, members: list, weights: list[torch.Tensor],
                           rows: list[int], layer_inputs=None) -> None:
        """:meth:`upload`'s arithmetic for every member at once, from the
        stacked trained weights (elementwise, so the same values as one
        client at a time): ``xhat_i' = 2 x_i - y_i``, ``g_i = xhat_i' -
        xhat_i`` and the state ``[y_i | x_i | xhat_i']``. Only for a model
        whose state is its parameters (the flat order of both)."""
        if type(self).upload is not DouglasRachfordSolver.upload:
            return
        names = [name for name, _ in model.named_parameters()]
        if any([k for k, _, _ in m.solver._layout] != names for m in members):
            return
        index = torch.tensor(rows, device=weights[0].device)
        x_new = torch.cat([w.detach().index_select(0, index).reshape(len(rows), -1) for w in weights], dim=1)
        y = _stacked_rows(members, 0)
        xhat_new = reflect(x_new, y)
        g = xhat_new - _stacked_rows(members, 1)
        saved = torch.cat([y, x_new, xhat_new], dim=1)
        # each reply's Arrays are rows of one CPU stack per key of every g_i
        # (their bytes written only if read): what tensors_to_record(unflatten(g_i))
        # builds, byte for byte
        keys, sizes, shapes = split_plan(self._layout)
        bounds = np.cumsum([0, *sizes]).tolist()
        g_all = g.detach().cpu()
        stacks = [StackedRows(g_all[:, bounds[i]:bounds[i + 1]].reshape(len(members), *shape).contiguous())
                  for i, shape in enumerate(shapes)]
        for c, m in enumerate(members):
            record = arrays_to_record((key, deferred_row(stack, c)) for key, stack in zip(keys, stacks))
            m.solver._formed = (saved[c], record)

    def reads_trained_model(self) -> bool:
        """Not once :meth:`cohort_after_steps` formed the upload."""
        return getattr(self, "_formed", None) is None
