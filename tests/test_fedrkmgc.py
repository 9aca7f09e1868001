"""FedRKMGC (fedrkmgc-relaxation-fast-km.txt, Algorithm 1, appendix D.6).

1. fast-KM / KM coefficients and one correction update by hand (t = 0, 7);
2. the real solver: ``g - delta`` goes through momentum, state update by hand;
3. the ablation table: each variant switches exactly relaxation and the KM kind;
4. the server: relaxation with rho = 1 is the plain mean / FedAvg exactly,
   rho = 1.5 by hand;
5. heterogeneous least squares (full participation): what the correction does.
   With ``delta = raw`` (variants raw / re) the sum of the corrections is
   ``-(beta N / rho) (theta - theta0)``, so the fixed point is the minimizer of
   ``f + beta/(2 rho) ||theta - theta0||^2`` (not of f), independent of the
   local steps and lr, with each client's corrected gradient zero there
   (client drift removed, proximal bias toward theta0 added). The full
   method with the paper's defaults ends closer to the minimizer than FedAvg.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.fedrkmgc import (
    VARIANTS, FedRKMGCSolver, correction_update, fast_km_coefficients, fast_km_update,
    km_coefficients, km_update, paper_round_index, raw_correction, variant_components,
)
from fedaccel.clients.state import ContextState
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse
from fedaccel.registry import get_algorithm
from fedaccel.strategies.base import FedAccelStrategy, Federation
from fedaccel.strategies.fedavg import FedAvgStrategy
from fedaccel.strategies.server_steps import RelaxedAggregation, relax

from fakes import train_config, StubGrid, heterogeneous_least_squares, quadratic_local_steps

pytestmark = pytest.mark.usefixtures("server_identity")

NODES = {0: 101, 1: 102, 2: 103}


def cfg(momentum=0.0, **params):
    overrides = {"algo": "fedrkmgc", "momentum": momentum, "weight-decay": 0.0, "clients-per-round": 3}
    overrides.update({f"fedrkmgc.{k}": v for k, v in params.items()})
    return parse_run_config(fuse(default_run_config(), overrides))


# --------------------------------------------------------------------------- #
# 1. pure rules by hand
# --------------------------------------------------------------------------- #
def test_round_index_is_algorithm1_t():
    assert paper_round_index(1) == 0 and paper_round_index(8) == 7
    with pytest.raises(ValueError):
        paper_round_index(0)


@pytest.mark.parametrize("t, gamma, c1, c2, b", [
    (0, 2.0, 2 / 3, 1 / 3, 1 / 3),
    (7, 2.0, 0.9, 0.8, 0.1),
    (0, 500.0, 502 / 1002, 1 / 501, 500 / 1002),
    (7, 500.0, 516 / 1016, 8 / 508, 500 / 1016),
])
def test_coefficients_by_hand(t, gamma, c1, c2, b):
    assert fast_km_coefficients(t, gamma) == pytest.approx((c1, c2), abs=1e-15)
    assert km_coefficients(t, gamma) == pytest.approx((c1, b), abs=1e-15)
    assert sum(km_coefficients(t, gamma)) == pytest.approx(1.0)
    assert 2 * c1 - c2 == pytest.approx(1.0)  # fixed points of fast KM are kept


DELTA, LOCAL, GLOBAL, RAW_PREV = [1.0, -2.0], [0.5, 1.0], [0.0, 2.0], [0.2, 0.4]


@pytest.mark.parametrize("t, fast, km", [
    (0, [1.3 - 0.2 / 3, -2.6 - 0.4 / 3], [2 / 3 + 0.95 / 3, -4 / 3 - 1.9 / 3]),
    (7, [1.595, -3.83], [0.995, -1.99]),
])
def test_one_correction_update_by_hand(t, fast, km):
    delta, local, glob, raw_prev = (np.array(v) for v in (DELTA, LOCAL, GLOBAL, RAW_PREV))
    raw = raw_correction(delta, local, glob, beta=0.1)
    np.testing.assert_allclose(raw, [0.95, -1.9], atol=1e-15)
    np.testing.assert_allclose(fast_km_update(delta, raw, raw_prev, t, 2.0), fast, atol=1e-14)
    np.testing.assert_allclose(km_update(delta, raw, t, 2.0), km, atol=1e-14)
    np.testing.assert_allclose(correction_update("raw", delta, raw, raw_prev, t, 2.0), raw)
    # appendix D.6: fast KM = KM + (t+1)/(t+1+gamma) (raw - raw_prev)
    np.testing.assert_allclose(fast_km_update(delta, raw, raw_prev, t, 2.0),
                               km_update(delta, raw, t, 2.0) + (t + 1) / (t + 3) * (raw - raw_prev), atol=1e-14)


# --------------------------------------------------------------------------- #
# 2. the real solver
# --------------------------------------------------------------------------- #
def linear(weight):
    model = torch.nn.Linear(2, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight], dtype=torch.float64))
    return model


def saved_state(state):
    got = state.get("fedrkmgc", torch.device("cpu"))
    return got["delta.weight"].numpy()[0], got["raw_prev.weight"].numpy()[0]


def test_solver_first_round_starts_from_zero_state():
    solver = FedRKMGCSolver(cfg(beta=0.1, gamma=2.0))
    model, state = linear(GLOBAL), ContextState(RecordDict())
    solver.begin_round(model, train_config(server_round=1), state)
    model.weight.grad = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    solver.transform_gradients(model)  # delta = 0: gradient unchanged
    assert model.weight.grad.tolist() == [[1.0, 1.0]]
    with torch.no_grad():
        model.weight.copy_(torch.tensor([LOCAL], dtype=torch.float64))
    assert solver.end_round(model, state) == {}
    delta, raw_prev = saved_state(state)
    raw = -0.1 * (np.array(LOCAL) - np.array(GLOBAL))  # delta^0 = 0
    np.testing.assert_allclose(raw_prev, raw, atol=1e-15)
    np.testing.assert_allclose(delta, 2 / 3 * raw, atol=1e-15)  # t=0: c1 (raw + 0) - c2 * 0


def test_corrected_gradient_goes_through_momentum_and_state_update_by_hand():
    """Two SGD steps (lr 0.1, momentum 0.5) on g - delta, then the t=7 fast-KM update."""
    solver = FedRKMGCSolver(cfg(momentum=0.5, beta=0.1, gamma=2.0))
    model, state = linear(GLOBAL), ContextState(RecordDict())
    state.put("fedrkmgc", {"delta.weight": torch.tensor([DELTA], dtype=torch.float64),
                           "raw_prev.weight": torch.tensor([RAW_PREV], dtype=torch.float64)})
    solver.begin_round(model, train_config(server_round=8), state)
    opt = solver.make_optimizer(model, 0.1)
    for g in ([1.0, 1.0], [2.0, 0.0]):
        opt.zero_grad()
        model.weight.grad = torch.tensor([g], dtype=torch.float64)
        solver.transform_gradients(model)
        opt.step()
    # step 1: d=[0,3], buf=[0,3], w=[0,1.7]; step 2: d=[1,2], buf=[1,3.5], w=[-0.1,1.35]
    np.testing.assert_allclose(model.weight.detach().numpy()[0], [-0.1, 1.35], atol=1e-14)
    solver.end_round(model, state)
    delta, raw_prev = saved_state(state)
    np.testing.assert_allclose(raw_prev, [1.01, -1.935], atol=1e-14)
    np.testing.assert_allclose(delta, [0.9 * 2.01 - 0.16, 0.9 * -3.935 - 0.32], atol=1e-14)


# --------------------------------------------------------------------------- #
# 3. the ablation table (section 4.4, appendix D.6)
# --------------------------------------------------------------------------- #
def test_variant_table_matches_paper_rows():
    assert VARIANTS == {
        "raw": (False, "raw"), "re": (True, "raw"), "km": (False, "km"),
        "fast-km": (False, "fast-km"), "re-km": (True, "km"), "full": (True, "fast-km"),
    }
    assert cfg().algo_params.variant == "full"
    with pytest.raises(ConfigError):
        cfg(variant="nope")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_switches_exactly_its_components(variant):
    relaxed, kind = variant_components(variant)
    strategy = get_algorithm("fedrkmgc").build_strategy(cfg(variant=variant, rho=1.5), Federation(dict(NODES)))
    assert strategy.relaxation_rho == (1.5 if relaxed else 1.0)
    # the solver's correction update is exactly the variant's kind
    solver = FedRKMGCSolver(cfg(variant=variant, beta=0.1, gamma=2.0))
    model, state = linear(GLOBAL), ContextState(RecordDict())
    state.put("fedrkmgc", {"delta.weight": torch.tensor([DELTA], dtype=torch.float64),
                           "raw_prev.weight": torch.tensor([RAW_PREV], dtype=torch.float64)})
    solver.begin_round(model, train_config(server_round=8), state)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([LOCAL], dtype=torch.float64))
    solver.end_round(model, state)
    delta, _ = saved_state(state)
    expected = {"raw": [0.95, -1.9], "km": [0.995, -1.99], "fast-km": [1.595, -3.83]}[kind]
    np.testing.assert_allclose(delta, expected, atol=1e-14)


# --------------------------------------------------------------------------- #
# 4. the server step
# --------------------------------------------------------------------------- #

def rec(v):
    return ArrayRecord({"w": Array(np.asarray(v, dtype=np.float32))})


def one_round(strategy, x, models, counts, server_round=1):
    msgs = list(strategy.configure_train(server_round, rec(x), ConfigRecord(), StubGrid(NODES.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    replies = [Message(RecordDict({"arrays": rec(models[p]),
                                   "metrics": MetricRecord({"num-examples": counts[p], "train-loss": 1.0})}),
                       reply_to=by_node[NODES[p]]) for p in range(3)]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return arrays["w"].numpy()


X, MODELS, COUNTS = [1.0, 2.0], [[0.5, 1.0], [2.0, 4.0], [3.5, 1.0]], [10, 30, 60]


def build(**params):
    return get_algorithm("fedrkmgc").build_strategy(cfg(**params), Federation(dict(NODES)))


def test_relaxation_rho_one_is_the_plain_mean_exactly():
    got = one_round(build(rho=1.0), X, MODELS, COUNTS)
    assert got.tolist() == np.mean(np.array(MODELS, dtype=np.float32).astype(np.float64), axis=0).astype(np.float32).tolist()
    assert np.array_equal(relax(np.array(X), np.array([2.0, 2.0]), 1.0), [2.0, 2.0])


def test_relaxation_rho_one_equals_fedavg_exactly_on_any_strategy():
    class RelaxedFedAvg(RelaxedAggregation, FedAvgStrategy):
        pass

    fedavg = FedAvgStrategy(run_cfg=cfg(), federation=Federation(dict(NODES)))
    relaxed = RelaxedFedAvg(run_cfg=cfg(), federation=Federation(dict(NODES)))
    relaxed.relaxation_rho = 1.0
    plain = one_round(fedavg, X, MODELS, COUNTS)
    assert one_round(relaxed, X, MODELS, COUNTS).tolist() == plain.tolist()
    relaxed.relaxation_rho = 1.5
    np.testing.assert_allclose(one_round(relaxed, X, MODELS, COUNTS), -0.5 * np.array(X) + 1.5 * plain, rtol=1e-6)
    assert isinstance(relaxed, FedAccelStrategy)


def test_fedrkmgc_server_unweighted_mean_then_relaxation_by_hand():
    # mean = [2, 2]; (1 - 1.5) [1, 2] + 1.5 [2, 2] = [2.5, 2]
    np.testing.assert_allclose(one_round(build(rho=1.5), X, MODELS, COUNTS), [2.5, 2.0], atol=1e-6)
    # a variant without relaxation uses rho = 1 whatever fedrkmgc.rho says
    np.testing.assert_allclose(one_round(build(rho=1.5, variant="fast-km"), X, MODELS, COUNTS), [2.0, 2.0], atol=1e-6)


def test_round_two_relaxes_against_the_model_it_broadcast_the_relaxed_one():
    """Algorithm 1's theta^{t+1} = (1 - rho) theta^t + rho mean_i theta_i: theta^t
    is the model broadcast in round t, i.e. round t-1's relaxed result, not
    its plain mean. rho = 1.5; round 1 from [1, 2]: mean [2, 2] -> [2.5, 2].
    Round 2 from [2.5, 2], clients [[1, 0], [4, 3], [4, 0]]: mean [3, 1] ->
    -0.5 [2.5, 2] + 1.5 [3, 1] = [3.25, 0.5] (against round 1's mean [2, 2]
    it would be [3.5, 0.5])."""
    strategy = build(rho=1.5)
    first = one_round(strategy, X, MODELS, COUNTS)
    np.testing.assert_allclose(first, [2.5, 2.0], atol=1e-6)
    second = one_round(strategy, first.tolist(), [[1.0, 0.0], [4.0, 3.0], [4.0, 0.0]], COUNTS, server_round=2)
    np.testing.assert_allclose(second, [3.25, 0.5], atol=1e-6)


def test_rho_beyond_two_is_run_as_the_papers_figure_5_does():
    """Appendix D.3 (Figure 5) runs rho in {2.1, ..., 4.0} outside the
    recommended (0, 2]: accepted, and the same rule, by hand:
    (1 - 3) [1, 2] + 3 [2, 2] = [4, 2]. A rho <= 0 is refused in one line."""
    np.testing.assert_allclose(one_round(build(rho=3.0), X, MODELS, COUNTS), [4.0, 2.0], atol=1e-6)
    assert cfg(rho=4.0, gamma=0.1).algo_params.rho == 4.0
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="fedrkmgc.rho"):
            cfg(rho=bad)


# --------------------------------------------------------------------------- #
# 5. heterogeneous least squares, full participation
# --------------------------------------------------------------------------- #
N, D, M = 10, 5, 20


@pytest.fixture(scope="module")
def lsq():
    H, c, z_star, _ = heterogeneous_least_squares(N, D, M)
    return H, c, z_star


def reference(lsq, variant, beta, rho=1.5, gamma=500.0, rounds=200, lr=0.05, steps=5):
    """Algorithm 1 in NumPy through the module's pure rules (theta0 = 0)."""
    H, c, _ = lsq
    relaxed, kind = variant_components(variant)
    x, delta, raw_prev = np.zeros(D), np.zeros((N, D)), np.zeros((N, D))
    for r in range(1, rounds + 1):
        t, ys = paper_round_index(r), []
        for i in range(N):
            y = x.copy()
            for _ in range(steps):
                y = y - lr * (H[i] @ y - c[i] - delta[i])
            raw = raw_correction(delta[i], y, x, beta)
            delta[i], raw_prev[i] = correction_update(kind, delta[i], raw, raw_prev[i], t, gamma), raw
            ys.append(y)
        x = relax(x, np.mean(ys, axis=0), rho if relaxed else 1.0)
    return x, delta


def fedavg(lsq, rounds=200, lr=0.05, steps=5):
    H, c, _ = lsq
    x = np.zeros(D)
    for _ in range(rounds):
        ys = []
        for i in range(N):
            y = x.copy()
            for _ in range(steps):
                y = y - lr * (H[i] @ y - c[i])
            ys.append(y)
        x = np.mean(ys, axis=0)
    return x


def real_solver(lsq, variant, beta, rho=1.5, rounds=15, lr=0.05, steps=5):
    """The real FedRKMGCSolver (state, hooks, end_round) with the loss gradient
    of client i's least squares written into p.grad; server: mean + relax."""
    H, c, _ = lsq
    solver = FedRKMGCSolver(cfg(beta=beta, rho=rho, variant=variant))
    states = [ContextState(RecordDict()) for _ in range(N)]
    model = torch.nn.Linear(D, 1, bias=False, dtype=torch.float64)
    x = np.zeros(D)
    for r in range(1, rounds + 1):
        ys = []
        for i in range(N):
            with torch.no_grad():
                model.weight.copy_(torch.tensor(x[None]))
            solver.begin_round(model, train_config(server_round=r), states[i])
            quadratic_local_steps(solver, model, lr, H[i], c[i], steps)
            solver.end_round(model, states[i])
            ys.append(model.weight.detach().numpy()[0].copy())
        x = relax(x, np.mean(ys, axis=0), solver.cfg.algo_params.effective_rho)
    return x


@pytest.mark.parametrize("variant", ["full", "re-km", "raw"])
def test_real_solver_matches_reference(lsq, variant):
    x_ref, _ = reference(lsq, variant, beta=0.1, rounds=15)
    np.testing.assert_allclose(real_solver(lsq, variant, beta=0.1), x_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant, rho_eff", [("raw", 1.0), ("re", 1.5)])
def test_raw_correction_fixed_point_is_proximal_minimizer_not_local_steps_bias(lsq, variant, rho_eff):
    H, c, z_star = lsq
    beta = 0.3
    target = np.linalg.solve(sum(H) / N + beta / rho_eff * np.eye(D), sum(c) / N)
    x5, delta = reference(lsq, variant, beta, rounds=200, steps=5)
    x2, _ = reference(lsq, variant, beta, rounds=200, steps=2, lr=0.1)
    assert np.linalg.norm(x5 - target) < 1e-6
    assert np.linalg.norm(x2 - target) < 1e-6  # independent of local steps / lr
    # drift removed: each client's corrected gradient vanishes at the global model
    assert max(np.linalg.norm(H[i] @ x5 - c[i] - delta[i]) for i in range(N)) < 1e-4
    # ...but the limit is biased toward theta0 = 0, not the global minimizer
    assert np.linalg.norm(target - z_star) > 0.1
    # FedAvg's limit does depend on the local steps (client drift)
    assert np.linalg.norm(fedavg(lsq, steps=5) - fedavg(lsq, steps=2, lr=0.1)) > 1e-2


def test_full_method_with_paper_defaults_beats_fedavg_bias(lsq):
    _, _, z_star = lsq
    err_avg = np.linalg.norm(fedavg(lsq) - z_star)
    x, _ = reference(lsq, "full", beta=0.03, rounds=200)
    err = np.linalg.norm(x - z_star)
    assert err_avg > 0.1
    assert err < 0.75 * err_avg  # measured: 0.069 vs 0.106 after 200 rounds
