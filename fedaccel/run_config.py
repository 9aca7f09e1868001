"""Read and validate a Flower run config into the typed :class:`RunConfig`.

Flower hands both apps a flat ``run_config`` dict (nested TOML tables arrive
as dotted keys such as ``fedprox.mu``). :func:`parse_run_config` turns it into
a frozen :class:`~fedaccel.config.RunConfig`, checking every value once, on
the server and on every client, so a bad value is one clear line naming the
key, the value and what is allowed instead of a traceback from deep inside
training. It knows every algorithm (through the registry), every dataset and
every model, so it sits above them; the schema it fills is
:mod:`fedaccel.config`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fedaccel.clients.gradient_centralization import GLOBAL_SCOPES, VECTOR_RULES, WEIGHT_DECAY_RULES
from fedaccel.clients.state import CLIENT_STATES
from fedaccel.data import DATASETS, PARTITIONS, DataConfig
from fedaccel.data.config import PRECISIONS, SYNTHETIC_SPREAD_MAX, partition_available, resolve_partition
from fedaccel.config import (
    COHORT_BATCHING, DEVICES, GC_MODES, INIT_NOISE_DEFAULT, INITS, ConfigError, GCConfig, RunConfig, SyntheticConfig, algo_param_keys, config_error,
    LARGEST_INTEGER, is_whole_number, number_problem, parse_algo_params, require, text_number_hint,
)
from fedaccel.registry import all_algorithms, get_algorithm
from fedaccel.samplers import SAMPLERS
from fedaccel.trackers import TRACKERS
from fedaccel.models import MODELS, default_model


#: The allowed values of every shared string key that has a fixed set: what
#: the validation below checks and what a form (fedaccel-dashboard) offers.
CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": tuple(DATASETS),
    "model": ("auto",) + tuple(MODELS),
    "partition": tuple(PARTITIONS),
    "precision": PRECISIONS,
    "init": INITS,
    "device": DEVICES,
    "sampler": SAMPLERS,
    "lr-schedule": ("constant", "step"),
    "straggler-policy": ("auto", "drop", "partial"),
    "client-state": CLIENT_STATES,
    "cohort-batching": COHORT_BATCHING,
    "tracker": TRACKERS,
    "gc.mode": GC_MODES,
    "gc.vectors": VECTOR_RULES,
    "gc.weight-decay": WEIGHT_DECAY_RULES,
    "gc.global-scope": GLOBAL_SCOPES,
}


def _number(cfg: Mapping[str, Any], key: str) -> float:
    value = cfg[key]
    problem = number_problem(value)
    require(problem is None, key, value, problem or "")
    return float(value)


def _integer(cfg: Mapping[str, Any], key: str, minimum: int, maximum: int = LARGEST_INTEGER) -> int:
    value = cfg[key]
    require(is_whole_number(value) and value >= minimum, key, value,
            f"must be an integer >= {minimum}" + text_number_hint(value))
    require(value <= maximum, key, value, f"must be an integer in [{minimum}, {maximum}]")
    return int(value)


def _positive(cfg: Mapping[str, Any], key: str) -> float:
    value = _number(cfg, key)
    require(value > 0, key, cfg[key], "must be > 0 (seconds)")
    return value


def _string(cfg: Mapping[str, Any], key: str, choices: tuple[str, ...] | None = None) -> str:
    value = cfg[key]
    require(isinstance(value, str), key, value, "must be a string (quote it: key='value')")
    if choices is not None:
        require(value in choices, key, value, f"allowed: {', '.join(choices)}")
    return value


def _boolean(cfg: Mapping[str, Any], key: str) -> bool:
    value = cfg[key]
    require(isinstance(value, bool), key, value, "must be true or false")
    return value



def _refuse_other_algorithms_keys(cfg: Mapping[str, Any], algo: str) -> None:
    """Refuse a hyperparameter of another algorithm set away from its default.

    The run config always holds every algorithm's keys (pyproject's defaults),
    so a key is the user's only when its value differs from the default:
    ``fedprox.mu=0.5`` with ``algo='fedavg'`` would be ignored, silently.
    """
    mine = get_algorithm(algo).prefix
    for other, spec in all_algorithms().items():
        if spec.prefix == mine:
            continue
        for key, f in algo_param_keys(spec.params, spec.prefix):
            if key in cfg and cfg[key] != f.default:
                raise config_error(
                    key, cfg[key], f"is a hyperparameter of algo='{other}', which this run does "
                    f"not use (algo='{algo}'): remove it, or set algo='{other}'")


def parse_run_config(cfg: Mapping[str, Any]) -> RunConfig:
    """Validate a Flower run config and return the typed :class:`RunConfig`.

    For whoever starts a run (ServerApp, fast runner, CLIs): besides every
    value, it refuses a hyperparameter of another algorithm set away from its
    default, which means reading every algorithm's parameters.
    """
    run_cfg = parse_client_config(cfg)
    _refuse_other_algorithms_keys(cfg, run_cfg.algo)
    return run_cfg


def parse_client_config(cfg: Mapping[str, Any]) -> RunConfig:
    """What a client needs: every value checked as :func:`parse_run_config`
    does, importing only this run's algorithm (the server has already refused
    other algorithms' keys before any message reached the client)."""
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(
            "run config is missing keys " + ", ".join(missing)
            + ": run from the project folder (flwr run .) so pyproject.toml supplies them"
        )
    for key, value in cfg.items():  # a path or name with a NUL byte: no file system takes it
        require(not (isinstance(value, str) and "\x00" in value), key, value, "must not contain a NUL character")
    algo = _string(cfg, "algo")
    spec = get_algorithm(algo)  # an unknown name: ConfigError with the allowed names

    cpr = _number(cfg, "clients-per-round")
    if isinstance(cfg["clients-per-round"], int):
        require(cpr >= 1, "clients-per-round", cfg["clients-per-round"],
                "an integer is a count of clients and must be >= 1 (a fraction is a float in (0, 1], e.g. 0.1)")
    else:
        require(0 < cpr <= 1, "clients-per-round", cfg["clients-per-round"],
                "a float is a fraction of the clients and must be in (0, 1]; for a count of "
                f"clients write a whole number without a decimal point (e.g. {max(1, int(cpr))})")
    alpha = _number(cfg, "dirichlet-alpha")
    require(alpha > 0, "dirichlet-alpha", cfg["dirichlet-alpha"], "must be > 0 (smaller = more heterogeneous)")
    lr = _number(cfg, "lr")
    require(lr > 0, "lr", cfg["lr"], "must be > 0")
    momentum = _number(cfg, "momentum")
    require(0 <= momentum < 1, "momentum", cfg["momentum"], "must be in [0, 1)")
    wd = _number(cfg, "weight-decay")
    require(wd >= 0, "weight-decay", cfg["weight-decay"], "must be >= 0")
    target = _number(cfg, "target-accuracy")
    require(0 <= target <= 1, "target-accuracy", cfg["target-accuracy"],
            "must be a fraction in [0, 1] (e.g. 0.8 for 80%)")
    ltf = _number(cfg, "local-test-fraction")
    require(0 <= ltf < 1, "local-test-fraction", cfg["local-test-fraction"], "must be in [0, 1)")
    model = _string(cfg, "model", CHOICES["model"])
    dataset = _string(cfg, "dataset", CHOICES["dataset"])
    partition = _string(cfg, "partition", CHOICES["partition"])
    run_name = _string(cfg, "run-name")
    train_samples = _integer(cfg, "train-samples", 0) if "train-samples" in cfg else 0
    require(dataset != "synthetic" or train_samples == 0, "train-samples", train_samples,
            "only subsamples image datasets; for dataset 'synthetic' set synthetic.max-samples instead")
    require("/" not in run_name and run_name not in (".", ".."), "run-name", run_name,
            "must be a plain folder name without '/'")

    syn = SyntheticConfig()  # the synthetic.* defaults when a key is absent (pyproject equal: tests)
    synthetic = SyntheticConfig(
        alpha=_number(cfg, "synthetic.alpha") if "synthetic.alpha" in cfg else syn.alpha,
        beta=_number(cfg, "synthetic.beta") if "synthetic.beta" in cfg else syn.beta,
        iid=_boolean(cfg, "synthetic.iid") if "synthetic.iid" in cfg else syn.iid,
        max_samples=(_integer(cfg, "synthetic.max-samples", 2)
                     if "synthetic.max-samples" in cfg else syn.max_samples),
        size_mu=_number(cfg, "synthetic.size-mu") if "synthetic.size-mu" in cfg else syn.size_mu,
        min_samples=(_integer(cfg, "synthetic.min-samples", 1)
                     if "synthetic.min-samples" in cfg else syn.min_samples),
        shared_model=(_boolean(cfg, "synthetic.shared-model")
                      if "synthetic.shared-model" in cfg else syn.shared_model),
    )
    for key, spread in (("synthetic.alpha", synthetic.alpha), ("synthetic.beta", synthetic.beta)):
        require(spread >= 0, key, spread, "must be >= 0")
        require(spread <= SYNTHETIC_SPREAD_MAX, key, spread,
                f"must be at most {SYNTHETIC_SPREAD_MAX:g} (FedProx's Synthetic-(alpha, beta) uses 0 to 1; far "
                "larger spreads overflow the generated features and labels)")
    require(not (synthetic.iid and synthetic.shared_model), "synthetic.shared-model",
            synthetic.shared_model, "applies to the non-IID generator only: with synthetic.iid=true "
            "every client already has the same model; set one of them to false")


    straggler_fraction = _number(cfg, "straggler-fraction")
    require(0 <= straggler_fraction < 1, "straggler-fraction", cfg["straggler-fraction"],
            "must be in [0, 1): the share of each cohort that does fewer local epochs")


    gc_mode = _string(cfg, "gc.mode", CHOICES["gc.mode"]) if "gc.mode" in cfg else "auto"
    gc_default = GCConfig()  # the gc.* defaults when a key is absent (pyproject equal: tests/test_defaults.py)
    gc = GCConfig(
        mode=getattr(spec.params, "default_gc_mode", "none") if gc_mode == "auto" else gc_mode,
        lam=_number(cfg, "gc.lambda") if "gc.lambda" in cfg else gc_default.lam,
        global_layers=(_string(cfg, "gc.global-layers") if "gc.global-layers" in cfg
                       else gc_default.global_layers),
        vectors=_string(cfg, "gc.vectors", CHOICES["gc.vectors"]) if "gc.vectors" in cfg else gc_default.vectors,
        weight_decay=(_string(cfg, "gc.weight-decay", CHOICES["gc.weight-decay"])
                      if "gc.weight-decay" in cfg else gc_default.weight_decay),
        global_scope=(_string(cfg, "gc.global-scope", CHOICES["gc.global-scope"])
                      if "gc.global-scope" in cfg else gc_default.global_scope),
    )
    require(gc.global_scope == "split" or gc.mode in ("global", "hybrid"), "gc.global-scope", gc.global_scope,
            f"'all' widens the Global GC of gc.mode='hybrid' (or 'global'); gc.mode='{gc.mode}' has none")
    require(0 <= gc.lam <= 1, "gc.lambda", cfg.get("gc.lambda"), "must be in [0, 1]")

    require(not (gc.mode in ("global", "hybrid") and spec.global_gc_refused), "gc.mode", gc.mode,
            f"is refused with algo='{algo}': {spec.global_gc_refused}; use gc.mode='local' "
            "or 'local-only' (client-side GC only) or 'none'")

    # clip-norm: a number >= 0 (0 = off) or 'auto' = the algorithm params'
    # ``default_clip_norm`` (0 when absent); applied by LocalSolver.run_epochs.
    algo_params = parse_algo_params(spec.params, spec.prefix, cfg)
    clip_norm = cfg["clip-norm"]
    if clip_norm == "auto":
        clip_norm = float(getattr(algo_params, "default_clip_norm", 0.0))
    else:
        require(isinstance(clip_norm, (int, float)) and not isinstance(clip_norm, bool)
                and math.isfinite(clip_norm) and clip_norm >= 0, "clip-norm", clip_norm,
                "must be a number >= 0 (max gradient norm per local step, 0 = off) or 'auto' "
                "(the algorithm's default: 1.0 for fedpm/localnewton, 0 otherwise)")
        clip_norm = float(clip_norm)

    precision = _string(cfg, "precision", CHOICES["precision"]) if "precision" in cfg else "float32"
    init, init_noise, optimality = _optimum_keys(cfg, model, dataset, wd)

    sampler = _string(cfg, "sampler", CHOICES["sampler"])
    straggler_policy = _string(cfg, "straggler-policy", CHOICES["straggler-policy"])
    tracker, tracker_uri = _string(cfg, "tracker", CHOICES["tracker"]), _string(cfg, "tracker-uri")
    if not cfg.get("resume"):  # a resumed run's config is its checkpoint's, which may predate this check
        _refuse_settings_without_effect(cfg, dataset, partition, tracker, tracker_uri)
    cohort_batching = _string(cfg, "cohort-batching", CHOICES["cohort-batching"])
    cohort_chunk = _integer(cfg, "cohort-chunk", 0)
    require(not (cohort_chunk and cohort_batching == "off"), "cohort-chunk", cohort_chunk,
            "sizes the chunks of a batched cohort, which this run does not train (cohort-batching='off'): "
            "remove it, or set cohort-batching='auto' or 'on'")
    return RunConfig(
        algo=algo,
        dataset=dataset,
        model=model,
        partition=partition,
        dirichlet_alpha=alpha,
        num_server_rounds=_integer(cfg, "num-server-rounds", 1),
        # Keep TOML's type: 1 is one client, 1.0 is all of them.
        clients_per_round=cfg["clients-per-round"] if isinstance(cfg["clients-per-round"], int) else cpr,
        local_epochs=_integer(cfg, "local-epochs", 1),
        batch_size=_integer(cfg, "batch-size", 1),
        lr=lr,
        momentum=momentum,
        weight_decay=wd,
        seed=_integer(cfg, "seed", 0, 2**63 - 1),  # torch's and NumPy's seeds take 64 bits
        results_dir=_string(cfg, "results-dir"),
        run_name=run_name,
        target_accuracy=target,
        eval_every=_integer(cfg, "eval-every", 1),
        accl_every=_integer(cfg, "accl-every", 0),
        local_test_fraction=ltf,
        data_dir=_string(cfg, "data-dir"),
        device=_string(cfg, "device", CHOICES["device"]),
        tf32=_boolean(cfg, "tf32") if "tf32" in cfg else False,
        synthetic=synthetic,
        sampler=spec.default_sampler if sampler == "auto" else sampler,
        lr_schedule=_string(cfg, "lr-schedule", CHOICES["lr-schedule"]),
        straggler_fraction=straggler_fraction,
        straggler_policy=spec.default_straggler_policy if straggler_policy == "auto" else straggler_policy,
        stateful_clients=spec.solver.state_copies > 0,
        client_state=_string(cfg, "client-state", CHOICES["client-state"]),
        state_dir=_string(cfg, "state-dir"),
        round_timeout=_positive(cfg, "round-timeout"),
        train_samples=train_samples,
        clip_norm=clip_norm,
        cohort_batching=cohort_batching,
        cohort_chunk=cohort_chunk,
        logical_clients=_integer(cfg, "logical-clients", 0),
        checkpoint_every=_integer(cfg, "checkpoint-every", 0),
        resume=_string(cfg, "resume"),
        tracker=tracker,
        tracker_uri=tracker_uri,
        precision=precision,
        init=init,
        init_noise=init_noise,
        optimality=optimality,
        algo_params=algo_params,
        gc=gc,
        raw=dict(cfg),
    )


#: the ``synthetic.*`` keys and their defaults (:class:`SyntheticConfig`'s, pyproject's)
SYNTHETIC_DEFAULTS = {f"synthetic.{name.replace('_', '-')}": getattr(SyntheticConfig, name)
                      for name in SyntheticConfig.__dataclass_fields__}
#: the partitions whose client split ``dirichlet-alpha`` draws
DIRICHLET_PARTITIONS = ("dirichlet", "dirichlet-unbalanced", "label-sorted")


def _refuse_settings_without_effect(cfg: Mapping[str, Any], dataset: str, partition: str, tracker: str,
                                    tracker_uri: str) -> None:
    """Refuse a data or tracker key set away from its default where this run
    would ignore it, as another algorithm's hyperparameters are
    (:func:`_refuse_other_algorithms_keys`; the run config always holds every
    key, so a key is the user's only when it differs from the default):
    ``dirichlet-alpha`` without a Dirichlet-drawn partition, a
    ``synthetic.*`` key with another dataset, ``tracker-uri`` with
    ``tracker='none'``. Not for a resumed run (the caller skips it): its
    config is its checkpoint's, which ``--resume`` does not let change."""
    resolved = resolve_partition(dataset, partition)
    # a partition the dataset does not have is refused by the data's own check, in its words
    if (partition_available(dataset, partition) and resolved not in DIRICHLET_PARTITIONS
            and cfg["dirichlet-alpha"] != DataConfig.dirichlet_alpha):
        why = ("; dataset='synthetic' is generated client by client, its heterogeneity set by synthetic.alpha "
               "and synthetic.beta" if dataset == "synthetic" else "")
        raise config_error("dirichlet-alpha", cfg["dirichlet-alpha"],
                           f"draws the split of partition='dirichlet', 'dirichlet-unbalanced' or 'label-sorted', "
                           f"which this run does not use (its partition is '{resolved}'){why}: remove it"
                           + ("" if dataset == "synthetic" else ", or set partition='dirichlet'"))
    if dataset != "synthetic":
        for key, default in SYNTHETIC_DEFAULTS.items():
            if key in cfg and cfg[key] != default:
                raise config_error(key, cfg[key], "sets the generated data of dataset='synthetic', which this run "
                                   f"does not use (dataset='{dataset}'): remove it, or set dataset='synthetic'")
    if tracker == "none" and tracker_uri:
        raise config_error("tracker-uri", tracker_uri, "is where tracker='tensorboard' or 'mlflow' writes, and this "
                           "run has tracker='none': remove it, or set tracker='tensorboard' or 'mlflow'")


def _optimum_keys(cfg: Mapping[str, Any], model: str, dataset: str, wd: float) -> tuple[str, float, bool]:
    """``init``, ``init-noise`` and ``optimality``, checked: both need the
    optimum of the run's objective, which is unique only for a strongly convex
    one (``logreg`` with ``weight-decay`` > 0); ``init-noise`` belongs to
    ``init='near-optimum'``."""
    init = _string(cfg, "init", CHOICES["init"]) if "init" in cfg else "seeded"
    noise = _number(cfg, "init-noise") if "init-noise" in cfg else INIT_NOISE_DEFAULT
    require(noise >= 0, "init-noise", cfg.get("init-noise"), "must be >= 0 (the std of the noise added to "
            "each coordinate of the optimum)")
    require(init == "near-optimum" or noise == INIT_NOISE_DEFAULT, "init-noise", cfg.get("init-noise"),
            f"is the noise of init='near-optimum', which this run does not use (init='{init}'): remove it, "
            "or set init='near-optimum'")
    optimality = _boolean(cfg, "optimality") if "optimality" in cfg else False
    if init == "near-optimum" or optimality:
        key, value = ("init", init) if init == "near-optimum" else ("optimality", optimality)
        resolved = default_model(dataset) if model == "auto" else model
        require(resolved == "logreg" and wd > 0, key, value,
                "needs a strongly convex problem, whose optimum is unique: model='logreg' with "
                f"weight-decay > 0 (this run: model='{resolved}', weight-decay={cfg['weight-decay']!r})")
    return init, noise, optimality


_REQUIRED = (
    "algo", "dataset", "model", "partition", "dirichlet-alpha", "num-server-rounds",
    "clients-per-round", "local-epochs", "batch-size", "lr", "momentum", "weight-decay",
    "seed", "results-dir", "run-name", "target-accuracy", "eval-every", "accl-every",
    "local-test-fraction", "data-dir", "device", "sampler", "lr-schedule",
    "straggler-fraction", "straggler-policy", "client-state", "state-dir", "round-timeout",
    "clip-norm", "cohort-batching", "cohort-chunk", "logical-clients", "checkpoint-every", "resume", "tracker", "tracker-uri",
)
