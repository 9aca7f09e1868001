"""Local solver of FedPM and LocalNewton (second-order local steps).

Paper: "FedPM: Federated Learning Using Second-order Optimization with
Preconditioned Mixing of Local Parameters" (Ishii, Niwa, Sawada, Fujino,
Harada, Yokota, 2025, arXiv:2511.09100). Client rule (its eq. (10)): ``K``
local steps ``theta_i <- theta_i - lr P_i^-1 g_i`` from the received model;
FedPM uploads ``P_i`` beside ``theta_i`` for the server's preconditioned
mixing (:mod:`fedaccel.strategies.preconditioned_mixing`), LocalNewton uploads
``theta_i`` only.

Two modes (``<algo>.mode``):

``foof`` (default; any model; the paper's Test 2, section 3.3)
    Every ``nn.Linear`` / ``nn.Conv2d`` layer is preconditioned with its FOOF
    matrix ``A`` (:mod:`fedaccel.clients.foof`): ``W~ <- W~ - lr * G~ (A + damping I)^-1``
    with ``W~ = [W | b]`` (the paper's eq. (11)). Implemented as a gradient
    transform: weight decay is first added to ``p.grad`` (``G~ = grad + wd *
    W~``, so the step preconditions the gradient of the regularised loss),
    then each layer's gradient matrix is replaced by ``G~ (A + damping I)^-1``
    (Cholesky solve), then the shared loop clips the total norm of that
    preconditioned direction to ``clip-norm`` (default 1.0 here, see below),
    then plain SGD (the run's momentum, *no* optimizer weight decay) steps.
    Other parameters (GroupNorm) get the plain regularised gradient.

    **When A is computed.** Once per round by default: at the received model,
    on ``foof-samples`` local samples (0 = all; a seeded random subset
    otherwise, the same subset all round), and recomputed at the current
    weights every ``refresh-every`` local steps (0 = never). The paper
    computes FOOF "only at the end of each round, just before the
    communication" (section 4.2), so its clients step in round ``t + 1`` with
    the matrix of their own final weights of round ``t``: that needs state
    kept on the client between rounds, which this solver does not keep. It
    therefore computes its one matrix per round at the start instead, steps
    with it and (``upload='auto'`` = ``used``) uploads that same matrix, so
    one FOOF pass per round and the server mixes with the matrix the client
    stepped with (the paper's eq. (9)/(10) for a preconditioner that is
    constant within the round). ``upload='end'`` adds a second pass at the
    final weights (the matrix the paper uploads) and mixes with a matrix no
    step used.

``exact`` (``model='logreg'`` only; the paper's Test 1)
    Full-batch Newton on the client's L2-regularised multinomial
    cross-entropy ``f_i(theta) = mean CE + wd/2 ||theta||^2`` over *all*
    parameters ``theta = vec([W | b])`` (``K (d + 1)`` values): each local
    epoch is one step ``theta <- theta - lr (H + damping I)^-1 g`` with the
    exact gradient and Hessian (computed in float64). ``batch-size`` and
    ``momentum`` are not used, and ``clip-norm`` must be 0 (the paper tunes
    clipping for Test 2 only; a clipped client step is no longer a Newton
    step, and the round no longer the global Newton step below).

    **Several local steps.** ``H`` is computed at the received model and, with
    ``refresh-every = 0``, kept for every local step of the round (a
    chord / frozen-Hessian Newton method: the exact analogue of the FOOF
    mode's one preconditioner per round). Then every step of client ``i``
    uses the same ``M_i = H_i(theta) + damping I``, the upload (``used``) is
    that ``H_i`` and the round is exactly
    ``theta - lr (sum_i p_i M_i)^-1 sum_i p_i sum_k g_i(theta_i^k)``: the
    preconditioned mixing of the summed local gradients (the paper's
    appendix B, eq. (16), with a constant preconditioner). With
    ``refresh-every = 1`` every step uses the Hessian at the current local
    iterate (true local Newton steps, eq. (10) with fresh ``P_i^{t,k}``) and
    ``used`` is the Hessian of the last step. With one local step both are
    the same: with ``weight-decay > 0``, ``damping = 0`` and ``lr = 1``,
    FedPM's preconditioned mixing makes the round exactly one global Newton
    step (FedNL without compression; the paper's Theorem 1 setting).

What is uploaded (FedPM only; LocalNewton sends weights alone): the
*undamped* matrix of every preconditioned layer (``A``, or ``H`` for the
exact mode), upper triangle only, in the model's dtype, as the ArrayRecord
:data:`PRECOND_KEY` (``{layer name: packed values}``); the server adds the
damping. ``<algo>.upload`` picks which matrix: ``used`` = the last
preconditioner the client stepped with (no extra computation), ``end`` =
FOOF/Hessian recomputed at the final local weights (one more pass),
``auto`` = ``used`` in both modes (required for the global-Newton identity
in the exact mode; one FOOF pass per round in the FOOF mode).

Gradient clipping (run config ``clip-norm``; ``'auto'`` resolves to
:attr:`SecondOrderParams.default_clip_norm`): the paper tunes the clipping
norm per method and setting (appendix C.3) and its tuned tables give FedPM
and LocalNewton either no clipping or 1.0, 1.0 in most settings; ``auto``
is 1.0 in the FOOF mode and 0 (off) in the exact mode.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fedaccel.clients import foof
from fedaccel.clients.base import LocalSolver, TrainData
from fedaccel.clients.state import ClientState
from fedaccel.arrays import StackedRows, arrays_to_record, deferred_row, tensors_to_record
from fedaccel.config import config_error, require
from fedaccel.contract import NO_EXTRAS, MessageContract, TrainConfig
from fedaccel.runtime import model_name

PRECOND_KEY = "fedpm.precond"
MODES = ("foof", "exact")
UPLOADS = ("auto", "used", "end")


@dataclass(frozen=True)
class SecondOrderParams:
    """LocalNewton's keys (FedPM adds ``upload``)."""

    damping: float = 1.0
    foof_samples: int = 0
    refresh_every: int = 0
    mode: str = "foof"

    @property
    def default_clip_norm(self) -> float:
        """What ``clip-norm='auto'`` means: 1.0 in the FOOF mode (the clipping
        norm of most of the paper's tuned FedPM/LocalNewton settings,
        appendix C.3), 0 = off in the exact mode (clipping is tuned for Test 2
        only, and refused in the exact mode: :func:`check_exact_clip`)."""
        return 0.0 if self.mode == "exact" else 1.0

    def validate(self, prefix: str) -> None:
        require(self.damping >= 0, f"{prefix}.damping", self.damping, "must be >= 0")
        require(isinstance(self.foof_samples, int) and self.foof_samples >= 0,
                f"{prefix}.foof-samples", self.foof_samples, "must be an integer >= 0 (0 = all)")
        require(isinstance(self.refresh_every, int) and self.refresh_every >= 0,
                f"{prefix}.refresh-every", self.refresh_every,
                "must be an integer >= 0 (0 = once per round)")
        require(self.mode in MODES, f"{prefix}.mode", self.mode, f"allowed: {', '.join(MODES)}")


@dataclass(frozen=True)
class FedPMParams(SecondOrderParams):
    """``damping``, ``foof-samples``, ``refresh-every``, ``mode``, ``upload``."""

    upload: str = "auto"

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        require(self.upload in UPLOADS, f"{prefix}.upload", self.upload,
                f"allowed: {', '.join(UPLOADS)}")


# ------------------------------------------------------- exact logistic regression
def logreg_parts(model: torch.nn.Module) -> torch.nn.Linear:
    """The ``fc`` layer of a LogReg model; refuses models with other parameters."""
    fc = getattr(model, "fc", None)
    names = {name for name, _ in model.named_parameters()}
    if not isinstance(fc, torch.nn.Linear) or not names <= {"fc.weight", "fc.bias"}:
        raise ValueError("mode='exact' needs model='logreg' (one Linear layer named fc)")
    return fc


def with_bias_column(x: torch.Tensor, bias: bool) -> torch.Tensor:
    rows = x.reshape(x.shape[0], -1).to(torch.float64)
    return torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1) if bias else rows


def logreg_loss_grad(theta: torch.Tensor, xt: torch.Tensor, y: torch.Tensor,
                     wd: float) -> tuple[float, torch.Tensor]:
    """Loss and gradient (shape of ``theta = [W | b]``, (K, c)) of mean CE + wd/2 ||theta||^2."""
    logits = xt @ theta.T
    loss = F.cross_entropy(logits, y) + 0.5 * wd * theta.pow(2).sum()
    r = torch.softmax(logits, dim=1)
    r[torch.arange(y.shape[0]), y] -= 1.0
    return float(loss), r.T @ xt / xt.shape[0] + wd * theta


def logreg_hessian(theta: torch.Tensor, xt: torch.Tensor, wd: float,
                   chunk: int = 512) -> torch.Tensor:
    """Hessian of mean CE + wd/2 ||theta||^2 w.r.t. ``vec(theta)`` (row-major), float64.

    ``H = mean_n (diag(p_n) - p_n p_n^T) kron (x_n x_n^T) + wd I``.
    """
    k, c = theta.shape
    h = xt.new_zeros(k, c, k, c)
    for start in range(0, xt.shape[0], chunk):
        xb = xt[start:start + chunk]
        p = torch.softmax(xb @ theta.T, dim=1)
        s = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (n, K, K)
        h += torch.einsum("nkl,ni,nj->kilj", s, xb, xb)
    h = h.reshape(k * c, k * c) / xt.shape[0]
    return h + wd * torch.eye(k * c, dtype=h.dtype, device=h.device)


def check_exact_clip(cfg) -> None:
    """Refuse ``clip-norm > 0`` in the exact mode (one config line, with why)."""
    clip = float(getattr(cfg, "clip_norm", 0.0))
    if cfg.algo_params.mode == "exact" and clip > 0:
        raise config_error(
            "clip-norm", clip,
            f"must be 0 (or 'auto') with {cfg.algo}.mode='exact': the paper clips in Test 2 "
            "only, and a clipped client step is no longer a Newton step (the round would not be "
            "the global Newton step); clipping applies to the FOOF mode")


def check_exact_mode(cfg) -> None:
    """The exact mode needs the logistic-regression model, a positive-definite
    Hessian and no gradient clipping."""
    params = cfg.algo_params
    if params.mode != "exact":
        return
    check_exact_clip(cfg)
    prefix = cfg.algo
    if model_name(cfg) != "logreg":
        raise config_error(f"{prefix}.mode", "exact",
                           f"needs model='logreg' (this run uses {model_name(cfg)!r}); use 'foof'")
    if cfg.weight_decay <= 0 and params.damping <= 0:
        raise config_error(f"{prefix}.damping", params.damping,
                           "must be > 0 in the exact mode unless weight-decay > 0 (the softmax "
                           "cross-entropy Hessian alone is singular)")


class FedPMSolver(LocalSolver):
    """Second-order local steps; uploads the preconditioners (FedPM)."""

    uploads_preconditioners = True
    messages = MessageContract(to_server=(PRECOND_KEY,))

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.damping = float(self.params.damping)
        self.refresh_every = int(self.params.refresh_every)
        self.mode = self.params.mode
        upload = getattr(self.params, "upload", "auto")
        self.upload_which = "used" if upload == "auto" else upload
        # a round's preconditioners: inverses (batched) or Cholesky factors (one client alone)
        self.inverses: dict[str, torch.Tensor] = {}
        self.factors: dict[str, torch.Tensor] = {}
        check_exact_clip(cfg)

    # --------------------------------------------------------- shared
    def _foof_inputs(self, data: TrainData, generator: torch.Generator) -> torch.Tensor:
        k = int(self.params.foof_samples)
        if k == 0 or k >= data.num_examples:
            return data.x
        idx = torch.randperm(data.num_examples, generator=generator)[:k].to(data.x.device)
        return data.x[idx]

    def local_training(self, model: torch.nn.Module, data: TrainData, generator: torch.Generator,
                       lr: float, epochs: int) -> dict[str, float | int]:
        """Exact mode: ``epochs`` Newton steps on the whole split; FOOF mode: the
        shared loop (:meth:`before_steps`: the round's one FOOF pass on
        ``foof-samples`` rows; then SGD on the preconditioned gradients,
        :meth:`gradient_transform`)."""
        if self.mode == "exact":
            return self._newton_steps(model, data, lr, epochs)
        return super().local_training(model, data, generator, lr, epochs)

    def before_steps(self, model: torch.nn.Module, data: TrainData, generator: torch.Generator) -> None:
        """The round's FOOF pass at the received weights (FOOF mode)."""
        self._x_foof = self._foof_inputs(data, generator)
        self._refresh(model)

    @classmethod
    def _own_round_hooks(cls) -> bool:
        """Whether the hooks the cohort hooks stand in for are FedPM's own (a
        subclass that changes them gets the per-client calls)."""
        return cls._keeps_hooks("before_steps", "_foof_inputs", "_refresh", "end_round", "upload")

    @classmethod
    def _keeps_hooks(cls, *hooks: str) -> bool:
        """Whether this class leaves FedPM's own ``hooks`` as they are."""
        return all(getattr(cls, hook) is getattr(FedPMSolver, hook) for hook in hooks)

    def _chain_layers(self, model: torch.nn.Module, layer_inputs) -> list[str] | None:
        """The preconditioned layers when a batched FOOF pass can compute them
        (the FOOF mode, one pass per round, a chain of ``Linear`` layers with
        biases whose ``batched_layer_inputs`` the model has), else None."""
        if layer_inputs is None or self.mode != "foof" or self.refresh_every or not self._own_round_hooks():
            return None
        layers = list(foof.foof_layers(model))
        names = [name for name, _ in layers]
        if names != list(getattr(model, "chain", ())) or any(m.bias is None for _, m in layers):
            return None
        return names

    def cohort_before_steps(self, model: torch.nn.Module, members: list, layer_inputs=None):
        """:meth:`before_steps` of every member at once: each member's FOOF rows
        drawn from its own generator as before, one batched FOOF pass at the
        members' starting weights (:func:`fedaccel.clients.foof.stacked_foof`)
        and the damped inverses batched; a member without FOOF rows (no
        samples) or whose matrix has no factor gets :meth:`before_steps`'s
        error, the others go on."""
        layers = self._chain_layers(model, layer_inputs)
        if layers is None:
            return None
        for m in members:
            m.solver._x_foof = m.solver._foof_inputs(m.data, m.generator)
        # a member without rows fails alone (its own FOOF pass's error); the others' pass is batched
        problems: list[BaseException | None] = [None if m.solver._x_foof.shape[0] else foof.no_input_rows()
                                                for m in members]
        for m, problem in zip(members, problems):
            if problem is not None:
                m.solver._x_foof = None
        rest = [k for k, problem in enumerate(problems) if problem is None]
        if rest:
            for k, problem in zip(rest, self._stacked_preconditioners(model, [members[k] for k in rest], layers,
                                                                      layer_inputs)):
                problems[k] = problem
        return problems

    def _stacked_preconditioners(self, model: torch.nn.Module, members: list, layers: list[str],
                                 layer_inputs) -> list[BaseException | None]:
        """:meth:`cohort_before_steps`'s batched FOOF pass and inverses of
        ``members``, whose FOOF rows are drawn (none empty); each member's
        error or None."""
        names = [n for n, _ in model.named_parameters()]
        weights = {n: torch.stack([m.start[i] for m in members]) for i, n in enumerate(names)}
        used = foof.stacked_foof(layer_inputs, layers, weights, [m.solver._x_foof for m in members])
        inverses, infos = {}, {}
        for name in layers:
            inverse, info = foof.damped_inverse_ex(used[name], self.damping)
            inverses[name], infos[name] = inverse.to(self.layers[name].weight.dtype), info.tolist()
            del inverse  # the float64 inverse: only the layer's dtype is kept
        # with upload='end' only the first layer's matrix is uploaded as it is here
        packed = self._packed_rows({name: used[name] for name in (layers if self.upload_which == "used"
                                                                  else layers[:1])},
                                   next(model.parameters()).dtype)
        problems: list[BaseException | None] = []
        for c, m in enumerate(members):
            bad = [name for name in layers if infos[name][c] != 0]
            if bad:  # this client fails alone, holding nothing of the batch
                m.solver._x_foof = None
                problems.append(foof.preconditioner_error(used[bad[0]][c], self.damping, self.cfg.algo))
                continue
            m.solver.used = OrderedDict((name, used[name][c]) for name in layers)
            m.solver.inverses, m.solver.factors = {name: inverses[name][c] for name in layers}, {}
            m.solver._upload_rows = (OrderedDict((name, (stack, c)) for name, stack in packed.items())
                                     if packed is not None else None)
            problems.append(None)
        return problems

    def cohort_after_steps(self, model: torch.nn.Module, members: list, weights: list[torch.Tensor],
                           rows: list[int], layer_inputs=None) -> None:
        """With ``upload='end'``: the members' FOOF pass at their trained
        weights, batched; :meth:`end_round` uploads its result. The first
        layer's input is the data itself (the chain's input, whatever the
        weights), so its matrix is the one :meth:`cohort_before_steps` formed
        from the same rows; only the later layers are formed again."""
        if not self.uploads_preconditioners or self.upload_which != "end":
            return
        layers = self._chain_layers(model, layer_inputs)
        if layers is None:
            return
        index = torch.tensor(rows, device=weights[0].device)
        trained = {n: w.detach().index_select(0, index) for (n, _), w in zip(model.named_parameters(), weights)}
        first, later = layers[0], layers[1:]
        ends = (foof.stacked_foof(layer_inputs, layers, trained, [m.solver._x_foof for m in members], only=later)
                if later else {})
        packed = self._packed_rows(ends, next(model.parameters()).dtype)
        for c, m in enumerate(members):
            m.solver._end_matrices = OrderedDict(
                (name, m.solver.used[first] if name == first else ends[name][c]) for name in layers)
            if packed is not None and m.solver._upload_rows is not None:  # the first layer's row: as before
                m.solver._upload_rows.update((name, (packed[name], c)) for name in later)

    def _packed_rows(self, matrices: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, StackedRows] | None:
        """The cohort's matrices ``[C, d, d]`` per layer as the uploads hold
        them: each client's upper triangle in ``dtype`` (:meth:`_precond_record`'s
        values, byte for byte), one CPU stack per layer whose rows are the
        clients' Arrays (:meth:`end_round`). None for a subclass that packs
        its uploads or forms its end-of-round matrices its own way (it gets
        :meth:`_precond_record` of its matrices, client by client)."""
        if not self.uploads_preconditioners or not self._keeps_hooks("_precond_record", "cohort_after_steps"):
            return None
        return {name: StackedRows(foof.pack_upper_stacked(m).to(dtype).cpu()) for name, m in matrices.items()}

    def cohort_note(self, model: torch.nn.Module, layer_inputs) -> str | None:
        """Batched, but the FOOF matrices formed one client at a time: a
        model whose layers are not a chain of ``Linear`` layers with biases
        and its own batched layer inputs (the CNNs), or a subclass with
        round hooks of its own."""
        if self.per_client_reason() is not None or self._chain_layers(model, layer_inputs) is not None:
            return None
        why = (f"{type(self).__name__} has round hooks of its own" if not self._own_round_hooks() else
               "the batched pass covers chains of Linear layers with biases (the MLPs, the logistic regression)")
        return f"{self.cfg.algo}'s FOOF matrices are formed one client at a time: {why}"

    def reads_trained_model(self) -> bool:
        """The weights are uploaded as they are (no ``upload`` of its own);
        ``end_round`` reads the trained model only for ``upload='end'``
        before the cohort trainer formed the matrices (``cohort_after_steps``)
        and in the exact mode."""
        if self.mode == "exact" or not self._own_round_hooks():
            return True
        return (self.uploads_preconditioners and self.upload_which == "end"
                and getattr(self, "_end_matrices", None) is None)

    def per_client_reason(self) -> str | None:
        """The FOOF mode with one preconditioner per round batches (its
        steps are :meth:`gradient_transform`); the exact Newton mode and a
        mid-round refresh (a FOOF pass at each client's current weights)
        train one client at a time."""
        if self.mode == "exact":
            return f"{self.cfg.algo}.mode='exact' takes full-batch Newton steps per client"
        if self.refresh_every:
            return (f"{self.cfg.algo}.refresh-every={self.refresh_every} recomputes each client's FOOF "
                    "matrix at its own weights during the round")
        return None

    def _precond_record(self, matrices: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, ArrayRecord]:
        if not self.uploads_preconditioners:
            return {}
        packed = OrderedDict((name, foof.pack_upper(m).to(dtype).cpu()) for name, m in matrices.items())
        return {PRECOND_KEY: tensors_to_record(packed)}

    # ----------------------------------------------------------- FOOF
    def _refresh(self, model: torch.nn.Module) -> None:
        self.used = foof.compute_foof(model, self._x_foof)
        # One client after another, each step solves with the Cholesky factor
        # (computed in float64, the solves in the layer's dtype: for fc1 of
        # cnn-small, 1569 x 1569 with 128 rows, 68 ms a step in float64 and 27
        # in float32, 3e-7 apart; docs/measurements.md). An inverse would cost
        # more than a round of steps saves on such a layer (docs/fedpm.md);
        # the batched trainer uses one (cohort_before_steps), where a batched
        # solve takes the clients' matrices one at a time.
        self.inverses = {}
        self.factors = {name: foof.damped_cholesky(a, self.damping, self.cfg.algo).to(self.layers[name].weight.dtype)
                        for name, a in self.used.items()}

    def begin_round(self, model: torch.nn.Module, config: TrainConfig, state: ClientState) -> None:
        # The round's one FOOF pass runs in local_training (more only with
        # refresh-every > 0 or upload='end').
        self.layers = OrderedDict(foof.foof_layers(model))
        names = [n for n, _ in model.named_parameters()]
        # each preconditioned layer's (weight, bias) positions in model.parameters()
        self._layer_params = [(names.index(f"{name}.weight" if name else "weight"),
                               names.index(f"{name}.bias" if name else "bias") if m.bias is not None else None)
                              for name, m in self.layers.items()]
        self.step = 0
        self._newton_preconditioner: torch.Tensor | None = None
        self._end_matrices: OrderedDict[str, torch.Tensor] | None = None
        self._upload_rows: OrderedDict[str, tuple[StackedRows, int]] | None = None

    def cohort_begin_round(self, model: torch.nn.Module, openings: list) -> list | None:
        """:meth:`begin_round` of every opening at once: it reads the model's
        structure only (its preconditioned layers and their parameters'
        positions), the same for every client, so that is read once and no
        client's model is loaded; each client starts from the weights it
        received."""
        if type(self).begin_round is not FedPMSolver.begin_round:
            return None
        if not openings:
            return []
        self.begin_round(model, openings[0].train, openings[0].state)  # self: the first opening's solver
        layers, layer_params = self.layers, self._layer_params
        for o in openings:
            solver = o.solver
            solver.layers, solver._layer_params = layers, layer_params  # read only, shared
            solver.step, solver._newton_preconditioner, solver._end_matrices, solver._upload_rows = 0, None, None, None
        return [o.received_params for o in openings]

    def make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        # Weight decay is added to p.grad *before* preconditioning (transform_gradients).
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=self.cfg.momentum, weight_decay=0.0)

    def transform_gradients(self, model: torch.nn.Module) -> None:
        if self.refresh_every and self.step and self.step % self.refresh_every == 0:
            self._refresh(model)
        self.step += 1
        super().transform_gradients(model)

    def cohort_bytes(self, model: torch.nn.Module) -> int:
        """Per client: each layer's FOOF matrix (float64), its inverse or
        factor (the layer's dtype) and the cohort's stacked copy of it; while
        the batched pass inverts a layer, its damped copy, float64 factor and
        inverse (three float64 matrices more: a GPU's ``cholesky_inverse``
        keeps a working copy too)."""
        total = 0
        for _, module in foof.foof_layers(model):
            d, size = foof.input_dim(module), module.weight.element_size()
            total += d * d * (8 + 2 * size)
        largest = max((foof.input_dim(m) for _, m in foof.foof_layers(model)), default=0)
        return total + 3 * 8 * largest * largest

    def step_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Per preconditioned layer, ``(A + damping I)^-1`` (a batched round's
        clients, :meth:`cohort_before_steps`) or its Cholesky factor (one
        client after another, :meth:`_refresh`)."""
        if self.inverses:
            return {"inverse": [self.inverses[name] for name in self.layers]}
        return {"factor": [self.factors[name] for name in self.layers]}

    def gradient_transform(self, weights: list[torch.Tensor], grads: list[torch.Tensor],
                           tensors: dict[str, list[torch.Tensor]], leading: int = 0) -> None:
        """``G~ <- (G~ + wd W~) (A + damping I)^-1`` for every preconditioned
        layer (eq. (11), the regularised gradient preconditioned), ``g + wd w``
        for the other parameters; ``leading`` batch dims (the cohort's clients)
        precondition each client's with its own inverse (a product) or factor
        (two triangular solves): the same values to float32 rounding."""
        wd = self.cfg.weight_decay
        if wd:
            for w, g in zip(weights, grads):
                if g is not None:
                    g.add_(w, alpha=wd)
        by_inverse = "inverse" in tensors
        apply = foof.right_multiply if by_inverse else foof.right_solve
        for (wi, bi), mat in zip(self._layer_params, tensors["inverse" if by_inverse else "factor"]):
            gw, gb = grads[wi], (grads[bi] if bi is not None else None)
            if gw is None:
                continue
            g = foof.stacked_matrix(gw, gb, leading)
            foof.write_stacked(gw, gb, apply(g, mat), leading)

    def end_round(self, model: torch.nn.Module, state: ClientState) -> dict[str, ArrayRecord]:
        # the round's matrices are done with after this (a cohort holds many clients' solvers)
        used, x_foof = getattr(self, "used", {}), getattr(self, "_x_foof", None)
        ends = getattr(self, "_end_matrices", None)  # the cohort trainer's batched pass (cohort_after_steps)
        rows = getattr(self, "_upload_rows", None)  # the cohort trainer's packed uploads
        self._x_foof, self.used, self.inverses, self.factors = None, {}, {}, {}
        self._end_matrices, self._upload_rows = None, None
        if not self.uploads_preconditioners:
            return {}
        if self.mode == "exact":
            return self._precond_record({"fc": self._newton_preconditioner}, next(model.parameters()).dtype)
        if rows is not None and (self.upload_which == "used" or ends is not None):
            return {PRECOND_KEY: arrays_to_record((name, deferred_row(stack, c)) for name, (stack, c) in rows.items())}
        # 'used': the matrix of the last local step, no second FOOF pass.
        matrices = (used if self.upload_which == "used"
                    else ends if ends is not None else foof.compute_foof(model, x_foof))
        dtype = next(model.parameters()).dtype
        return self._precond_record(matrices, dtype)

    # ---------------------------------------------------------- exact
    def _newton_steps(self, model: torch.nn.Module, data: TrainData, lr: float, steps: int) -> dict[str, float | int]:
        """``steps`` damped Newton steps of the whole split's logistic loss (eq. (10)
        with the exact Hessian); keeps the Hessian to upload (end_round)."""
        fc = logreg_parts(model)
        wd = self.cfg.weight_decay
        xt = with_bias_column(data.x, fc.bias is not None)
        y = data.y.to(xt.device)
        theta = foof.weight_matrix(fc).to(torch.float64)
        first_loss = None
        for step in range(steps):
            if step == 0 or (self.refresh_every and step % self.refresh_every == 0):
                hessian = logreg_hessian(theta, xt, wd)
                factor = foof.damped_cholesky(hessian, self.damping, self.cfg.algo)
            loss, grad = logreg_loss_grad(theta, xt, y, wd)
            first_loss = loss if first_loss is None else first_loss
            newton = torch.cholesky_solve(grad.reshape(-1, 1), factor).reshape(theta.shape)
            theta = theta - lr * newton
        with torch.no_grad():
            foof.write_matrix(fc, theta)
        if self.upload_which == "end":
            hessian = logreg_hessian(theta, xt, wd)
        self._newton_preconditioner = hessian
        return {"train-loss": float(first_loss), "local-steps": steps}


class LocalNewtonSolver(FedPMSolver):
    """The same local steps; uploads weights only (plain mixing on the server)."""

    uploads_preconditioners = False
    messages = NO_EXTRAS
