"""FedAvg / FedAvgM / FedAdam server algebra (``fedaccel/strategies/fedavg.py``,
``fedavgm.py``, ``fedadam.py``) checked against values computed by hand and
against Flower's own strategies.

Strategies are built through the registry (``spec.build_strategy``) so the
run-config -> Flower-kwargs wiring is exercised too; replies are real Flower
``Message`` objects built as ``reply_to`` the instructions the strategy made.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fakes import NODES, StubGrid, arrays, build, by_node, configure, reply

pytestmark = pytest.mark.usefixtures("server_identity")


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #

def to_np(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def train_round(strategy, server_round, x, client_models, counts, losses=None):
    """configure_train + replies (client i = partition i) + aggregate_train."""
    msgs = by_node(configure(strategy, server_round, arrays(**x)))
    losses = losses or [1.0] * len(counts)
    replies = [
        reply(msgs[NODES[pid]], n, loss, **model)
        for pid, (model, n, loss) in enumerate(zip(client_models, counts, losses))
    ]
    return strategy.aggregate_train(server_round, replies)


# --------------------------------------------------------------------------- #
# FedAvg / FedAvgM / FedAdam server algebra
# --------------------------------------------------------------------------- #
def test_fedavg_weighted_mean():
    strategy = build("fedavg")
    out, metrics = train_round(
        strategy, 1, {"w": [0.0]}, [{"w": [1.0]}, {"w": [2.0]}, {"w": [4.0]}], [1, 1, 2],
        losses=[1.0, 2.0, 3.0],
    )
    np.testing.assert_allclose(out["w"].numpy(), [2.75], rtol=1e-12)
    # train-loss is example-weighted: (1 + 2 + 2*3) / 4
    assert metrics["train-loss"] == pytest.approx(2.25)
    assert strategy.rounds[1].train_loss == pytest.approx(2.25)


def test_fedavgm_without_momentum_is_a_server_lr_step_by_hand():
    """beta = 0, eta = 0.5: x <- x - 0.5 (x - mean), no velocity kept.
    x = [0, 1], mean (weights 1, 1, 2) = [2.75, 0.5] -> [1.375, 0.75]; the
    next round starts again from its own pseudo-gradient: x = [1.375, 0.75],
    mean [1.0, 1.25] -> [1.1875, 1.0]."""
    strategy = build("fedavgm", **{"fedavgm.server-lr": 0.5, "fedavgm.server-momentum": 0.0})
    counts = [1, 1, 2]
    out1, _ = train_round(strategy, 1, {"w": np.array([0.0, 1.0])},
                          [{"w": [1.0, 2.0]}, {"w": [2.0, 4.0]}, {"w": [4.0, -2.0]}], counts)
    np.testing.assert_allclose(out1["w"].numpy(), [1.375, 0.75], rtol=1e-7)
    out2, _ = train_round(strategy, 2, to_np(out1), [{"w": [1.0, 1.0]}, {"w": [3.0, 1.0]}, {"w": [0.0, 1.5]}],
                          counts)
    np.testing.assert_allclose(out2["w"].numpy(), [1.1875, 1.0], rtol=1e-7)


def test_fedavgm_two_rounds_by_hand():
    strategy = build("fedavgm", **{"fedavgm.server-lr": 1.0, "fedavgm.server-momentum": 0.5})
    assert strategy.params.server_momentum == 0.5 and strategy.params.server_lr == 1.0
    counts = [1, 1, 2]
    x0 = {"w": np.array([0.0, 1.0]), "b": np.array([0.5])}
    round1 = [{"w": [1.0, 2.0], "b": [1.0]}, {"w": [2.0, 4.0], "b": [0.0]},
              {"w": [4.0, -2.0], "b": [2.0]}]
    round2 = [{"w": [3.0, 0.0], "b": [-1.0]}, {"w": [1.0, 1.0], "b": [0.0]},
              {"w": [0.0, 2.0], "b": [4.0]}]

    def mean(models):
        return {k: sum(n * np.asarray(m[k]) for m, n in zip(models, counts)) / sum(counts)
                for k in x0}

    out1, _ = train_round(strategy, 1, x0, round1, counts)
    m1 = mean(round1)
    v1 = {k: x0[k] - m1[k] for k in x0}  # first round: v = pseudo-gradient
    x1 = {k: x0[k] - 1.0 * v1[k] for k in x0}
    for k in x0:
        np.testing.assert_allclose(out1[k].numpy(), x1[k], rtol=1e-7)

    out2, _ = train_round(strategy, 2, to_np(out1), round2, counts)
    m2 = mean(round2)
    v2 = {k: 0.5 * v1[k] + (x1[k] - m2[k]) for k in x0}
    x2 = {k: x1[k] - 1.0 * v2[k] for k in x0}
    for k in x0:
        np.testing.assert_allclose(out2[k].numpy(), x2[k], rtol=1e-7)
    # momentum really mattered: plain FedAvg would have returned m2
    assert not np.allclose(out2["w"].numpy(), m2["w"])


def test_fedadam_flower_variant_two_rounds_by_hand():
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    strategy = build("fedadam", **{"fedadam.server-lr": eta, "fedadam.beta1": b1,
                                   "fedadam.beta2": b2, "fedadam.tau": tau,
                                   "fedadam.variant": "flower"})
    counts = [3, 1, 1]
    x = np.array([0.0, 1.0, -2.0])
    rounds = [
        [[1.0, 1.0, 0.0], [2.0, 0.0, -2.0], [-1.0, 2.0, -4.0]],
        [[0.5, 0.5, 0.5], [0.0, 3.0, -1.0], [1.0, 1.0, 1.0]],
    ]
    m = np.zeros(3)
    v = np.zeros(3)
    for server_round, models in enumerate(rounds, start=1):
        out, _ = train_round(strategy, server_round, {"w": x},
                             [{"w": mdl} for mdl in models], counts)
        mean = sum(n * np.asarray(mdl) for mdl, n in zip(models, counts)) / sum(counts)
        delta = mean - x
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta**2
        # Flower's bias-corrected server lr uses server_round + 1
        eta_norm = eta * math.sqrt(1 - b2 ** (server_round + 1)) / (1 - b1 ** (server_round + 1))
        x = x + eta_norm * m / (np.sqrt(v) + tau)
        np.testing.assert_allclose(out["w"].numpy(), x, rtol=1e-7)


def test_fedadam_paper_variant_is_reddi_algorithm_2_by_hand():
    """Algorithm 2 of "Adaptive Federated Optimization": unweighted mean,
    v_{-1} = tau^2, no bias correction. Hand values for round 1 with
    Delta = (1, -2) (counts must not matter): m = 0.1 Delta,
    v = 0.99 * 1e-6 + 0.01 Delta^2, x += 0.1 m / (sqrt(v) + 1e-3)."""
    strategy = build("fedadam", **{"fedadam.server-lr": 0.1, "fedadam.beta1": 0.9,
                                   "fedadam.beta2": 0.99, "fedadam.tau": 1e-3})
    assert strategy.params.variant == "paper"  # the default
    x = np.array([0.0, 1.0])
    models = [[2.0, -3.0], [0.0, 1.0]]  # unweighted mean (1, -1): Delta = (1, -2)
    out, _ = train_round(strategy, 1, {"w": x}, [{"w": m} for m in models], [9, 1])
    m1 = np.array([0.1, -0.2])
    v1 = np.array([0.99e-6 + 0.01 * 1.0, 0.99e-6 + 0.01 * 4.0])
    x1 = x + 0.1 * m1 / (np.sqrt(v1) + 1e-3)
    np.testing.assert_allclose(out["w"].numpy(), x1, rtol=1e-12)
    # round 2: Delta = (0, 0) -> m and v decay, the step keeps going
    out2, _ = train_round(strategy, 2, {"w": x1}, [{"w": x1}, {"w": x1}], [1, 1])
    m2, v2 = 0.9 * m1, 0.99 * v1
    np.testing.assert_allclose(out2["w"].numpy(), x1 + 0.1 * m2 / (np.sqrt(v2) + 1e-3), rtol=1e-12)


def test_fedadam_flower_variant_step_ratio_to_algorithm_2():
    """The documented first-round ratio: Flower's step is sqrt(1-b2^2)/(1-b1^2)
    of Algorithm 2's when |Delta| >> tau (0.742 at b1=0.9, b2=0.99)."""
    steps = {}
    for variant in ("paper", "flower"):
        strategy = build("fedadam", **{"fedadam.variant": variant, "fedadam.tau": 1e-9})
        out, _ = train_round(strategy, 1, {"w": np.zeros(1)}, [{"w": [1.0]}] * 3, [1, 1, 1])
        steps[variant] = float(out["w"].numpy()[0])
    assert steps["flower"] / steps["paper"] == pytest.approx(math.sqrt(1 - 0.99**2) / (1 - 0.9**2), rel=1e-6)


@pytest.mark.parametrize("algo,flower_cls,kwargs", [
    ("fedavgm", "FedAvgM", {"fedavgm.server-lr": 0.7, "fedavgm.server-momentum": 0.6}),
    ("fedadam", "FedAdam", {"fedadam.variant": "flower", "fedadam.server-lr": 0.05}),
])
def test_server_optimizer_bit_identical_to_flowers_strategy(algo, flower_cls, kwargs):
    """Our server steps replace Flower's FedAvgM/FedAdam (which fuse mean and
    step, leaving no room for GC before the step); on float32 models over three
    rounds they give Flower's bytes exactly."""
    import flwr.serverapp.strategy as flower

    strategy = build(algo, **kwargs)
    p = strategy.params
    if algo == "fedavgm":
        ref = flower.FedAvgM(server_learning_rate=p.server_lr, server_momentum=p.server_momentum)
    else:
        ref = flower.FedAdam(eta=p.server_lr, beta_1=p.beta1, beta_2=p.beta2, tau=p.tau)
    rng = np.random.default_rng(3)
    x = ArrayRecord({"w": Array(rng.standard_normal(16).astype(np.float32)),
                     "b": Array(rng.standard_normal(4).astype(np.float32))})
    y_ref = x
    for server_round in (1, 2, 3):
        msgs = by_node(configure(strategy, server_round, x))
        ref_msgs = list(ref.configure_train(server_round, y_ref, ConfigRecord(), StubGrid(NODES.values())))
        replies, ref_replies = [], []
        for pid, node in NODES.items():
            content = {"w": (rng.standard_normal(16)).astype(np.float32),
                       "b": (rng.standard_normal(4)).astype(np.float32)}
            for target, out in ((msgs[node], replies), (next(m for m in ref_msgs
                                                                if m.metadata.dst_node_id == node), ref_replies)):
                out.append(Message(RecordDict({
                    "arrays": ArrayRecord({k: Array(v) for k, v in content.items()}),
                    "metrics": MetricRecord({"num-examples": 1 + pid})}), reply_to=target))
        x, _ = strategy.aggregate_train(server_round, replies)
        y_ref, _ = ref.aggregate_train(server_round, ref_replies)
        # Flower's FedAdam promotes to float64; we send the model's float32 (as
        # FedAccelStrategy._keep_dtypes does), so the reference gets that too
        y_ref = ArrayRecord({k: Array(a.numpy().astype(np.float32)) for k, a in y_ref.items()})
        for k in ("w", "b"):
            assert x[k].numpy().tobytes() == y_ref[k].numpy().tobytes()
