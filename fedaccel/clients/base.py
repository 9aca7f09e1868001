"""The one local training loop every algorithm shares.

:class:`LocalSolver` is FedAvg's client (McMahan et al. 2017): ``local-epochs``
passes of mini-batch SGD (momentum, weight decay) on the cross-entropy of the
client's training split, starting from the received global model, returning
the last iterate. Algorithms change it through small hooks instead of copying
the loop (the FL-bench pattern):

- :meth:`begin_round`: read the received model/config/state before training;
- :meth:`local_training`: the round's local steps (default: :meth:`run_epochs`,
  the shared SGD loop; FedPM's exact Newton mode replaces it);
- :meth:`transform_gradients`: edit ``p.grad`` after ``backward()`` and before
  ``optimizer.step()`` (proximal pulls, gradient corrections, centralization);
- :meth:`end_round`: extra records to upload and state to keep;
- :meth:`upload`: what replaces the weights in the reply (default: the
  weights themselves; Douglas-Rachford methods send a model difference).

What a solver adds to the training messages (ArrayRecords either way, config
values) is declared once in its :attr:`LocalSolver.messages`
(:class:`fedaccel.contract.MessageContract`); :meth:`LocalSolver.fit` checks
the received message and the reply against it, and the strategy checks the
same object on the server.

Per-client tensors that must survive between rounds go through the
:class:`fedaccel.clients.state.ClientState` given to every hook; ``state_copies``
declares how many model-sized tensors a solver keeps per client (used to
size the store and to document memory).

Because hooks act on ``p.grad`` before the optimizer step, whatever they add
goes through momentum and weight decay exactly like the task gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from collections import OrderedDict
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord
from flwr.common import log

from fedaccel.clients.composition import client_gradient_transforms
from fedaccel.clients.state import ClientState
from fedaccel.data import random_crop_flip
from fedaccel.config import RunConfig
from fedaccel.contract import NO_EXTRAS, TrainConfig
from fedaccel.torch_utils import state_to_arrays


@dataclass(eq=False)
class SamplePool:
    """Many clients' training samples in one pair of tensors, client after
    client (the fast runner's, built once before round 1): a client's
    :class:`TrainData` that names it is the ``num_examples`` rows from
    ``pool_start``, as views. The cohort trainer gathers a round's
    mini-batches straight from it instead of concatenating the cohort's
    data every round (a fresh 4.5 MB tensor for 100 Synthetic clients, whose
    memory the allocator handed back to the system and faulted in again,
    1,000 to 2,500 minor page faults a SCAFFOLD round in fedaccel-run)."""

    x: torch.Tensor
    y: torch.Tensor


@dataclass
class TrainData:
    """A client's training split as tensors on the training device; ``pool``
    and ``pool_start`` when ``x`` and ``y`` are rows of a :class:`SamplePool`."""

    x: torch.Tensor
    y: torch.Tensor
    augment: bool = False
    pool: SamplePool | None = None
    pool_start: int = 0

    def __post_init__(self) -> None:
        if self.pool is not None:  # the cohort trainer gathers by pool_start: it must name x's and y's rows
            for name, mine, whole in (("x", self.x, self.pool.x), ("y", self.y, self.pool.y)):
                if not _rows_of(mine, whole, self.pool_start):
                    raise ValueError(f"TrainData.{name} is not rows {self.pool_start}.. of its pool "
                                     "(pool_start must say where its rows start)")

    @property
    def num_examples(self) -> int:
        return int(self.y.shape[0])


def _rows_of(part: torch.Tensor, whole: torch.Tensor, start: int) -> bool:
    """Whether ``part`` is ``whole[start:start + len(part)]`` itself (a view
    of the same memory, not a copy of the values)."""
    return (0 <= start and start + part.shape[0] <= whole.shape[0] and part.shape[1:] == whole.shape[1:]
            and part.dtype == whole.dtype and part.device == whole.device
            and (part.numel() == 0 or (part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                                       and part.stride() == whole.stride()
                                       and part.storage_offset() == whole.storage_offset() + start * whole.stride(0))))


@dataclass
class LocalResult:
    """What a client sends back: weights, metrics and optional extra records."""

    arrays: ArrayRecord
    metrics: dict[str, float | int]
    extra: dict[str, ArrayRecord] = field(default_factory=dict)


class LocalSolver:
    """FedAvg's local SGD; subclasses override the hooks, never the loop."""

    state_copies = 0  # model-sized tensors kept per client between rounds
    messages = NO_EXTRAS  # FedAvg adds nothing to the common messages
    # Keys of step_tensors() that gradient_rule updates in place, step after
    # step (running sums such as SCAFFOLD's); the cohort trainer writes them
    # back to each client's own tensors after the round.
    accumulators: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.params = cfg.algo_params
        # x0, the run's initial global model (seeded, so every client rebuilds
        # exactly the server's); set by the ClientApp before the first round.
        self.initial_model: OrderedDict[str, torch.Tensor] | None = None
        # ArrayRecords the server sent beside the model this round (e.g.
        # SCAFFOLD's control variate), set by fit() before begin_round.
        self.received: dict[str, ArrayRecord] = {}
        # local steps taken this round, set by close_round() before end_round
        # from the trainer's report (the per-client loop or the cohort trainer)
        self.local_steps = 0
        self._state_lost = False  # set by open_round: the state the server counts on is gone

    # ----------------------------------------------------------------- hooks
    def begin_round(
        self, model: torch.nn.Module, config: TrainConfig, state: ClientState
    ) -> None:
        """Called with the received global weights already loaded into ``model``."""

    def local_training(self, model: torch.nn.Module, data: TrainData, generator: torch.Generator,
                       lr: float, epochs: int) -> dict[str, float | int]:
        """The round's local steps from the weights in ``model``; returns
        ``train-loss`` and ``local-steps`` (default: :meth:`before_steps`,
        then :meth:`run_epochs`)."""
        self.before_steps(model, data, generator)
        return self.run_epochs(model, data, generator, lr, epochs)

    def before_steps(self, model: torch.nn.Module, data: TrainData, generator: torch.Generator) -> None:
        """This client's work between :meth:`begin_round` and its first local
        step, with the round's starting weights in ``model`` (FedPM's FOOF
        pass); a draw from ``generator`` here comes before the steps' own
        mini-batch permutations, in both trainers. Default: nothing."""

    def cohort_begin_round(self, model: torch.nn.Module, openings: list[Any]) -> list[Any] | None:
        """:meth:`begin_round` of many clients at once, for the cohort trainer
        (``self`` is the first opening's solver; every opening's is of this
        class). Each opening (:class:`fedaccel.clients.cohort.Opening`) holds
        a client's solver, after ``open_round(..., begin=False)``, its state,
        round config and the received model's tensors (``model.state_dict()``
        order, read only). Returns None when it cannot (the trainer then loads
        each client's model and calls its :meth:`begin_round`), else per
        opening the client's starting weights (``model.parameters()`` order,
        read only) or the exception its own :meth:`begin_round` would have
        raised. Whatever it sets on each solver must be what
        :meth:`begin_round` sets, to the bit. Default: None."""
        return None

    @staticmethod
    def shared_or_stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        """The members' tensors for an elementwise batched operation: the one
        tensor itself when every member holds that same tensor (the received
        weights, broadcast against a ``[C, ...]`` stack), else stacked."""
        first = tensors[0]
        return first if all(t is first for t in tensors) else torch.stack(tensors)

    def cohort_before_steps(self, model: torch.nn.Module, members: list[Any],
                            layer_inputs: Any = None) -> list[BaseException | None] | None:
        """:meth:`before_steps` of a chunk of the cohort trainer's members at
        once (``self`` is the first member's solver; every member's is of this
        class, each member with its own ``data``, ``generator`` and starting
        weights ``start``); ``layer_inputs``: the model's
        ``batched_layer_inputs``, or None when it has none. Returns None when
        it cannot (the trainer then calls each member's :meth:`before_steps`),
        else per member None or the exception its own :meth:`before_steps`
        would have raised. Default: None."""
        return None

    def cohort_after_steps(self, model: torch.nn.Module, members: list[Any], weights: list[torch.Tensor],
                           rows: list[int], layer_inputs: Any = None) -> None:
        """Work of the members' :meth:`end_round` on their trained weights,
        for a chunk of the cohort at once, before each member's ``close_round``
        (FedPM's FOOF pass with ``upload='end'``): ``weights`` stacked as the
        cohort trainer holds them, member ``c``'s in row ``rows[c]``, and
        each member's :attr:`local_steps` already set; other arguments as
        :meth:`cohort_before_steps`. Default: nothing."""

    def cohort_bytes(self, model: torch.nn.Module) -> int:
        """Memory this solver keeps per client while a cohort trains, beyond
        the model-sized copies the cohort trainer counts itself (bytes; used
        to size chunks). Default: none."""
        return 0

    def cohort_note(self, model: torch.nn.Module, layer_inputs: Callable | None) -> str | None:
        """What the cohort trainer still does one client at a time in a
        batched run of this solver on ``model`` (one line, for the log), or
        None. ``layer_inputs``: the model's ``batched_layer_inputs``, if it
        has its own."""
        return None

    def per_client_reason(self) -> str | None:
        """Why this solver's round must train one client at a time, or None
        when the cohort trainer can run it (one line, for the log).

        Default: decided from the code: a solver that replaces one of the
        loop's hooks (beyond the rule hooks) trains per client. A solver
        whose overrides are written for both trainers says so by overriding
        this instead (FedPM's FOOF mode)."""
        for hook in ("transform_gradients", "local_training", "run_epochs", "make_optimizer"):
            if self.overrides(hook):
                return (f"{self.cfg.algo}'s local solver overrides {hook}() "
                        "(not yet written as a batchable gradient rule)")
        return None

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This client's tensors that :meth:`gradient_rule` reads, each a list
        aligned with ``model.parameters()`` (e.g. FedProx's anchor ``w^t``;
        a :meth:`gradient_transform` may order its own lists otherwise, e.g.
        FedPM's one factor per preconditioned layer).
        Set up by :meth:`begin_round`; none for FedAvg."""
        return {}

    def cohort_step_tensors(self, members: list[Any]) -> dict[str, list[torch.Tensor]] | None:
        """:meth:`step_tensors` of the cohort trainer's ``members`` (``self``
        is the first one's solver), each stacked along a new first dim in the
        members' order, when the solver already holds them stacked (made by
        :meth:`cohort_begin_round`); None: the trainer stacks each member's
        (the default) and, for :attr:`accumulators`, copies the running sums
        back into each member's own tensors after the steps. A solver that
        returns stacks keeps those sums in them itself (SCAFFOLD's
        ``grad_sum``, read by its :meth:`cohort_after_steps`)."""
        return None

    def gradient_rule(self, w: torch.Tensor, g: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The gradient the optimizer steps with, for one parameter: a pure,
        elementwise function of its weight ``w``, its task gradient ``g`` and
        this client's ``tensors`` for that parameter (:meth:`step_tensors`);
        scalars come from the run and round config, the same for every client
        of a round. FedAvg: ``g``. The only side effects allowed are a running
        sum into this client's tensors named in :attr:`accumulators`
        (``acc.add_(...)``, elementwise too) and ``g`` itself updated in
        place and returned (``g.add_(...)``: the trainers replace ``g`` by
        what the rule returns, so this saves a new tensor and a copy).

        Written once, it serves both trainers: the per-client loop applies it
        to each parameter (:meth:`transform_gradients`), and the cohort trainer
        (:mod:`fedaccel.clients.cohort`) applies the same function to tensors
        that stack every client of a round along a first dimension, which an
        elementwise rule computes unchanged."""
        return g

    def gradient_transform(self, weights: list[torch.Tensor], grads: list[torch.Tensor],
                           tensors: dict[str, list[torch.Tensor]], leading: int = 0) -> None:
        """Replace ``grads`` (aligned with ``model.parameters()``) in place by
        the gradients the optimizer steps with; ``tensors`` as
        :meth:`step_tensors` gives them. ``leading`` dims in front of every
        tensor are batch dims (1 in the cohort trainer: the clients).

        Default: :meth:`gradient_rule` for every parameter (an elementwise
        rule ignores the batch dims). A rule that mixes the elements of a
        layer (FedPM's preconditioner) overrides this instead, for both
        trainers."""
        if not self.overrides("gradient_rule"):
            return
        for i, (w, g) in enumerate(zip(weights, grads)):
            out = self.gradient_rule(w, g, {k: v[i] for k, v in tensors.items()})
            if out is not g:
                g.copy_(out)

    @classmethod
    def edits_gradients(cls) -> bool:
        """Whether this solver's step differs from the task gradient (it has a
        :meth:`gradient_rule` or a :meth:`gradient_transform`): both trainers
        skip the rule when it does not."""
        return cls.overrides("gradient_rule") or cls.overrides("gradient_transform")

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether this solver replaces the shared loop's ``hook``."""
        return getattr(cls, hook) is not getattr(LocalSolver, hook)

    def transform_gradients(self, model: torch.nn.Module) -> None:
        """Edit ``p.grad`` in place after backward, before the optimizer step:
        :meth:`gradient_transform` (by default :meth:`gradient_rule` for every
        parameter). A solver overrides this hook only for work that is not
        part of the step rule (FedPM's mid-round refresh); one that does must
        say whether it can still be batched (:meth:`per_client_reason`)."""
        if not self.edits_gradients():
            return
        params = list(model.parameters())
        self.gradient_transform([p.detach() for p in params], [p.grad for p in params], self.step_tensors())

    def end_round(
        self, model: torch.nn.Module, state: ClientState
    ) -> dict[str, ArrayRecord]:
        """Extra ArrayRecords to upload beside the weights (none for FedAvg)."""
        return {}

    def upload(self, model: torch.nn.Module, state: ClientState) -> ArrayRecord:
        """The reply's ``arrays``: the trained weights (FedAvg's last iterate)."""
        return state_to_arrays(model)

    @classmethod
    def uploads_trained_weights(cls) -> bool:
        """Whether the reply is the trained weights and nothing after the
        steps reads the model: neither :meth:`end_round` nor :meth:`upload`
        is overridden (FedAvg, FedProx)."""
        return not cls.overrides("end_round") and not cls.overrides("upload")

    def reads_trained_model(self) -> bool:
        """Whether :meth:`close_round` still reads the trained model this
        round (``end_round`` or ``upload``), so that the cohort trainer must
        load the client's weights into it; when not, and the solver has no
        :meth:`upload` of its own, the trainer builds the upload from the
        stacked weights. Default: unless :meth:`uploads_trained_weights`;
        FedPM's FOOF mode reads no model once its matrices are formed, the
        Douglas-Rachford solver none once the trainer formed its upload."""
        return not self.uploads_trained_weights()

    def upload_is_trained_weights(self) -> bool:
        """Whether the cohort trainer may build this round's upload from the
        stacked weights: no :meth:`upload` of its own and no read of the
        trained model (:meth:`reads_trained_model`)."""
        return not self.overrides("upload") and not self.reads_trained_model()

    # ------------------------------------------------------------------ loop
    def make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        """Plain SGD with the run's momentum and weight decay, fresh every round."""
        return torch.optim.SGD(
            model.parameters(), lr=lr, momentum=self.cfg.momentum,
            weight_decay=self.cfg.weight_decay,
        )

    def run_epochs(
        self,
        model: torch.nn.Module,
        data: TrainData,
        generator: torch.Generator,
        lr: float,
        epochs: int,
    ) -> dict[str, float | int]:
        """``epochs`` shuffled passes of mini-batch SGD; returns loss and step count.

        Each step: ``backward()``, :meth:`transform_gradients`, the composed
        transforms (local GC), then, if ``clip-norm > 0``, the total norm of
        all parameters' gradients is clipped to ``clip-norm``
        (``torch.nn.utils.clip_grad_norm_``), then ``optimizer.step()``. So the
        clip acts on the gradient the optimizer steps with (FedProx's prox
        pull, SCAFFOLD's correction and FedPM's preconditioned direction
        included), before momentum and before the optimizer's own weight decay.
        """
        model.train()
        optimizer = self.make_optimizer(model, lr)
        composed = client_gradient_transforms(self.cfg, model, optimizer)
        clip_norm = float(getattr(self.cfg, "clip_norm", 0.0))
        params = [p for p in model.parameters() if p.requires_grad]
        n, bs = data.num_examples, self.cfg.batch_size
        # in the model's precision (a float64 run's loss is not rounded to float32)
        loss_sum = torch.zeros((), device=data.x.device, dtype=params[0].dtype if params else torch.float32)
        seen, steps = 0, 0
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(data.x.device)
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                xb, yb = data.x[idx], data.y[idx]
                if data.augment:
                    xb = random_crop_flip(xb, generator)
                optimizer.zero_grad(set_to_none=False)
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                self.transform_gradients(model)
                for transform in composed:
                    transform(model)
                if clip_norm > 0:
                    # Clips what the optimizer steps with (after every transform):
                    # the corrected / preconditioned gradient, torch's convention.
                    torch.nn.utils.clip_grad_norm_(params, clip_norm)
                optimizer.step()
                loss_sum += loss.detach() * yb.shape[0]
                seen += int(yb.shape[0])
                steps += 1
        train_loss = float(loss_sum) / max(seen, 1)
        return {"train-loss": train_loss, "local-steps": steps}

    def fit(
        self,
        model: torch.nn.Module,
        data: TrainData,
        config: dict[str, Any],
        state: ClientState,
        generator: torch.Generator,
        received: dict[str, ArrayRecord] | None = None,
    ) -> LocalResult:
        """One round of local training from the weights already in ``model``;
        ``received`` holds the message's ArrayRecords other than the model."""
        train = self.open_round(model, config, state, received)
        metrics = self.local_training(model, data, generator, train.lr, train.local_epochs)
        return self.close_round(model, data, state, metrics)

    def open_round(self, model: torch.nn.Module, config: dict[str, Any], state: ClientState,
                   received: dict[str, ArrayRecord] | None = None, begin: bool = True) -> TrainConfig:
        """Everything before the local steps: read the message against the
        contract, settle the client state (commit protocol), :meth:`begin_round`
        (``begin=False``: all but that; the cohort trainer then begins a
        chunk's rounds at once, :meth:`cohort_begin_round`).
        Returns the typed round config."""
        algo, stateful = self.cfg.algo, self.state_copies > 0
        train = self.messages.read_train_config(algo, config, stateful)
        self.received = dict(received or {})
        self.messages.check_records(algo, "to_client", self.received)
        self._state_lost = False
        if stateful:
            self._state_lost = self._resolve_state(train, state)
            state.begin(train.server_round)
        if begin:
            self.begin_round(model, train, state)
        return train

    def close_round(self, model: torch.nn.Module, data: TrainData, state: ClientState,
                    metrics: dict[str, float | int], arrays: ArrayRecord | None = None) -> LocalResult:
        """Everything after the local steps, from the trained weights in
        ``model``: :meth:`end_round`, :meth:`upload`, seal the state.

        ``arrays``: the upload, when the caller built it from the trained
        weights itself (the cohort trainer, which holds every client's weights
        stacked); only when :meth:`upload_is_trained_weights`,
        whose ``end_round`` and ``upload`` do not read ``model`` then."""
        self.local_steps = int(metrics.get("local-steps", 0))
        if arrays is not None and not self.upload_is_trained_weights():
            raise TypeError(f"{type(self).__name__} builds its own upload; close_round takes no arrays for it")
        extra = self.end_round(model, state)
        self.messages.check_records(self.cfg.algo, "to_server", extra)
        result_arrays = self.upload(model, state) if arrays is None else arrays
        if self.state_copies > 0:
            state.seal()  # pending until the server's next message says it applied this reply
        metrics = dict(metrics, **{"num-examples": data.num_examples})
        if self._state_lost:
            metrics["state-lost"] = 1
        return LocalResult(arrays=result_arrays, metrics=metrics, extra=extra)

    @staticmethod
    def _resolve_state(config: TrainConfig, state: ClientState) -> bool:
        """The commit protocol's client half (docs/client-state.md): commit the
        state of the last round if the server applied its reply
        (``accepted-round``), roll it back otherwise. Returns True when the
        state the server counts on is gone (then training restarts from the
        initial state, reported as ``state-lost``)."""
        accepted = config.accepted_round
        outcome = state.resolve(accepted)
        if outcome == "rolled-back":
            log(INFO, "[fedaccel] round %s: the server did not apply this client's last reply "
                "(lost, late or rejected); its state is rolled back to round %s",
                config.server_round, accepted)
        elif outcome == "lost":
            log(WARNING, "[fedaccel] this client's state of round %s is gone (a SuperNode restart "
                "with client-state='context'?); starting again from the initial state. Use "
                "client-state='disk' to keep state across restarts.", accepted)
        return outcome == "lost"


class AnchoredSolver(LocalSolver):
    """A solver whose round begins at an anchor, the received parameters,
    plus what it reads from its own state (FedRKMGC, FedDyn): it writes that
    as :meth:`begin_at_anchor`. :meth:`begin_round` calls it on a copy of the
    loaded model's parameters; :meth:`cohort_begin_round` on the received
    parameters themselves, for every opening at once, no model loaded."""

    def begin_at_anchor(self, train: TrainConfig, state: ClientState,
                        anchor: "OrderedDict[str, torch.Tensor]") -> None:
        """What :meth:`begin_round` sets, given ``anchor``: the received
        parameters by name (read only)."""
        raise NotImplementedError

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        self.begin_at_anchor(config, state, OrderedDict((k, p.detach().clone()) for k, p in model.named_parameters()))

    def cohort_begin_round(self, model: torch.nn.Module, openings: list[Any]) -> list[Any] | None:
        """:meth:`begin_at_anchor` of each opening's solver at the received
        parameters (``begin_round`` copies them out of the loaded model); an
        exception is that client's own. None for a subclass with a
        ``begin_round`` of its own."""
        if type(self).begin_round is not AnchoredSolver.begin_round:
            return None
        names = [name for name, _ in model.named_parameters()]
        begun: list[Any] = []
        for o in openings:
            anchor = OrderedDict(zip(names, o.received_params))
            try:
                o.solver.begin_at_anchor(o.train, o.state, anchor)
            except Exception as err:  # noqa: BLE001 - returned as that client's own error
                begun.append(err)
                continue
            begun.append(list(anchor.values()))
        return begun
