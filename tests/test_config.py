"""Tests of the run configuration: parse_run_config, RunConfig, overrides, registry.

Every case starts from the project's own defaults (pyproject.toml's
``[tool.flwr.app.config]``, flattened) and changes one key, so the tests break
when a default stops being valid and not only when the checks change.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from fedaccel.config import ConfigError, RunConfig, config_literal

from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse, parse_overrides
from fedaccel.registry import algorithm_names, get_algorithm


@pytest.fixture(scope="module")
def defaults() -> dict:
    return default_run_config()


def with_(defaults: dict, **changes) -> dict:
    """Defaults with ``changes`` applied; ``a__b`` stands for key ``a.b``, ``_`` for ``-``."""
    cfg = dict(defaults)
    for key, value in changes.items():
        cfg[key.replace("__", ".").replace("_", "-")] = value
    return cfg


def parse_one(defaults: dict, key: str, value, **extra) -> RunConfig:
    cfg = dict(defaults)
    cfg.update(extra)
    cfg[key] = value
    return parse_run_config(cfg)


# --------------------------------------------------------------------------- #
# defaults
# --------------------------------------------------------------------------- #
def test_defaults_are_valid(defaults):
    cfg = parse_run_config(defaults)
    assert isinstance(cfg, RunConfig)
    assert cfg.algo == defaults["algo"]
    assert cfg.lr == pytest.approx(defaults["lr"])
    assert cfg.num_server_rounds == defaults["num-server-rounds"]
    assert cfg.raw == defaults


@pytest.mark.parametrize("algo", sorted(algorithm_names()))
def test_defaults_are_valid_for_every_algorithm(defaults, algo):
    cfg = parse_one(defaults, "algo", algo)
    assert cfg.algo == algo
    assert isinstance(cfg.algo_params, get_algorithm(algo).params)


def test_missing_key_is_one_line_naming_it(defaults):
    cfg = dict(defaults)
    del cfg["lr"]
    with pytest.raises(ConfigError) as info:
        parse_run_config(cfg)
    msg = str(info.value)
    assert "\n" not in msg
    assert "lr" in msg


# --------------------------------------------------------------------------- #
# one bad value -> one line naming the key and the value
# --------------------------------------------------------------------------- #
BAD_VALUES = [
    # (key, bad value, extra keys needed to make the key matter)
    ("algo", "fedsgd", {}),
    ("dataset", "imagenet", {}),
    ("partition", "pathological", {}),
    ("model", "vgg16", {}),
    ("dirichlet-alpha", 0, {}),
    ("dirichlet-alpha", -1, {}),
    ("lr", 0, {}),
    ("lr", -0.1, {}),
    ("lr", "0.1", {}),  # a string where a number belongs
    ("momentum", 1.0, {}),
    ("weight-decay", -1, {}),
    ("clients-per-round", 0, {}),
    ("clients-per-round", 2.5, {}),
    ("clients-per-round", -1, {}),
    ("target-accuracy", 80, {}),  # a percentage by mistake
    ("local-test-fraction", 1.0, {}),
    ("num-server-rounds", 0, {}),
    ("batch-size", 0, {}),
    ("device", "tpu", {}),
    ("run-name", "a/b", {}),
    ("fedprox.mu", -1, {"algo": "fedprox"}),
    ("fedavgm.server-momentum", 1.5, {"algo": "fedavgm"}),
    ("fedadam.tau", 0, {"algo": "fedadam"}),
    ("train-samples", -1, {"dataset": "digits"}),
    ("train-samples", 100, {}),  # the default dataset is synthetic: not subsampled this way
    ("precision", "float16", {}),
    ("precision", 64, {}),
    ("init", "zeros", {}),
    ("init-noise", -0.1, {"init": "near-optimum", "model": "logreg", "weight-decay": 0.01}),
    ("optimality", "yes", {}),
    ("synthetic.shared-model", "yes", {}),
]


@pytest.mark.parametrize(
    "key,value,extra", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES]
)
def test_bad_value_is_one_line_naming_key_and_value(defaults, key, value, extra):
    with pytest.raises(ConfigError) as info:
        parse_one(defaults, key, value, **extra)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert key in msg, msg
    assert str(value) in msg, msg


def test_a_shared_synthetic_model_is_refused_with_the_iid_variant(defaults):
    with pytest.raises(ConfigError, match="synthetic.shared-model=true: applies to the non-IID"):
        parse_one(defaults, "synthetic.shared-model", True, **{"synthetic.iid": True})
    assert parse_one(defaults, "synthetic.shared-model", True).synthetic.shared_model is True


def test_unknown_algo_lists_the_allowed_names(defaults):
    with pytest.raises(ConfigError) as info:
        parse_one(defaults, "algo", "fedsgd")
    msg = str(info.value)
    for name in ("fedavg", "fedprox", "fedavgm", "fedadam"):
        assert name in msg


def test_target_accuracy_hint_mentions_fraction(defaults):
    with pytest.raises(ConfigError, match="fraction"):
        parse_one(defaults, "target-accuracy", 80)


@pytest.mark.parametrize("value", [True, float("nan"), float("inf")])
def test_lr_rejects_bool_and_non_finite(defaults, value):
    with pytest.raises(ConfigError, match="lr"):
        parse_one(defaults, "lr", value)


@pytest.mark.parametrize("key,value", [
    ("num-server-rounds", 2.5), ("batch-size", "16"), ("local-epochs", True),
    ("seed", -1), ("eval-every", 0), ("accl-every", -1),
])
def test_integer_keys_reject_non_integers(defaults, key, value):
    with pytest.raises(ConfigError) as info:
        parse_one(defaults, key, value)
    assert key in str(info.value)


def test_integral_float_is_accepted_for_integer_keys(defaults):
    cfg = parse_one(defaults, "num-server-rounds", 5.0)
    assert cfg.num_server_rounds == 5 and isinstance(cfg.num_server_rounds, int)


@pytest.mark.parametrize("key", ["fedpm.foof-samples", "fedpm.refresh-every"])
def test_integral_float_is_accepted_for_algorithm_integer_keys(defaults, key):
    """As for the shared integer keys: 3.0 is 3 (an int in the params), 2.5
    is refused in the params' own words."""
    cfg = parse_one(defaults, key, 3.0, algo="fedpm")
    value = getattr(cfg.algo_params, key.split(".")[1].replace("-", "_"))
    assert value == 3 and type(value) is int
    with pytest.raises(ConfigError, match=re.escape(f"{key}=2.5: must be an integer >= 0")):
        parse_one(defaults, key, 2.5, algo="fedpm")


def test_a_resumed_run_is_not_refused_for_keys_it_ignores(defaults):
    """A checkpoint's config may predate the refusal of keys a run ignores
    (``--resume`` lets none of them change): a resumed run reads it as it is;
    the same config without ``resume`` is refused."""
    keys = {**defaults, "dataset": "digits", "partition": "iid", "dirichlet-alpha": 0.1,
            "synthetic.alpha": 0.5, "tracker-uri": "runs"}
    assert parse_run_config({**keys, "resume": "/some/run/checkpoints/round-00003.zip"}).dirichlet_alpha == 0.1
    with pytest.raises(ConfigError, match="dirichlet-alpha=0.1: draws the split"):
        parse_run_config(keys)


def test_fraction_clients_per_round_accepted(defaults):
    assert parse_one(defaults, "clients-per-round", 0.25).clients_per_round == 0.25


def test_algo_param_string_rejected(defaults):
    with pytest.raises(ConfigError, match="fedprox.mu"):
        parse_one(defaults, "fedprox.mu", "0.1", algo="fedprox")


def test_algo_params_are_typed(defaults):
    cfg = parse_one(defaults, "fedprox.mu", 1, algo="fedprox")
    assert cfg.algo_params.mu == 1.0 and isinstance(cfg.algo_params.mu, float)


@pytest.mark.parametrize("name", [".", ".."])
def test_run_name_rejects_dot_folders(defaults, name):
    with pytest.raises(ConfigError, match="run-name"):
        parse_one(defaults, "run-name", name)


# --------------------------------------------------------------------------- #
# cohort_size
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cpr,num_clients,expected", [
    (10, 20, 10),
    (0.25, 20, 5),
    (20, 20, 20),
    (1, 20, 1),  # an integer 1 is a count: one client
    (0.01, 20, 1),  # a tiny fraction still trains one client
])
def test_cohort_size(defaults, cpr, num_clients, expected):
    cfg = parse_one(defaults, "clients-per-round", cpr)
    assert cfg.cohort_size(num_clients) == expected


def test_cohort_size_fraction_one_is_all_clients(defaults):
    cfg = parse_one(defaults, "clients-per-round", 1.0)
    assert cfg.cohort_size(20) == 20


def test_cohort_size_larger_than_federation(defaults):
    cfg = parse_one(defaults, "clients-per-round", 30)
    with pytest.raises(ConfigError) as info:
        cfg.cohort_size(20)
    msg = str(info.value)
    assert "\n" not in msg
    assert "clients-per-round" in msg
    assert "20" in msg
    assert "30" in msg


# --------------------------------------------------------------------------- #
# evaluation schedule
# --------------------------------------------------------------------------- #
def test_is_eval_round(defaults):
    cfg = parse_run_config(with_(defaults, num_server_rounds=10, eval_every=3))
    assert [r for r in range(1, 11) if cfg.is_eval_round(r)] == [3, 6, 9, 10]


def test_is_accl_round(defaults):
    cfg = parse_run_config(with_(defaults, num_server_rounds=25, accl_every=10))
    assert [r for r in range(1, 26) if cfg.is_accl_round(r)] == [10, 20, 25]


def test_accl_every_zero_disables_accl(defaults):
    cfg = parse_run_config(with_(defaults, num_server_rounds=5, accl_every=0))
    assert not any(cfg.is_accl_round(r) for r in range(1, 6))


def test_last_round_is_always_accl_and_eval(defaults):
    cfg = parse_run_config(with_(defaults, num_server_rounds=7, accl_every=5, eval_every=4))
    assert cfg.is_accl_round(7) and cfg.is_eval_round(7)


# --------------------------------------------------------------------------- #
# fedaccel-run overrides
# --------------------------------------------------------------------------- #
def test_fuse_rejects_unknown_key(defaults):
    with pytest.raises(ConfigError, match="learning-rate"):
        fuse(defaults, {"learning-rate": 0.1})
    with pytest.raises(ConfigError, match=r"fedprox.muu \(did you mean 'fedprox.mu'\?\)"):
        fuse(defaults, {"fedprox.muu": 0.1})


def test_fuse_overrides_known_keys(defaults):
    before = dict(defaults)
    out = fuse(defaults, {"lr": 0.2})
    assert out["lr"] == 0.2 and out["algo"] == defaults["algo"]
    assert defaults == before  # the defaults themselves are not modified
    assert set(out) == set(defaults)


def test_parse_overrides_tokens():
    out = parse_overrides(["algo=fedavg", "lr=0.1", "fedprox.mu=0.5"], None, None)
    assert out == {"algo": "fedavg", "lr": 0.1, "fedprox.mu": 0.5}
    assert isinstance(out["lr"], float)


def test_parse_overrides_quoted_string_and_int():
    out = parse_overrides(["algo='fedprox'", "num-server-rounds=3"], None, None)
    assert out == {"algo": "fedprox", "num-server-rounds": 3}


def test_parse_overrides_run_config_string(defaults):
    out = parse_overrides([], "algo='fedprox' lr=1", None)
    assert out == {"algo": "fedprox", "lr": 1}
    assert isinstance(out["lr"], int)
    cfg = parse_run_config(fuse(defaults, out))
    assert cfg.algo == "fedprox"
    assert cfg.lr == 1.0


def test_parse_overrides_tokens_win_over_run_config():
    out = parse_overrides(["lr=0.5"], "lr=1 seed=3", None)
    assert out == {"lr": 0.5, "seed": 3}


def test_parse_overrides_yaml(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("algo: fedprox\nfedprox:\n  mu: 0.1\n")
    assert parse_overrides([], None, str(path)) == {"algo": "fedprox", "fedprox.mu": 0.1}


def test_parse_overrides_token_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lr"], None, None)


# --------------------------------------------------------------------------- #
# registry and pyproject agree
# --------------------------------------------------------------------------- #
def test_registry_has_the_baselines():
    assert set(algorithm_names()) >= {"fedadam", "fedavg", "fedavgm", "fedprox"}
    assert list(algorithm_names()) == sorted(algorithm_names())


def test_get_algorithm_unknown_is_config_error():
    with pytest.raises(ConfigError, match="fedavg"):
        get_algorithm("nope")


@pytest.mark.parametrize("algo", sorted(algorithm_names()))
def test_params_defaults_match_pyproject(defaults, algo):
    spec = get_algorithm(algo)
    assert spec.name == algo
    in_code = {
        f"{spec.prefix}.{f.name.replace('_', '-')}": f.default
        for f in dataclasses.fields(spec.params)
    }
    in_pyproject = {k: v for k, v in defaults.items() if k.startswith(spec.prefix + ".")}
    assert in_code == in_pyproject
    for key, value in in_code.items():
        assert type(value) is type(in_pyproject[key]), key


def test_every_pyproject_table_belongs_to_an_algorithm_or_synthetic(defaults):
    # "gc": the shared gradient-centralization keys (fedaccel.config.GCConfig)
    prefixes = {k.split(".", 1)[0] for k in defaults if "." in k}
    known = {get_algorithm(a).prefix for a in algorithm_names()} | {"synthetic", "gc"}
    assert prefixes <= known


# --------------------------------------------------------------------------- #
# data-side validation reaches the user
# --------------------------------------------------------------------------- #
def test_more_clients_than_samples_is_a_data_error(defaults):
    from fedaccel.data import DataError, load_federated
    from fedaccel.data.sources import load_digits_source
    from fedaccel.runtime import data_config_for

    cfg = parse_run_config(with_(defaults, dataset="digits"))
    n_samples = len(load_digits_source().pool_y)
    with pytest.raises(DataError) as info:
        load_federated(data_config_for(cfg, num_clients=5000))
    msg = str(info.value)
    assert "\n" not in msg
    assert "5000" in msg
    assert re.search(rf"\b{n_samples}\b", msg), msg


# --------------------------------------------------------------------------- #
# precision, init, optimality
# --------------------------------------------------------------------------- #
CONVEX = {"model": "logreg", "weight-decay": 0.01}


def test_precision_init_and_optimality_parse(defaults):
    cfg = parse_run_config(defaults)
    assert (cfg.precision, cfg.init, cfg.init_noise, cfg.optimality) == ("float32", "seeded", 0.1, False)
    cfg = parse_run_config(with_(defaults, precision="float64", init="near-optimum", init_noise=0.5,
                                 optimality=True, **CONVEX))
    assert (cfg.precision, cfg.init, cfg.init_noise, cfg.optimality) == ("float64", "near-optimum", 0.5, True)
    assert cfg.needs_optimum
    # model 'auto' is logreg for breast-cancer: convex with weight decay
    assert parse_run_config(with_(defaults, dataset="breast-cancer", optimality=True, weight_decay=0.01)).optimality


@pytest.mark.parametrize("key,value,extra,says", [
    ("init", "near-optimum", {"weight-decay": 0.01}, "model='mlp'"),  # auto on synthetic is the MLP
    ("optimality", True, {"model": "cnn", "dataset": "digits", "weight-decay": 0.01}, "model='cnn'"),
    ("optimality", True, {"model": "logreg"}, "weight-decay=0.0"),  # convex, not strongly: no unique optimum
    ("init-noise", 0.3, {}, "init='seeded'"),  # the noise of a start this run does not use
])
def test_refused_combinations_are_one_line_naming_the_key_and_the_fix(defaults, key, value, extra, says):
    with pytest.raises(ConfigError) as info:
        parse_one(defaults, key, value, **extra)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"invalid run config: {key}={config_literal(value)}: ") and says in msg
    assert ("model='logreg' with weight-decay > 0" in msg) or ("set init='near-optimum'" in msg)


def test_init_and_optimality_are_refused_on_flowers_engines(defaults):
    """The optimum is computed from every client's training data, which only
    the fast runner's server holds for certain: a Grid without the fast
    runner's client store (Flower's) is refused before anything else."""
    from fakes import StubGrid

    from fedaccel.experiment import run_experiment

    for changes in ({"init": "near-optimum"}, {"optimality": True}):
        with pytest.raises(ConfigError) as info:
            run_experiment(StubGrid([1, 2]), {**defaults, **CONVEX, **changes})
        msg = str(info.value)
        key = next(iter(changes))
        assert "\n" not in msg and msg.startswith(f"invalid run config: {key}=") and "fedaccel-run" in msg


def test_values_in_errors_are_written_as_the_user_writes_them():
    """The values an error shows are TOML, as ``--run-config`` takes them:
    strings quoted, booleans lower case."""
    assert [config_literal(v) for v in (True, False, "fedavg", 0.1, 3)] == ["true", "false", "'fedavg'", "0.1", "3"]
