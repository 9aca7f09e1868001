"""Global GC acts on the aggregated update *before* every server step.

GC-Fed (Algorithm 1, lines 13-15) centralizes the aggregated update of the
global layers, and a server optimizer must consume that centralized update:
its state (momentum, Adam moments, FedACG's lookahead momentum) may never
hold the part GC removes. Two exact checks, for every server step that has
state or scales the update:

- the trajectory with ``gc.mode='global'`` equals the trajectory without GC
  on replies whose updates were centralized by hand (``P`` is linear, so the
  mean of centralized updates is the centralized mean);
- for steps linear in the update (all but Adam), every model sent and every
  new model keeps the row means of the classifier weight of the initial
  model (what the projection preserves).
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.scaffold import DC_RECORD
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config
from fedaccel.registry import get_algorithm
from fedaccel.membership import Federation

from fakes import StubGrid

pytestmark = pytest.mark.usefixtures("server_identity")

NODES = {0: 101, 1: 102, 2: 103}
SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,)}

CASES = [
    ("fedavg", {}),
    ("fedavgm", {"fedavgm.server-momentum": 0.9}),
    ("fedadam", {"fedadam.variant": "paper", "fedadam.server-lr": 0.1}),
    ("fedadam", {"fedadam.variant": "flower", "fedadam.server-lr": 0.1}),
    ("fedacg", {}),
    ("fedacg", {"fedacg.lookahead": False}),
    ("fedrkmgc", {"fedrkmgc.rho": 1.5}),
    ("scaffold", {"scaffold.server-lr": 0.5}),
    ("gcfed", {"gc.lambda": 0.0}),
]


def build(algo: str, gc_mode: str, params: dict):
    cfg = default_run_config()
    cfg.update({"algo": algo, "clients-per-round": 3, "gc.mode": gc_mode, **params})
    return get_algorithm(algo).build_strategy(parse_run_config(cfg), Federation(dict(NODES)))


def centralize_rows(update: np.ndarray) -> np.ndarray:
    """GC's projection of a weight update: every row minus its mean."""
    return update - update.mean(axis=1, keepdims=True) if update.ndim > 1 else update


def run(strategy, rounds: list[list[dict[str, np.ndarray]]], x0: dict[str, np.ndarray],
        centralize_by_hand: bool) -> tuple[list[dict], list[dict]]:
    """Rounds of configure_train + replies + aggregate_train; returns (sent, new) models."""
    x = ArrayRecord({k: Array(v) for k, v in x0.items()})
    sent_models, new_models = [], []
    for server_round, models in enumerate(rounds, start=1):
        msgs = {m.metadata.dst_node_id: m for m in
                strategy.configure_train(server_round, x, ConfigRecord(), StubGrid(NODES.values()))}
        sent = {k: a.numpy().copy() for k, a in strategy.global_arrays.items()}
        sent_models.append(sent)
        replies = []
        for pid, model in enumerate(models):
            if centralize_by_hand:  # w_i -> sent + P(w_i - sent)
                model = {k: sent[k] + centralize_rows(model[k] - sent[k]) for k in model}
            content = RecordDict({
                "arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                "metrics": MetricRecord({"num-examples": 1 + 2 * pid, "train-loss": 1.0}),
            })
            if strategy.run_cfg.algo == "scaffold":
                content[DC_RECORD] = ArrayRecord({k: Array(np.zeros_like(v)) for k, v in model.items()})
            replies.append(Message(content, reply_to=msgs[NODES[pid]]))
        x, _ = strategy.aggregate_train(server_round, replies)
        new_models.append({k: a.numpy().copy() for k, a in x.items()})
    return sent_models, new_models


def random_rounds(num_rounds: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    x0 = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    rounds = [[{k: x0[k] + rng.standard_normal(s) * (1 + r) for k, s in SHAPES.items()} for _ in NODES]
              for r in range(num_rounds)]
    return x0, rounds


@pytest.mark.parametrize("algo,params", CASES, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in CASES])
def test_global_gc_feeds_the_server_step_the_centralized_update(algo, params):
    x0, rounds = random_rounds()
    _, with_gc = run(build(algo, "global", params), rounds, x0, centralize_by_hand=False)
    _, by_hand = run(build(algo, "none", params), rounds, x0, centralize_by_hand=True)
    for r, (a, b) in enumerate(zip(with_gc, by_hand), start=1):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-10, atol=1e-10, err_msg=f"round {r} {k}")


LINEAR_CASES = [(a, p) for a, p in CASES if a != "fedadam"]


@pytest.mark.parametrize("algo,params", LINEAR_CASES,
                         ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in LINEAR_CASES])
def test_global_gc_keeps_the_classifier_row_means_of_every_model(algo, params):
    """Steps linear in the update keep the row means fixed. Adam is not linear
    (it divides by sqrt(v) elementwise): as with GC before Adam in centralized
    training, its step is not centralized, only its input is (test above)."""
    x0, rounds = random_rounds(num_rounds=10, seed=1)
    sent, new = run(build(algo, "global", params), rounds, x0, centralize_by_hand=False)
    want = x0["fc.weight"].mean(axis=1)
    for r, model in enumerate(sent + new):
        np.testing.assert_allclose(model["fc.weight"].mean(axis=1), want, rtol=0, atol=1e-12,
                                   err_msg=f"model {r}")


@pytest.mark.parametrize("algo", ["fedcdr", "feddr"])
@pytest.mark.parametrize("mode", ["global", "hybrid"])
def test_global_gc_is_refused_where_it_breaks_a_two_sided_invariant(algo, mode):
    """DR: the server model x itself must equal mean(xhat_i), which the
    clients build from uncentralized steps, so centralizing the server's
    update would break it: refused with the reason, local GC allowed.
    (FedDyn is not refused: both sides build h = mean(grad_prev_i) from the
    model that was sent, whatever it is; tests/test_state_protocol.py checks
    it with global GC.)"""
    from fedaccel.config import ConfigError

    cfg = default_run_config()
    cfg.update({"algo": algo, "gc.mode": mode})
    with pytest.raises(ConfigError, match=rf"gc.mode='{mode}': is refused with algo='{algo}': .*mean.*"
                                          r"use gc.mode='local'"):
        parse_run_config(cfg)
    cfg["gc.mode"] = "local"
    assert parse_run_config(cfg).gc.mode == "local"
