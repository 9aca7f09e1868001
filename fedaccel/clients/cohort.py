"""Train a round's cohort of clients as one batched model.

The clients of a round share the model architecture, so their local steps can
run together: their weights are stacked along a first "client" dimension, the
forward pass runs every client's mini-batch through its own weights at once
(the model's ``batched_forward``, or ``vmap(functional_call(model, ...))``),
and one backward of the sum of the clients' losses gives each client the
gradient of its own loss (their weights are disjoint); the MLPs write that
backward out (``batched_loss_and_grads``: bit for bit autograd's, without
its engine's per-node cost). For the small models of federated benchmarks a
step is dominated by per-call overhead, which this pays once per cohort
instead of once per client.

Nothing of an algorithm is written twice. Per step, as in
:meth:`fedaccel.clients.base.LocalSolver.run_epochs`:

- the task gradient: cross-entropy of the client's mini-batch;
- the algorithm's edit: the solver's own
  :meth:`~fedaccel.clients.base.LocalSolver.gradient_rule`, elementwise, so it
  is applied unchanged to the stacked tensors, or its
  :meth:`~fedaccel.clients.base.LocalSolver.gradient_transform` with the
  client dim as a batch dim (FedPM's per-client FOOF solves); running sums it keeps, in
  :attr:`~fedaccel.clients.base.LocalSolver.accumulators`, are written back
  to each client after the round);
- the composed layers: local gradient centralization
  (:func:`fedaccel.clients.composition.client_gradient_transforms` with the
  client dimension leading) and ``clip-norm`` (torch's
  ``clip_grad_norm_`` formula per client, :func:`clip_grad_norm_per_client`);
- the step: the solver's own ``make_optimizer`` (``torch.optim.SGD``, whose
  update is elementwise too) over the stacked weights, its arithmetic called
  through torch's functional ``sgd`` (:func:`sgd_step`: the same kernels as
  ``optimizer.step()`` without its per-step bookkeeping).

Ragged cohorts (clients with different sample counts, hence step counts) are
exact, not padded with fake steps: a client's mini-batches are its own
``torch.randperm`` per epoch from its own generator, as in the per-client
loop; the last batch of an epoch is padded to the batch size and masked out
of the loss (the mean is over real samples only); clients are sorted by step
count and a client that has taken all its steps leaves the cohort, taking its
weights and momentum buffer with it, so no client ever takes a step it would
not take alone.

Equivalence with the per-client loop is to float32 rounding (the batched
kernels sum in another order): ``tests/test_cohort.py`` checks every
batchable algorithm's round against the per-client one.

Which solvers can be batched is decided from the code
(:meth:`~fedaccel.clients.base.LocalSolver.per_client_reason`): a solver that
overrides none of the loop's hooks other than the rule hooks
(``gradient_rule``, ``gradient_transform``, ``step_tensors``,
``before_steps``), or one that says its overrides serve both trainers
(FedPM's FOOF mode); :func:`fallback_reason` adds what the run itself rules
out (dropout, buffers). Augmented data (CIFAR's random crops and flips) is
batched: each client's crops are drawn ahead of the steps, in its own loop's
order (:func:`_batch_plan`).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap
from torch.optim.sgd import sgd as functional_sgd  # public: torch.optim.sgd.__all__

from flwr.app import ArrayRecord

from fedaccel.arrays import StackedRows, arrays_to_record, deferred_row, load_into
from fedaccel.clients.base import LocalResult, LocalSolver, TrainData
from fedaccel.clients.state import ClientState
from fedaccel.clients.composition import client_gradient_transforms
from fedaccel.config import ConfigError, RunConfig
from fedaccel.data.augment import PAD, crop_flip, crop_flip_draws

def fallback_reason(solver: LocalSolver, cfg: RunConfig, model: torch.nn.Module) -> str | None:
    """Why this run's clients cannot train as one batched model, or None.

    One line, for the log: the cohort trainer falls back to the per-client
    loop for the whole run rather than approximate anything. (Data
    augmentation is no reason: :func:`_batch_plan` draws each client's crops
    as its own loop would.)"""
    reason = solver.per_client_reason()
    if reason:
        return reason
    if any(True for _ in model.buffers()):
        return "the model has buffers (running statistics), which a functional batch does not carry"
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in model.modules()):
        return "the model has dropout, whose per-client random masks are not batched"
    return None


def unbatchable_error(reason: str) -> ConfigError:
    """``cohort-batching='on'`` for a run that cannot be batched (``reason``
    from :func:`fallback_reason`): the fast runner's and a cohort node's answer."""
    return ConfigError(f"cohort-batching='on' but this run cannot be batched: {reason}; "
                       "use cohort-batching='auto' to train its clients one after another")


def slower_reason(model: torch.nn.Module) -> str | None:
    """Why batching this model would be slower than one client after another
    (for ``cohort-batching='auto'``), or None.

    A model without its own ``batched_forward`` goes through
    ``vmap(functional_call)``, which turns every convolution into one grouped
    convolution over the clients; on a CPU that is slower than the clients'
    own convolutions one after another (the McMahan CNN on Fashion-MNIST,
    10 clients per round: 5.38 s against 4.08 s per round for a bare loop,
    docs/cohort-batching-measurements.md). On a GPU it is the other way round."""
    device = next(model.parameters()).device
    if device.type == "cpu" and own_batched(model, "batched_forward") is None:
        return ("on a CPU this model's batched convolutions (vmap) are slower than training its "
                "clients one after another; cohort-batching='on' batches it anyway")
    return None


# A round's mini-batches are gathered at once (one index_select) when they
# take at most this much memory (all steps' inputs: epochs times the data),
# else one step at a time: the same rows either way.
GATHER_ONCE_BYTES = 256 << 20

# Model-sized tensors per client while a chunk trains: its start weights, the
# stacked weights, their gradient, the gradient rule's output, the momentum
# buffer, the trained copy, and up to four step tensors of the rule
# (FedDyn's anchor and grad_prev, SCAFFOLD's correction and running sum).
MODEL_COPIES = 10
MEMORY_FRACTION = 0.25  # of the memory available when the round starts


def bytes_per_client(model: torch.nn.Module, sample: torch.Tensor, batch_size: int, extra: int = 0) -> int:
    """The memory one more client adds to a batched step, estimated: the
    activations a forward pass of one mini-batch keeps for the backward pass
    (counted with ``saved_tensors_hooks``: exact for this model), its logits
    and their gradient, :data:`MODEL_COPIES` model-sized tensors, and
    ``extra`` bytes the solver keeps per client (:meth:`LocalSolver.cohort_bytes`)."""
    return _activation_bytes(model, sample, batch_size) + MODEL_COPIES * parameter_bytes(model.parameters()) + extra


def parameter_bytes(params: Iterable[torch.Tensor]) -> int:
    """The bytes of one copy of these parameters (one client's model-sized tensor)."""
    return sum(p.numel() * p.element_size() for p in params)


# model -> {(sample shape, dtype, device, batch size, parameter shapes): bytes}
_measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _activation_bytes(model: torch.nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """What one forward pass of a mini-batch keeps for the backward pass,
    plus its logits and their gradient: measured by running it (a forward
    pass every round cost 1.3 ms, 6 % of a batched round of 100 clients
    without steps), so kept per model and input for the process."""
    key = (tuple(sample.shape), sample.dtype, sample.device, batch_size,
           tuple((p.shape, p.dtype) for p in model.parameters()))
    known = _measured.setdefault(model, {})
    if key not in known:
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        x = torch.zeros((batch_size,) + tuple(sample.shape), dtype=sample.dtype, device=sample.device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        known[key] = saved + 2 * out.numel() * out.element_size()
    return known[key]


def chunk_size(model: torch.nn.Module, sample: torch.Tensor, batch_size: int,
               available: int | None, fraction: float = MEMORY_FRACTION, extra: int = 0) -> int:
    """How many clients train as one batch: as many as fit in ``fraction`` of
    ``available`` bytes, rounded down to a power of two (at least 1); no
    limit where the machine does not say. The power of two keeps the chunks,
    hence which clients share a batch and so the float32 bits, the same from
    one run to the next while the clients that fit stay between the same two
    powers of two."""
    if available is None:
        return 1 << 30
    fits = max(1, int(fraction * available) // max(bytes_per_client(model, sample, batch_size, extra), 1))
    return 1 << (fits.bit_length() - 1)


def batched_forward(model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The forward pass of C copies of ``model`` with stacked weights, on
    ``x`` ``[C, B, ...]``: the model's own ``batched_forward`` when it has one
    (the MLPs of :mod:`fedaccel.models.nets`: one ``baddbmm`` per layer),
    else ``vmap(functional_call(model, ...))`` (any model, with torch.func's
    per-operation overhead: about 1 ms per step on a CPU)."""
    own = own_batched(model, "batched_forward")
    if own is not None:
        return own
    return vmap(lambda params, x: functional_call(model, params, (x,)))


def own_batched(model: torch.nn.Module, name: str) -> Callable | None:
    """The model's own batched method ``name``, or None when it has none or
    when it would not compute this model (a subclass of an MLP that changes
    its ``forward``: :meth:`fedaccel.models.nets.LinearChain.chain_is_forward`)."""
    own = getattr(model, name, None)
    consistent = getattr(model, "chain_is_forward", None)
    if own is None or (consistent is not None and not consistent()):
        return None
    return own


@dataclass
class CohortMember:
    """One client of the cohort: its own solver (after ``open_round``), data,
    generator and starting weights (``model.parameters()`` order; read only:
    clients that received the same model may share them)."""

    solver: LocalSolver
    data: TrainData
    generator: torch.Generator
    start: list[torch.Tensor]


Crops = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (dy, dx, flip) of each slot of a batch plan


def _batch_plan(members: list[CohortMember], epochs: int, batch_size: int, device: torch.device,
                data_starts: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], Crops | None]:
    """Every client's mini-batches, in its own order, step by step.

    ``members`` are sorted by step count, largest first, so the clients still
    training at step ``t`` are the first ``active[t]``. Returns ``rows``
    ``[K, B]``: step ``t``'s mini-batches are the next ``active[t]`` rows, one
    per active client in cohort order, as indices into the concatenated data
    of all clients (or, given ``data_starts``, into data where each
    member's samples start at its entry; a padded slot names its row's
    first sample); ``real`` ``[K, B]`` (1 = a real sample, 0 = padding of an
    epoch's last batch); ``active``; and each client's step count. ``K`` is
    the total number of client-steps, so no row is gathered for a client
    that has left. The permutations are drawn
    exactly as the per-client loop draws them: one ``randperm`` per epoch from
    the client's generator.

    Where a member's data is augmented (``TrainData.augment``: CIFAR's random
    crops and flips), its crops are drawn here too, in the per-client loop's
    order (each epoch's ``randperm``, then :func:`crop_flip_draws` for each
    of its batches in turn, so the generator is left as that loop leaves
    it), and the last value is ``(dy, dx, flip)`` ``[K, B]`` on ``device``,
    each sample's crop in the layout of ``rows``; a member without
    augmentation and every padded slot get the crop that leaves an image as
    it is (offset ``PAD``, no flip). None when no member is augmented."""
    steps = [epochs * math.ceil(m.data.num_examples / batch_size) for m in members]
    sizes = [m.data.num_examples for m in members]
    # filled in NumPy (a slice assignment there costs a tenth of torch's),
    # client by client: client c's steps are the rows first[c] ... of the
    # client-major plan, its samples offset to where its data starts in the
    # concatenated data, -1 where an epoch's last batch is padded
    first = np.cumsum([0, *steps], dtype=np.int64)
    plan = np.full(int(first[-1]) * batch_size, -1, dtype=np.int64)
    if data_starts is None:
        data_starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64).tolist()
    augmented = any(m.data.augment for m in members)
    if augmented:  # every slot's crop, client-major as plan; PAD and no flip: the image as it is
        dys, dxs, flips = np.full(len(plan), PAD, np.int64), np.full(len(plan), PAD, np.int64), np.zeros(len(plan), bool)
    for c, (m, n, offset) in enumerate(zip(members, sizes, data_starts)):
        width = math.ceil(n / batch_size) * batch_size  # one epoch, its last batch padded
        for e in range(epochs):
            at = int(first[c]) * batch_size + e * width
            plan[at:at + n] = torch.randperm(n, generator=m.generator).numpy() + offset
            if m.data.augment:  # then each batch's crops, as the per-client loop draws them
                for begin in range(at, at + n, batch_size):
                    b = min(batch_size, at + n - begin)
                    dy, dx, flip = crop_flip_draws(b, m.generator)
                    dys[begin:begin + b], dxs[begin:begin + b] = dy.cpu().numpy(), dx.cpu().numpy()
                    flips[begin:begin + b] = flip.cpu().numpy()
    plan = plan.reshape(-1, batch_size)
    # step-major: the row of (step t, client c) is start[t] + c
    active = (np.asarray(steps)[None, :] > np.arange(max(steps))[:, None]).sum(axis=1)  # [T]
    start = np.cumsum([0, *active[:-1]], dtype=np.int64)
    client = np.repeat(np.arange(len(members)), steps)
    step = np.arange(len(plan)) - np.repeat(first[:-1], steps)
    row_of = start[step] + client  # each client-major row's place in the step-major layout

    def step_major(values: np.ndarray) -> np.ndarray:
        """``values``, one per slot client-major as ``plan``, in the step-major layout."""
        values = values.reshape(-1, batch_size)
        out = np.empty_like(values)
        out[row_of] = values
        return out

    index = step_major(plan)
    real = index >= 0
    # a padded slot reads its own row's first sample (always real): the
    # padding's zero weight cancels a finite value only, so a slot that read
    # another client's sample (index 0) let that client's NaN or inf into this
    # one's gradient and loss (0 * NaN); its own sample is one it trains on anyway
    index = np.where(real, index, index[:, :1])
    crops = (tuple(torch.from_numpy(step_major(values)).to(device) for values in (dys, dxs, flips))
             if augmented else None)
    return (torch.from_numpy(index).to(device), torch.from_numpy(real).float().to(device), active.tolist(), steps,
            crops)


class _Stacked:
    """The active clients' stacked weights, for ``make_optimizer(model, lr)``
    (which only asks for ``parameters()``)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params


def train_cohort(model: torch.nn.Module, members: list[CohortMember], lr: float, epochs: int,
                 batch_size: int) -> tuple[list[list[torch.Tensor]], list[dict[str, float | int]]]:
    """``epochs`` passes of every member's local SGD at once.

    ``model`` gives the architecture (its own weights are not used). Returns
    each member's trained weights (``model.parameters()`` order) and its
    metrics (``train-loss``, ``local-steps``), as the per-client loop
    reports them."""
    weights, rows, metrics = train_stacked(model, members, lr, epochs, batch_size)
    return [[w[r] for w in weights] for r in rows], metrics


def train_stacked(model: torch.nn.Module, members: list[CohortMember], lr: float, epochs: int,
                  batch_size: int) -> tuple[list[torch.Tensor], list[int], list[dict[str, float | int]]]:
    """:func:`train_cohort` with the trained weights as they come out of the
    steps: one tensor per parameter, every member's weights stacked along
    dim 0, member ``c``'s in row ``rows[c]``. Returns ``(weights, rows,
    metrics)``."""
    if not members:
        return [], [], []
    device = members[0].start[0].device
    order = sorted(range(len(members)), key=lambda c: -members[c].data.num_examples)
    cohort = [members[c] for c in order]
    # no mini-batch holds more than its client's samples: a batch-size above the largest client's
    # would only pad every step (the same batches and steps; memory that grows with batch-size)
    batch_size = max(1, min(batch_size, cohort[0].data.num_examples))
    template = cohort[0].solver  # scalars of the rule and the optimizer: the same for all
    pool = cohort[0].data.pool
    if pool is not None and all(m.data.pool is pool for m in cohort):  # rows of one pool: gathered from it
        x_all, y_all, data_starts = pool.x, pool.y, [m.data.pool_start for m in cohort]
    else:
        x_all, y_all, data_starts = torch.cat([m.data.x for m in cohort]), torch.cat([m.data.y for m in cohort]), None
    rows, real, active_per_step, steps, crops = _batch_plan(cohort, epochs, batch_size, device, data_starts)
    starts = np.cumsum([0, *active_per_step])[:-1].tolist()  # step t's first row (none: no steps)
    y_steps = y_all.index_select(0, rows.view(-1)).view(rows.shape)
    sample_shape = x_all.shape[1:]
    if rows.numel() * math.prod(sample_shape) * x_all.element_size() <= GATHER_ONCE_BYTES:
        # every step's mini-batches gathered at once, in step order, [K, B, ...]
        gathered = x_all.index_select(0, rows.view(-1)).view(rows.shape + sample_shape)

        def x_rows(begin: int, end: int) -> torch.Tensor:
            return gathered[begin:end]
    else:  # (epochs times the data: too much to hold) one step at a time, the same rows

        def x_rows(begin: int, end: int) -> torch.Tensor:
            return x_all.index_select(0, rows[begin:end].reshape(-1)).view((end - begin,) + rows.shape[1:]
                                                                           + sample_shape)
    if crops is not None:  # each step's images cropped and flipped as the per-client loop does
        uncropped = x_rows

        def x_rows(begin: int, end: int) -> torch.Tensor:
            return crop_flip(uncropped(begin, end), *(c[begin:end] for c in crops))
    names = [n for n, _ in model.named_parameters()]
    grads_of = batched_loss_and_grads(model)
    # stacks the solver made (it keeps its accumulators' sums itself), else each member's tensors stacked
    stacked, own = template.cohort_step_tensors(cohort), None
    if stacked is None:
        own = [m.solver.step_tensors() for m in cohort]
        stacked = {k: [torch.stack([o[k][i] for o in own]) for i in range(len(own[0][k]))] for k in own[0]}
    tensors = stacked  # the active clients' rows (views: accumulators write through)
    # every client's weights, stacked; the active clients' are the first rows,
    # trained in place through views (a client that leaves keeps its rows)
    weights = [torch.stack([m.start[i] for m in cohort]) for i in range(len(names))]
    holder = [torch.nn.Parameter(w) for w in weights]
    optimizer = template.make_optimizer(_Stacked(holder), lr)
    step = sgd_step(optimizer) or optimizer.step
    cfg = template.cfg
    composed = client_gradient_transforms(cfg, model, optimizer, holder, leading=1)
    clip_norm = float(getattr(cfg, "clip_norm", 0.0))
    counts = real.sum(dim=1)  # [K]: each client's real samples per step
    # every step's labels and loss gradients at once, [K, 1, B]
    target, label_grad = y_steps.unsqueeze(1), label_gradients(real, counts, weights[0].dtype)
    nll_grad = round_nll_gradients(model, dict(zip(names, weights)), target, label_grad)  # [K, classes, B] or None
    label_log_probs = []
    active = len(cohort)
    plain_rule = not template.edits_gradients()
    for t, start in enumerate(starts):
        still = active_per_step[t]  # clients are sorted by step count; the last ones are done
        if still < active:
            if isinstance(step, FunctionalSGD) and not composed:  # nothing else holds the optimizer
                holder, step = step.narrowed(still)
            else:
                holder, optimizer = _retire(holder, optimizer, template, lr, still)
                step = sgd_step(optimizer) or optimizer.step
                if composed:  # the run's transforms, on the remaining clients (none: none to rebuild)
                    composed = client_gradient_transforms(cfg, model, optimizer, holder, leading=1)
            tensors = {k: [v[:still] for v in vs] for k, vs in tensors.items()}
            active = still
        end = start + active
        grads, log_probs = grads_of(holder, x_rows(start, end), target[start:end], label_grad[start:end],
                                    None if nll_grad is None else nll_grad[start:end])
        for p, g in zip(holder, grads):
            p.grad = g
        if not plain_rule:  # the solver's own rule, on every client at once
            template.gradient_transform([p.detach() for p in holder], list(grads), tensors, leading=1)
        for transform in composed:  # local GC, as in the per-client loop
            transform()
        if clip_norm > 0:
            clip_grad_norm_per_client(holder, clip_norm)
        step()
        label_log_probs.append(log_probs)
    # [T, C] tables of each client's mini-batch loss and real samples per step (0 once it has left)
    training = (torch.arange(len(cohort), device=device)[None, :]
                < torch.tensor(active_per_step, device=device)[:, None])
    losses = (losses_from_label_log_probs(torch.cat(label_log_probs), real, counts) if label_log_probs
              else counts.new_zeros(0, dtype=weights[0].dtype))  # [K], in the run's precision
    step_losses = losses.new_zeros(training.shape).masked_scatter_(training, losses)
    step_counts = counts.new_zeros(training.shape).masked_scatter_(training, counts)
    loss_sum, seen = (step_losses * step_counts).sum(dim=0), step_counts.sum(dim=0)
    for key in template.accumulators if own is not None else ():  # the rule's running sums, back to each client
        for c, o in enumerate(own):
            for i, v in enumerate(stacked[key]):
                o[key][i].copy_(v[c])
    loss_sums, seen_counts = loss_sum.tolist(), seen.tolist()
    metrics = [{"train-loss": loss_sums[c] / max(seen_counts[c], 1.0), "local-steps": steps[c]}
               for c in range(len(cohort))]
    rows_out, metrics_out = [0] * len(members), [None] * len(members)
    for pos, c in enumerate(order):  # back to the members' order
        rows_out[c], metrics_out[c] = pos, metrics[pos]
    return weights, rows_out, metrics_out


GradsOf = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                   tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def batched_loss_and_grads(model: torch.nn.Module) -> GradsOf:
    """``grads_of(params, x, target, label_grad, nll_grad=None)``: every
    client's gradient of its mean loss over its real samples (``params``
    stacked in ``model.parameters()`` order, ``x`` ``[C, B, ...]``, ``target``
    ``[C, 1, B]`` the labels, ``label_grad`` ``[C, 1, B]`` from
    :func:`label_gradients`, ``nll_grad`` these steps' rows of
    :func:`round_nll_gradients` when it gave them), and each sample's
    log-probability of its label ``[C, 1, B]``
    (:func:`losses_from_label_log_probs` turns them into the losses).

    The model's own ``batched_loss_and_grads`` when it has one (the MLPs of
    :mod:`fedaccel.models.nets`: the backward pass written out, bit for bit
    autograd's), else one ``torch.autograd.grad`` of the sum of the clients'
    losses through :func:`batched_forward`: the clients' weights are
    disjoint, so it gives each client the gradient of its own."""
    names = [n for n, _ in model.named_parameters()]
    own = own_batched(model, "batched_loss_and_grads")
    if own is not None:
        def written_out(params, x, target, label_grad, nll_grad=None):
            named = dict(zip(names, params))
            # nll_grad only where round_nll_gradients gave it (a model with nll_gradients)
            grads, label_log_probs = (own(named, x, target, label_grad) if nll_grad is None
                                      else own(named, x, target, label_grad, nll_grad))
            return tuple(grads[n] for n in names), label_log_probs
        return written_out
    forward = batched_forward(model)

    def through_autograd(params, x, target, label_grad, nll_grad=None):  # nll_grad: autograd forms its own
        out = forward(dict(zip(names, params)), x)  # [C, B, classes]
        # classes as dim 1: the MLPs' logits are a view of a [C, classes, B]
        # result, which log-softmax reads contiguously (5x faster than [C*B, classes])
        ce = F.cross_entropy(out.transpose(1, 2), target.squeeze(1), reduction="none")
        # d/d ce of the sum of the clients' mean losses is -label_grad (real / count),
        # as for ((ce * real).sum(1) / count).sum()
        return torch.autograd.grad((ce * -label_grad.squeeze(1)).sum(), params), -ce.detach().unsqueeze(1)
    return through_autograd


def round_nll_gradients(model: torch.nn.Module, params: dict[str, torch.Tensor], target: torch.Tensor,
                        label_grad: torch.Tensor) -> torch.Tensor | None:
    """A round's ``nll_loss`` backward for every step at once ``[K, classes,
    B]``, from the model's own ``nll_gradients`` (the MLPs: the scatter their
    written-out backward would make each step), when it has one and the
    result fits in ``GATHER_ONCE_BYTES``; else None (each step forms its own)."""
    own = own_batched(model, "nll_gradients")
    if own is None or own_batched(model, "batched_loss_and_grads") is None:
        return None
    classes = own(params, target[:0], label_grad[:0]).shape[1]  # an empty call, for its shape
    if target.numel() * classes * label_grad.element_size() > GATHER_ONCE_BYTES:
        return None
    return own(params, target, label_grad)


def label_gradients(real: torch.Tensor, count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``d(sum of losses) / d(log-probability at each sample's label)`` for
    ``losses = (nll * real).sum(-1) / count`` (``real`` ``[..., B]``,
    ``count = real.sum(-1)``), ``[..., 1, B]``: minus ``(1 / count)`` in the
    loss's ``dtype``, broadcast over the batch, times ``real``, formed as
    autograd forms it. Elementwise, so a round's for all its steps at once
    equal each step's own."""
    weight = (torch.ones(count.shape, dtype=dtype, device=count.device) / count).unsqueeze(-1) * real
    return (-weight).unsqueeze(-2)


def losses_from_label_log_probs(label_log_probs: torch.Tensor, real: torch.Tensor,
                                count: torch.Tensor) -> torch.Tensor:
    """Each mini-batch's mean cross-entropy over its real samples, from the
    log-probabilities at the labels ``[..., 1, B]`` that
    :func:`batched_loss_and_grads` returns: ``(nll_loss(..., 'none') *
    real).sum(-1) / count`` (``nll_loss`` is the negated log-probability at
    the label, exactly)."""
    return ((-label_log_probs.squeeze(-2)) * real).sum(dim=-1) / count


def sgd_step(optimizer: torch.optim.Optimizer) -> FunctionalSGD | None:
    """``optimizer.step()``'s arithmetic without its wrapper, for a plain
    ``torch.optim.SGD`` of one parameter group: the returned
    :class:`FunctionalSGD`, called, runs torch's public functional form
    ``torch.optim.sgd.sgd`` on the group's parameters that have a gradient,
    with the group's settings and the momentum buffers of the optimizer's own
    state, exactly as ``step()`` does (same kernels, same weights bit for bit,
    the same buffers left in ``optimizer.state``).

    What it skips is ``step()``'s bookkeeping: its profiler record, its step
    hooks and its per-group setup (30-40 us a step, more than SGD's
    arithmetic on a small model). The cohort trainer builds this optimizer
    itself and registers no hooks on it; torch's global optimizer hooks
    (``register_optimizer_step_pre_hook``) are not called for it. Any other
    optimizer: None (the caller uses ``step()``)."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    settings = {k: group[k] for k in ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize",
                                      "foreach", "fused")}
    if isinstance(settings["lr"], torch.Tensor) or settings["fused"] or group.get("differentiable"):
        return None
    return FunctionalSGD(group["params"], optimizer.state, settings)


class FunctionalSGD:
    """One ``torch.optim.SGD`` step's arithmetic (:func:`sgd_step`) over
    ``params``, with the momentum buffers in ``state`` (``{param:
    {"momentum_buffer": tensor}}``, the optimizer's own state or a
    :meth:`narrowed` one)."""

    def __init__(self, params: list[torch.Tensor], state: dict, settings: dict[str, Any]) -> None:
        self.params, self.state, self.settings = params, state, settings

    def __call__(self) -> None:
        live = [p for p in self.params if p.grad is not None]  # as step() skips the others
        buffers = [self.state[p].get("momentum_buffer") for p in live]
        with torch.no_grad():
            functional_sgd(live, [p.grad for p in live], buffers, **self.settings)  # as step() passes them
        if self.settings["momentum"] != 0:  # as step() keeps them
            for p, buffer in zip(live, buffers):
                self.state[p]["momentum_buffer"] = buffer

    def narrowed(self, keep: int) -> tuple[list[torch.Tensor], FunctionalSGD]:
        """The same step on the first ``keep`` rows only (the clients still
        training): new parameters and momentum buffers that are views of the
        first ``keep`` rows of these (no copy: the steps go on writing into
        the stacked weights; the rows after ``keep`` stay as they are). What
        :func:`_retire` does, without building a new optimizer (40 us, 25
        times a round of 100 ragged clients). The new parameters are plain
        leaf tensors that require grad as these do (the autograd path takes
        the gradient by them): nothing here needs ``Parameter``, whose
        constructor costs more than the view."""
        new = [p.detach()[:keep].requires_grad_(p.requires_grad) for p in self.params]
        state: dict = defaultdict(dict)
        for old_p, new_p in zip(self.params, new):
            buf = self.state[old_p].get("momentum_buffer") if old_p in self.state else None
            if buf is not None:
                state[new_p]["momentum_buffer"] = buf[:keep]
        return new, FunctionalSGD(new, state, self.settings)


def clip_grad_norm_per_client(params: list[torch.Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(client's params, max_norm)`` for every
    client at once: ``params`` stack the clients along dim 0, and each
    client's gradient is scaled by ``min(1, max_norm / (||g_c|| + 1e-6))``,
    ``||g_c||`` the 2-norm over all of that client's parameters (torch's
    formula, written batched here because torch's clips one total norm)."""
    grads = [p.grad for p in params]
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
    total = torch.linalg.vector_norm(norms, dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))


def _retire(holder: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, template: LocalSolver,
            lr: float, keep: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The clients after the first ``keep`` have taken all their steps: go on
    with the first ``keep`` only, in a new optimizer of the same kind whose
    parameters and momentum buffers are views of the first ``keep`` rows of
    the old ones (no copy: the steps still write into the stacked weights,
    and the clients that left keep their rows as they are)."""
    new = [torch.nn.Parameter(p.detach()[:keep]) for p in holder]
    new_optimizer = template.make_optimizer(_Stacked(new), lr)
    for old_p, new_p in zip(holder, new):
        buf = optimizer.state.get(old_p, {}).get("momentum_buffer")
        if buf is not None:
            new_optimizer.state[new_p]["momentum_buffer"] = buf[:keep]
    return new, new_optimizer


@dataclass
class CohortJob:
    """One client's training message, as the per-client path would receive it:
    its own solver instance, data, the received global model (``arrays``),
    config, state, generator and extra records."""

    solver: LocalSolver
    data: TrainData
    arrays: ArrayRecord
    config: dict[str, Any]
    state: ClientState
    generator: torch.Generator
    received: dict[str, Any] = field(default_factory=dict)


@dataclass
class Opening:
    """One client's round between ``open_round(..., begin=False)`` and its
    :meth:`~fedaccel.clients.base.LocalSolver.begin_round`, for a solver's
    :meth:`~fedaccel.clients.base.LocalSolver.cohort_begin_round`: its solver,
    state, round config and the received model's tensors (``model.state_dict()``
    order; read only, shared by the clients that received the same record)
    and the same tensors of its parameters (``model.parameters()`` order)."""

    solver: LocalSolver
    state: ClientState
    train: Any
    received: list[torch.Tensor]
    received_params: list[torch.Tensor]


def keeps_uploads_on_device(chunk: int, clients: int, model_bytes: int, upload_room: int | None) -> bool:
    """Whether a round's uploads built from the stacked weights stay on the
    device they trained on until the server has used them: when the whole
    cohort trains as one chunk (its weights were there together anyway), or
    when all ``clients`` uploads of ``model_bytes`` fit in ``upload_room``
    bytes (a share of the device's memory kept for them beside the chunk
    that trains). Else each chunk's leave the device before the next trains."""
    return chunk >= clients or (upload_room is not None and clients * model_bytes <= upload_room)


def fit_cohort(model: torch.nn.Module, jobs: list[CohortJob], batch_size: int,
               max_clients: int | None = None,
               upload_room: int | None = None) -> list[LocalResult | BaseException]:
    """:meth:`LocalSolver.fit` for every job, the local steps batched.

    Each job goes through its solver's ``open_round`` and ``close_round``
    exactly as in ``fit`` (contract checks, commit protocol, ``begin_round``,
    ``end_round``, ``upload``), with ``model`` as the scratch model they read
    and write; only ``local_training`` is replaced: each client's
    ``before_steps``, then :func:`train_stacked` (the steps of :func:`train_cohort`).
    For a solver that uploads its trained weights as they are and reads no
    model after the steps (:meth:`LocalSolver.upload_is_trained_weights`), the upload is built from
    the stacked weights (:func:`_weight_records`) and handed to
    ``close_round``, instead of loaded into ``model`` and read back.
    Jobs with the same learning rate and epoch count train together, at most
    ``max_clients`` at a time (chunks one after another: each client's
    gradient is its own, so chunking changes memory and, where the machine's batched
    matrix products round by batch size, float32 rounding: docs/cohort-batching.md). An
    exception raised by one job's own work (its ``open_round``, begin,
    ``before_steps`` or ``close_round``, or one a solver's cohort hook
    returned for that client alone) is returned in its place, whatever its
    type: that client fails alone, as it would one client after another (the
    caller turns a user error into its error reply, anything else into the
    reply Flower gives for an exception); the others go on. Only an exception
    of the shared batched steps fails every job. ``upload_room``:
    the bytes the round's built uploads may take on the training device
    (:func:`keeps_uploads_on_device`)."""
    out: list[LocalResult | BaseException | None] = [None] * len(jobs)
    groups: dict[tuple[float, int], list[tuple[int, CohortMember]]] = {}
    model_state = model.state_dict()
    targets = list(model_state.values())
    params = list(model.parameters())
    param_slots = [list(model_state).index(name) for name, _ in model.named_parameters()]
    loaded: dict[int, tuple[ArrayRecord, list[torch.Tensor]]] = {}  # id(arrays) -> its tensors
    # one algorithm's solvers that begin a round for many clients at once
    # (cohort_begin_round) settle each client's message and state first
    first_solver = jobs[0].solver if jobs else None
    begin_together = (first_solver is not None and first_solver.overrides("cohort_begin_round")
                      and all(type(job.solver) is type(first_solver) for job in jobs))
    openings: list[tuple[int, Opening]] = []
    for j, job in enumerate(jobs):
        # a solver without its own begin_round neither reads nor changes the
        # model before its steps: it starts from the received weights as they are
        reads_model = job.solver.overrides("begin_round") or job.solver.overrides("open_round")
        try:
            # a round's messages usually share one model record: read it once
            if id(job.arrays) not in loaded:
                load_into(model, job.arrays)
                loaded[id(job.arrays)] = (job.arrays, [t.detach().clone() for t in targets])
            elif reads_model and not begin_together:
                _load_received(targets, loaded[id(job.arrays)][1])
            if begin_together:  # settled here, begun below with the others
                train = job.solver.open_round(model, job.config, job.state, job.received, begin=False)
            else:  # as in fit (an open_round of the solver's own need not know begin=)
                train = job.solver.open_round(model, job.config, job.state, job.received)
        except Exception as err:  # noqa: BLE001 - that client's own error
            out[j] = err
            continue
        if begin_together:
            received = loaded[id(job.arrays)][1]
            openings.append((j, Opening(job.solver, job.state, train, received, [received[i] for i in param_slots])))
            continue
        if reads_model:
            start = [p.detach().clone() for p in params]
        else:  # the received tensors themselves (read only: the trainer stacks copies)
            start = [loaded[id(job.arrays)][1][i] for i in param_slots]
        member = CohortMember(job.solver, job.data, job.generator, start)
        groups.setdefault((train.lr, train.local_epochs), []).append((j, member))
    chunk = max_clients or len(jobs) or 1
    keep_on_device = keeps_uploads_on_device(chunk, len(jobs), parameter_bytes(params), upload_room)
    begun: list | None = []
    for at in range(0, len(openings), chunk):  # a chunk at a time: its stacked state is what fits
        part_begun = openings[0][1].solver.cohort_begin_round(model, [o for _, o in openings[at:at + chunk]])
        if part_begun is None:
            begun = None
            break
        begun.extend(part_begun)
    for k, (j, opening) in enumerate(openings):
        job = jobs[j]
        try:
            if begun is None:  # each client's own begin_round, on its received model
                _load_received(targets, opening.received)
                job.solver.begin_round(model, opening.train, job.state)
                start = [p.detach().clone() for p in params]
            elif isinstance(begun[k], BaseException):  # that client's alone, whatever its type
                raise begun[k]
            else:
                start = begun[k]
        except Exception as err:  # noqa: BLE001 - that client's own error
            out[j] = err
            continue
        member = CohortMember(job.solver, job.data, job.generator, start)
        groups.setdefault((opening.train.lr, opening.train.local_epochs), []).append((j, member))
    layer_inputs = own_batched(model, "batched_layer_inputs")
    for (lr, epochs), group in groups.items():
        # chunk by chunk, each client's work from before_steps to close_round,
        # so that only one chunk's per-client tensors (FedPM's FOOF inverses) live at once
        for start in range(0, len(group), chunk):
            candidates, part = group[start:start + chunk], []
            first = candidates[0][1].solver
            alike = all(type(m.solver) is type(first) for _, m in candidates)  # one algorithm's solvers
            prepared = None  # the chunk's before_steps at once, when the solver can (FedPM)
            if alike and first.overrides("before_steps"):
                prepared = first.cohort_before_steps(model, [m for _, m in candidates], layer_inputs)
            for k, (j, member) in enumerate(candidates):
                try:
                    if prepared is not None:
                        if prepared[k] is not None:  # that client's alone, whatever its type
                            raise prepared[k]
                    elif member.solver.overrides("before_steps"):  # only FedPM has work there
                        _load_weights(params, member.start)
                        member.solver.before_steps(model, member.data, member.generator)  # as local_training
                except Exception as err:  # noqa: BLE001 - that client's own error
                    out[j] = err
                    continue
                part.append((j, member))
            weights, rows, metrics = train_stacked(model, [m for _, m in part], lr, epochs, batch_size)
            if part and alike:
                for (_, member), m in zip(part, metrics):  # as close_round sets it, for the batch's end_round work
                    member.solver.local_steps = int(m.get("local-steps", 0))
                part[0][1].solver.cohort_after_steps(model, [m for _, m in part], weights, rows, layer_inputs)
            uploads = _weight_records(model_state, param_slots, weights, rows, part, keep_on_device)
            for (j, member), row, m, arrays in zip(part, rows, metrics, uploads):
                # no upload built from the stack (this member's, or a model _weight_records
                # cannot build one for): load the weights if anything after the steps reads
                # them, the default upload (state_to_arrays) included
                if arrays is None and (member.solver.reads_trained_model() or not member.solver.overrides("upload")):
                    _load_weights(params, [w[row] for w in weights])
                try:
                    out[j] = jobs[j].solver.close_round(model, jobs[j].data, jobs[j].state, m, arrays=arrays)
                except Exception as err:  # noqa: BLE001 - that client's own error
                    out[j] = err
    return out  # type: ignore[return-value]


def _weight_records(model_state: dict[str, torch.Tensor], param_slots: list[int], weights: list[torch.Tensor],
                    rows: list[int], part: list[tuple[int, CohortMember]],
                    keep_on_device: bool = False) -> list[ArrayRecord | None]:
    """The reply's ``arrays`` of every member whose solver uploads its trained
    weights as they are and reads no model after the steps
    (:meth:`LocalSolver.upload_is_trained_weights`), built
    from the stacked weights: what ``state_to_arrays(model)`` gives once the
    member's weights are loaded, byte for byte, without loading them (a
    third of the per-client cost of a batched FedAvg round). None for the
    others, and for everyone when the model's state holds more than its
    parameters (buffers), in another order, or a parameter that is not
    C-contiguous (whose upload Flower writes in its own order).
    ``keep_on_device``: the uploads are rows of the stacked weights where they
    are (:class:`fedaccel.arrays.StackedRows`; on a GPU the server's checks and
    mean then run there), else of one copy of them in host memory."""
    builds = [member.solver.upload_is_trained_weights() for _, member in part]
    if (not any(builds) or list(range(len(model_state))) != param_slots
            or not all(t.is_contiguous() for t in model_state.values())):
        return [None] * len(part)
    names = list(model_state)
    # off a GPU in one copy, or kept there (the server then checks and averages them there)
    stacks = [StackedRows(w.detach() if keep_on_device else w.detach().cpu()) for w in weights]
    return [arrays_to_record((name, deferred_row(stack, row)) for name, stack in zip(names, stacks)) if build else None
            for build, row in zip(builds, rows)]


def _load_received(targets: list[torch.Tensor], received: list[torch.Tensor]) -> None:
    """Copy a received model's tensors into the model's state ``targets``
    (``model.state_dict()`` values) before a client's ``begin_round``."""
    with torch.no_grad():
        for target, value in zip(targets, received):
            target.copy_(value)


def _load_weights(params: list[torch.nn.Parameter], weights: list[torch.Tensor]) -> None:
    """Copy ``weights`` into the model's parameters ``params`` (``list(model.parameters())``)."""
    with torch.no_grad():
        for p, v in zip(params, weights):
            p.copy_(v)
