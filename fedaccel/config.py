"""The run configuration's schema: typed, frozen records and the one-line error.

This module is the config-schema layer: it imports nothing of this project,
so every layer above can use it. Reading a Flower run config into a
:class:`RunConfig` needs the registry of algorithms and the lists of
datasets and models, so it lives above the algorithms, in
:mod:`fedaccel.run_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from fedaccel.data import DataConfig


class ConfigError(ValueError):
    """A run-config value is invalid; the message is one line for the user."""


def config_literal(value: Any) -> str:
    """``value`` as a user writes it in ``--run-config`` (TOML): strings
    quoted, ``true``/``false`` in lower case."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


# The largest magnitude a run-config number may have: what a float32 tensor
# holds (a larger lr, weight decay or coefficient overflows the first tensor
# it meets, in every client); and the largest integer (a count of rounds,
# epochs, samples or clients, or a batch size, beyond which sizes overflow).
LARGEST_NUMBER = 3.4028234663852886e38
LARGEST_INTEGER = 2**31 - 1


def is_whole_number(value: Any) -> bool:
    """Whether a run-config value counts as an integer: an int (not a bool)
    or a float with an integral value (TOML and the CLI may give either)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())


def number_in_text(text: str) -> int | float | None:
    """The finite number ``text`` spells for Python (``'.1'``, ``'1.'``,
    ``'0.1'``: what a user meant by a number TOML did not read, or quoted),
    as the TOML value to write instead (an int when it is whole: ``'2.'`` is
    2), or None (not a number; one with an underscore, which TOML and Python
    place differently)."""
    try:
        number = float(text) if "_" not in text else None
    except ValueError:
        return None
    if number is None or not math.isfinite(number):
        return None
    return int(number) if number.is_integer() and abs(number) <= LARGEST_INTEGER else number


def text_number_hint(value: Any) -> str:
    """``'; '...' was read as text: write N'`` for a string that spells a
    number (:func:`number_in_text`), else ``''``: the end of a refusal of a
    number key given a string."""
    number = number_in_text(value) if isinstance(value, str) else None
    if number is None:
        return ""
    return (f"; {value!r} was read as text: write the number as {number!r}, "
            "without quotes and with a digit on each side of any point")


def number_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable run-config number (one phrase), or None:
    not a number, not finite, or larger in magnitude than a float32 holds."""
    if isinstance(value, str):
        number = number_in_text(value)
        if number is not None:  # '.1', '1.', quoted '0.1': read as text
            # what to write instead, unless that number is refused too (1e39: beyond a float32)
            return number_problem(number) or "must be a finite number" + text_number_hint(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "must be a finite number"
    if isinstance(value, float) and not math.isfinite(value):  # (an int of any size is finite; isfinite overflows)
        return "must be a finite number"
    if abs(value) > LARGEST_NUMBER:
        return f"must be a finite number of at most {LARGEST_NUMBER:.4g} in magnitude (a float32)"
    return None


def config_error(key: str, value: Any, allowed: str) -> ConfigError:
    """Build the one-line error used for every invalid key."""
    return ConfigError(f"invalid run config: {key}={config_literal(value)}: {allowed}")


def did_you_mean(word: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` for ``key`` unless ``ok``."""
    if not ok:
        raise config_error(key, value, allowed)


DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class SyntheticConfig:
    """FedProx Synthetic-(alpha, beta) generator settings (``synthetic.*``);
    the defaults are :class:`data.DataConfig`'s, written once there."""

    alpha: float = DataConfig.synthetic_alpha
    beta: float = DataConfig.synthetic_beta
    iid: bool = DataConfig.synthetic_iid
    max_samples: int = DataConfig.synthetic_max_samples
    size_mu: float = DataConfig.synthetic_size_mu
    min_samples: int = DataConfig.synthetic_min_samples
    shared_model: bool = DataConfig.synthetic_shared_model


@dataclass(frozen=True)
class GCConfig:
    """Gradient centralization on top of any algorithm (``gc.*``; GC-Fed paper).

    ``mode``: none | local (LocalGC) | global (GlobalGC) | hybrid (GC-Fed) |
    local-only (hybrid's local part, no GC past the borderline: the paper's
    Figure 9 "Local GC only"); the key's ``auto`` resolves to the algorithm's
    ``default_gc_mode`` (its params class attribute; ``none`` when absent).
    ``lam`` (key ``gc.lambda``): share of parameter tensors, in
    ``named_parameters()`` order, with local GC in hybrid / local-only mode;
    ``global_layers``: comma-separated module names (``fc``) kept out of local
    GC (global GC in hybrid). ``vectors`` (``gc.vectors``): keep | mean, what
    GC does to 1-D tensors. ``weight_decay`` (``gc.weight-decay``):
    centralized | raw, whether local GC centralizes the optimizer's weight-decay
    term too. ``global_scope`` (``gc.global-scope``): split | all, whether
    hybrid's Global GC centralizes the global tensors' update only or every
    tensor's (Algorithm 1 line 14 as written). See
    fedaccel/clients/gradient_centralization.py.
    """

    mode: str = "none"
    lam: float = 1.0
    global_layers: str = "fc"
    vectors: str = "keep"
    weight_decay: str = "centralized"
    global_scope: str = "split"


GC_MODES = ("auto", "none", "local", "global", "hybrid", "local-only")


# ``init``: where the run's global model starts: the model's own seeded
# initialisation, or the optimum of a strongly convex problem plus Gaussian
# noise (fedaccel/optimum.py).
INITS = ("seeded", "near-optimum")
INIT_NOISE_DEFAULT = 0.1


# ``cohort-batching``: the fast runner trains a round's clients as one batched
# model (fedaccel/clients/cohort.py) when it can ('auto'), must ('on': a run it
# cannot batch is refused) or never ('off').
COHORT_BATCHING = ("auto", "on", "off")


@dataclass(frozen=True)
class RunConfig:
    """Every shared run-config key, validated. Algorithm keys live in ``algo_params``."""

    algo: str
    dataset: str
    model: str
    partition: str
    dirichlet_alpha: float
    num_server_rounds: int
    clients_per_round: int | float  # an int: a count; a float in (0, 1]: a fraction of all clients
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    results_dir: str
    run_name: str
    target_accuracy: float
    eval_every: int
    accl_every: int
    local_test_fraction: float
    data_dir: str
    device: str
    synthetic: SyntheticConfig
    sampler: str = "auto"  # resolved by the reader: 'auto' becomes the algorithm's default
    lr_schedule: str = "constant"
    straggler_fraction: float = 0.0
    straggler_policy: str = "auto"  # resolved by the reader, as ``sampler``
    stateful_clients: bool = False  # the algorithm's clients keep state between rounds
    client_state: str = "auto"
    state_dir: str = ""
    round_timeout: float = 600.0
    train_samples: int = 0
    clip_norm: float = 0.0  # resolved ``clip-norm``: max total gradient norm per local step, 0 = off
    cohort_batching: str = "off"  # fast runner: train a round's clients as one batched model (COHORT_BATCHING)
    cohort_chunk: int = 0  # clients per batched chunk; 0: sized to the memory available
    logical_clients: int = 0  # > 0: that many clients, served in slices by the nodes (fedaccel.cohort_nodes)
    checkpoint_every: int = 0  # write a checkpoint after every k-th round (0: never; fedaccel.checkpoint)
    resume: str = ""  # a run folder or checkpoint file to continue from ("" = a new run)
    tracker: str = "none"  # where the per-round metrics go too (fedaccel.trackers.TRACKERS)
    tracker_uri: str = ""  # TensorBoard log root or MLflow tracking URI ("" = the tracker's default)
    precision: str = "float32"  # float32 | float64: data, model and every client and server state
    tf32: bool = False  # on a CUDA device, let cuDNN's convolutions and matrix products round to TF32
    init: str = "seeded"  # INITS: the global model's start
    init_noise: float = INIT_NOISE_DEFAULT  # std of the per-coordinate noise of init='near-optimum'
    optimality: bool = False  # record each round's gap and distance to the optimum (fedaccel/optimum.py)
    algo_params: Any = None  # the algorithm's own typed config dataclass
    gc: GCConfig = GCConfig()
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def cohort_size(self, num_clients: int) -> int:
        """Clients trained per round, from a count or a fraction of ``num_clients``."""
        if isinstance(self.clients_per_round, int):
            size = self.clients_per_round
        else:
            size = max(1, int(round(self.clients_per_round * num_clients)))
        if size > num_clients:
            where = (f"exceeds the {num_clients} logical clients the cohort nodes serve; use at most "
                     f"{num_clients}, or raise logical-clients" if self.logical_clients else
                     f"exceeds the {num_clients} clients in the federation; use at most {num_clients}, or more "
                     "clients (fedaccel-federations size local-simulation N; fast runner: --num-clients N)")
            raise config_error("clients-per-round", display_value(self.clients_per_round), where)
        stragglers = int(round(self.straggler_fraction * size))  # as the strategy draws them
        if self.straggler_policy == "drop" and stragglers == size:
            raise config_error(
                "straggler-fraction", self.straggler_fraction,
                f"with straggler-policy='drop' every client of a round of {size} is a straggler "
                f"(round({self.straggler_fraction:g} x {size}) = {stragglers}) and every reply is dropped, so "
                "the model never changes; lower straggler-fraction or use straggler-policy='partial'")
        return size

    def lr_at(self, server_round: int) -> float:
        """The local learning rate of a round.

        ``lr-schedule='step'`` is the FedCDR paper's schedule (section 6.1 /
        appendix G.2): ``lr`` x 0.1 from half of the rounds and x 0.01 from
        three quarters on; ``constant`` keeps ``lr``.
        """
        if self.lr_schedule == "step":
            done = (server_round - 1) / self.num_server_rounds
            if done >= 0.75:
                return self.lr * 0.01
            if done >= 0.5:
                return self.lr * 0.1
        return self.lr

    def is_eval_round(self, server_round: int) -> bool:
        """Server-side test evaluation happens every ``eval-every`` rounds and at the end."""
        return server_round % self.eval_every == 0 or server_round == self.num_server_rounds

    def is_accl_round(self, server_round: int) -> bool:
        """Client local-test evaluation (ACCL) every ``accl-every`` rounds and at the end."""
        if self.accl_every == 0:
            return False
        return server_round % self.accl_every == 0 or server_round == self.num_server_rounds

    @property
    def needs_optimum(self) -> bool:
        """The run starts near the optimum or measures the distance to it."""
        return self.init == "near-optimum" or self.optimality

    @property
    def optimum_setting(self) -> tuple[str, Any]:
        """The key and value that make the run need the optimum (for a refusal
        line): ``init`` when it starts near it, else ``optimality``."""
        return ("init", self.init) if self.init == "near-optimum" else ("optimality", self.optimality)

    def to_dict(self) -> dict[str, Any]:
        """The full resolved config as written to ``config.json``."""
        out = dict(self.raw)
        out["resolved"] = {
            f.name: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for f in dataclasses.fields(self)
            if f.name != "raw"
            for v in [getattr(self, f.name)]
        }
        return out


def display_value(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def algo_param_keys(params_cls: type, prefix: str) -> list[tuple[str, dataclasses.Field]]:
    """``(run-config key, field)`` of every field of an algorithm's params
    dataclass: field ``server_momentum`` is key ``<prefix>.server-momentum``."""
    return [(f"{prefix}.{f.name.replace('_', '-')}", f) for f in dataclasses.fields(params_cls)]


def parse_algo_params(params_cls: type, prefix: str, cfg: Mapping[str, Any]) -> Any:
    """Build an algorithm's typed config from ``<prefix>.<field-name>`` keys.

    Field ``server_momentum`` reads key ``<prefix>.server-momentum``; missing keys
    keep the dataclass default. The dataclass's ``validate()`` (if any) raises
    :class:`ConfigError` for out-of-range values.
    """
    values = {}
    for key, f in algo_param_keys(params_cls, prefix):
        if key not in cfg:
            continue
        value = cfg[key]
        default = f.default
        if isinstance(default, bool):
            require(isinstance(value, bool), key, value, "must be true or false")
        elif isinstance(default, (int, float)):
            problem = number_problem(value)
            require(problem is None, key, value, problem or "")
            if isinstance(default, int):
                require(abs(value) <= LARGEST_INTEGER, key, value, f"must be at most {LARGEST_INTEGER} in magnitude")
                # 3.0 counts as 3, as for the shared integer keys (TOML and the CLI may give either);
                # 2.5 stays a float, for the params' own validate() to refuse in its words
                value = int(value) if is_whole_number(value) else value
            value = type(default)(value) if isinstance(default, float) else value
        elif isinstance(default, str):
            require(isinstance(value, str), key, value, "must be a string (quote it)")
        values[f.name] = value
    params = params_cls(**values)
    if hasattr(params, "validate"):
        params.validate(prefix)
    return params
