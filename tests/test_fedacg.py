"""FedACG (Algorithm 1): server algebra by hand, the FedAvg / FedAvgM relations,
the Table 4 switches and the client's pull toward the broadcast model.

Strategies are driven with real Flower messages (as in tests/test_strategy_base.py):
``configure_train`` -> hand-made replies -> ``aggregate_train``.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.fedacg import FedACGSolver
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config
from fedaccel.registry import get_algorithm
from fedaccel.membership import Federation

from fakes import train_config, StubGrid

pytestmark = pytest.mark.usefixtures("server_identity")

NODES = {0: 101, 1: 102, 2: 103}



def run_cfg(algo: str, **changes):
    cfg = default_run_config()
    cfg.update({"algo": algo, "clients-per-round": 3, "momentum": 0.0, "weight-decay": 0.0})
    cfg.update(changes)
    return parse_run_config(cfg)


def build(algo: str, **changes):
    return get_algorithm(algo).build_strategy(run_cfg(algo, **changes), Federation(dict(NODES)))


def record(named: dict, dtype=np.float64) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=dtype)) for k, v in named.items()})


def to_np(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in rec.items()}


def one_round(strategy, server_round, model: ArrayRecord, client_models, counts):
    """Returns (the arrays sent, the new global model)."""
    msgs = list(strategy.configure_train(server_round, model, ConfigRecord(), StubGrid(NODES.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    sent = to_np(msgs[0].content["arrays"])
    replies = [
        Message(RecordDict({"arrays": cm, "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0})}),
                reply_to=by_node[NODES[pid]])
        for pid, (cm, n) in enumerate(zip(client_models, counts))
    ]
    out, _ = strategy.aggregate_train(server_round, replies)
    return sent, out


# --------------------------------------------------------------------------- #
# server algebra by hand
# --------------------------------------------------------------------------- #
COUNTS = [1, 1, 2]
ROUND1 = [{"w": [1.0, 2.0]}, {"w": [2.0, 4.0]}, {"w": [4.0, -2.0]}]
ROUND2 = [{"w": [3.0, 0.0]}, {"w": [1.0, 1.0]}, {"w": [0.0, 2.0]}]


def test_two_rounds_by_hand_weighted():
    """lam = 0.5, omega = (1, 1, 2)/4, theta0 = (0, 1).

    r1: sent theta0 = (0, 1); mean (2.75, 0.5); Delta1 = (2.75, -0.5) = m1;
        theta1 = theta0 + m1 = (2.75, 0.5).
    r2: sent theta1 + 0.5 m1 = (4.125, 0.25); mean (1, 1.25);
        Delta2 = (-3.125, 1); m2 = 0.5 m1 + Delta2 = (-1.75, 0.75);
        theta2 = theta1 + m2 = (1, 1.25).
    r3: sent theta2 + 0.5 m2 = (0.125, 1.625).
    """
    s = build("fedacg", **{"fedacg.lam": 0.5})
    sent1, out1 = one_round(s, 1, record({"w": [0.0, 1.0]}), [record(m) for m in ROUND1], COUNTS)
    np.testing.assert_array_equal(sent1["w"], [0.0, 1.0])
    np.testing.assert_allclose(out1["w"].numpy(), [2.75, 0.5], rtol=0, atol=1e-15)
    np.testing.assert_allclose(s.momentum["w"], [2.75, -0.5], rtol=0, atol=1e-15)
    sent2, out2 = one_round(s, 2, out1, [record(m) for m in ROUND2], COUNTS)
    np.testing.assert_allclose(sent2["w"], [4.125, 0.25], rtol=0, atol=1e-15)
    np.testing.assert_allclose(s.momentum["w"], [-1.75, 0.75], rtol=0, atol=1e-15)
    np.testing.assert_allclose(out2["w"].numpy(), [1.0, 1.25], rtol=0, atol=1e-15)
    sent3, _ = one_round(s, 3, out2, [record(m) for m in ROUND1], COUNTS)
    np.testing.assert_allclose(sent3["w"], [0.125, 1.625], rtol=0, atol=1e-15)


def test_two_rounds_by_hand_uniform_weighting():
    """weighting='uniform' (authors' code): r1 mean (7/3, 4/3) = theta1; m1 = Delta1.

    r1: Delta1 = (7/3, 1/3); theta1 = (7/3, 4/3).
    r2: sent theta1 + 0.5 m1 = (3.5, 1.5); mean (4/3, 1); Delta2 = (-13/6, -0.5);
        m2 = (7/6 - 13/6, 1/6 - 1/2) = (-1, -1/3); theta2 = theta1 + m2 = (4/3, 1).
    """
    s = build("fedacg", **{"fedacg.lam": 0.5, "fedacg.weighting": "uniform"})
    _, out1 = one_round(s, 1, record({"w": [0.0, 1.0]}), [record(m) for m in ROUND1], COUNTS)
    np.testing.assert_allclose(out1["w"].numpy(), [7 / 3, 4 / 3], rtol=1e-15)
    sent2, out2 = one_round(s, 2, out1, [record(m) for m in ROUND2], COUNTS)
    np.testing.assert_allclose(sent2["w"], [3.5, 1.5], rtol=1e-15)
    np.testing.assert_allclose(s.momentum["w"], [-1.0, -1 / 3], rtol=1e-14)
    np.testing.assert_allclose(out2["w"].numpy(), [4 / 3, 1.0], rtol=1e-14)


# --------------------------------------------------------------------------- #
# relations to FedAvg and FedAvgM, compared bit for bit
# --------------------------------------------------------------------------- #
def random_rounds(seed: int, rounds: int, dtype):
    rng = np.random.default_rng(seed)
    x0 = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(3)}
    models = [[{k: v + rng.standard_normal(v.shape) for k, v in x0.items()} for _ in range(3)]
              for _ in range(rounds)]
    return record(x0, dtype), [[record(m, dtype) for m in ms] for ms in models]


def trajectory(strategy, x0, rounds, counts=(3, 5, 8)):
    sent_all, out_all, model = [], [], x0
    for r, models in enumerate(rounds, start=1):
        sent, model = one_round(strategy, r, model, models, list(counts))
        sent_all.append(sent)
        out_all.append(to_np(model))
    return sent_all, out_all


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lam_zero_beta_zero_is_fedavg_exactly(dtype):
    x0, rounds = random_rounds(0, 3, dtype)
    sent_a, out_a = trajectory(build("fedacg", **{"fedacg.lam": 0.0, "fedacg.beta": 0.0}), x0, rounds)
    sent_b, out_b = trajectory(build("fedavg"), x0, rounds)
    for a, b in zip(sent_a + out_a, sent_b + out_b):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
            assert a[k].dtype == b[k].dtype


def test_no_momentum_no_lookahead_is_fedavg_exactly():
    """Table 4's first row (no component) is FedAvg, whatever lam."""
    x0, rounds = random_rounds(1, 3, np.float64)
    _, out_a = trajectory(build("fedacg", **{"fedacg.server-momentum": False, "fedacg.lookahead": False,
                                             "fedacg.beta": 0.0}), x0, rounds)
    _, out_b = trajectory(build("fedavg"), x0, rounds)
    for a, b in zip(out_a, out_b):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("lam", [0.5, 0.85])
def test_lookahead_off_beta_zero_is_fedavgm_exactly(lam):
    """Flower's FedAvgM (server lr 1, momentum lam): v = lam v + (x - mean), x = x - v.
    FedACG without lookahead: m = lam m + (mean - x), x = x + m; v = -m bit for bit."""
    x0, rounds = random_rounds(2, 3, np.float64)
    acg = build("fedacg", **{"fedacg.lam": lam, "fedacg.lookahead": False, "fedacg.beta": 0.0})
    avgm = build("fedavgm", **{"fedavgm.server-lr": 1.0, "fedavgm.server-momentum": lam})
    sent_a, out_a = trajectory(acg, x0, rounds)
    sent_b, out_b = trajectory(avgm, x0, rounds)
    for a, b in zip(sent_a + out_a, sent_b + out_b):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for k, v in acg.momentum.items():
        np.testing.assert_array_equal(v, -avgm.velocity[k])


def test_lookahead_changes_what_is_sent():
    """With the lookahead the round-2 broadcast is theta1 + lam m1, not FedAvgM's theta1."""
    x0, rounds = random_rounds(3, 2, np.float64)
    sent_a, out_a = trajectory(build("fedacg", **{"fedacg.lam": 0.85}), x0, rounds)
    sent_b, out_b = trajectory(build("fedavgm", **{"fedavgm.server-momentum": 0.85}), x0, rounds)
    np.testing.assert_array_equal(sent_a[0]["w"], sent_b[0]["w"])
    # round 1: m0 = 0, same model up to round-off (FedACG returns the mean itself,
    # FedAvgM x - (x - mean))
    np.testing.assert_allclose(out_a[0]["w"], out_b[0]["w"], rtol=1e-14, atol=1e-15)
    m1 = out_a[0]["w"] - x0["w"].numpy()
    np.testing.assert_allclose(sent_a[1]["w"], out_a[0]["w"] + 0.85 * m1, rtol=1e-14)
    assert not np.allclose(sent_a[1]["w"], sent_b[1]["w"])


def test_float32_model_keeps_its_dtype():
    x0, rounds = random_rounds(4, 3, np.float32)
    sent, out = trajectory(build("fedacg"), x0, rounds)
    assert all(a[k].dtype == np.float32 for a in sent + out for k in a)


# --------------------------------------------------------------------------- #
# config and Table 4 switches
# --------------------------------------------------------------------------- #
def test_defaults():
    p = run_cfg("fedacg").algo_params
    assert (p.lam, p.beta, p.server_momentum, p.lookahead, p.local_regularizer, p.weighting) == (
        0.85, 0.01, True, True, True, "examples")
    assert run_cfg("fedacg").gc.mode == "none"


@pytest.mark.parametrize("key,value", [
    ("fedacg.lam", 1.0), ("fedacg.lam", -0.1), ("fedacg.beta", -1.0),
    ("fedacg.weighting", "median"), ("fedacg.server-momentum", False),  # lookahead still on
])
def test_bad_values_are_one_line_errors(key, value):
    with pytest.raises(ConfigError) as info:
        run_cfg("fedacg", **{key: value})
    assert key.split(".")[0] in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- #
# client: pull toward the broadcast model
# --------------------------------------------------------------------------- #
def solver(**changes) -> FedACGSolver:
    return FedACGSolver(run_cfg("fedacg", **changes))


def linear(weight) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
    return model


def test_client_adds_beta_times_distance_to_broadcast():
    s = solver(**{"fedacg.beta": 0.5})
    model = linear([[1.0, 2.0]])  # the received (broadcast) model
    s.begin_round(model, train_config(), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))
    model.weight.grad = torch.tensor([[0.1, 0.2]])
    s.transform_gradients(model)
    # 0.1 + 0.5 (3 - 1), 0.2 + 0.5 (-1 - 2): the gradient of beta/2 ||w - b||^2
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.1, -1.3]]))


@pytest.mark.parametrize("changes", [{"fedacg.local-regularizer": False}, {"fedacg.beta": 0.0}])
def test_client_without_regularizer_leaves_gradient(changes):
    s = solver(**{"fedacg.beta": 0.5, **changes})
    model = linear([[1.0, 2.0]])
    s.begin_round(model, train_config(), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))
    model.weight.grad = torch.tensor([[0.1, 0.2]])
    s.transform_gradients(model)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.1, 0.2]]))
