"""FedNova (Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization", NeurIPS 2020,
arXiv:2007.07481); equation numbers are the paper's main text.

- the client's ``||a||_1`` (Section 4.1): ``tau`` for plain SGD,
  ``[tau - rho (1 - rho^tau)/(1 - rho)]/(1 - rho)`` with momentum, by hand,
  both on injected gradients (where the displacement is checked against
  ``eta G a`` with the hand-computed ``a``) and through the shared loop;
- the server rule (eq. (11), ``tau_eff = sum_i p_i ||a_i||_1``) on tiny arrays
  by hand, with unequal ``||a_i||_1`` and ``n_i``; malformed ``a``-norms rejected;
- the objective inconsistency on heterogeneous least squares with unequal
  local step counts, through the real strategies and solvers (below);
- short seeded runs through the fast runner, with stragglers doing partial
  work (``straggler-policy='partial'``).

Objective inconsistency, what is exact and what is first order.
Client i: f_i(z) = 0.5 z^T H_i z - c_i^T z (fakes.heterogeneous_least_squares),
tau_i local GD steps (exact gradients) with step size eta and momentum rho,
weights p_i = n_i / n; the goal is z* = argmin sum_i p_i f_i.

A client's round is affine in the received x: y_i = A_i x + b_i (computed below
by running the same recursion on matrices), so both methods' fixed points have
closed forms:

- FedAvg, x = sum_i p_i y_i:                 sum_i p_i (x - y_i) = 0;
- FedNova, eq. (11):                         sum_i p_i (x - y_i) / ||a_i||_1 = 0.

With x - y_i = eta ||a_i||_1 H_i (x - x_i*) + O(eta^2) (x_i* the local
minimizer), FedAvg's fixed point tends, as eta -> 0, to the minimizer of the
surrogate sum_i p_i ||a_i||_1 f_i (eq. (3)/Lemma 1, Theorem 1 with eq. (6)'s
w_i), which is far from z*; FedNova's tends to z* itself (w_i = p_i). Neither
fixed point is exactly z* at a finite eta: the O(eta^2) term of x - y_i (for GD,
-eta^2 (tau_i - 1) tau_i / 2 H_i^2 (x - x_i*)) differs between clients. So the
tests check, exactly (1e-9 and below), that the real strategies and solvers
reach / keep these closed-form fixed points, and then the paper's claim in the
form the math allows: FedNova's error is first order in eta (halving eta halves
it; for GD, x_N(eta) = z* + eta v + O(eta^2) with v computed by hand), while
FedAvg's stays at the surrogate's distance from z* (> 1 here) for every eta.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.base import TrainData
from fedaccel.clients.fednova import A_NORM_KEY, A_NORM_RECORD, FedNovaSolver, a_norm_record, normalizing_factor
from fedaccel.clients.state import ContextState
from fedaccel.contract import train_config_record
from fedaccel.local_run import default_run_config, fuse, run_local
from fedaccel.membership import Federation
from fedaccel.registry import get_algorithm
from fedaccel.run_config import parse_run_config
from fedaccel.torch_utils import payload_bytes
from fedaccel.strategies.fednova import normalized_average

from fakes import StubGrid, heterogeneous_least_squares, quadratic_local_steps, train_config

pytestmark = pytest.mark.usefixtures("server_identity")

F64 = torch.float64


def cfg(algo="fednova", momentum=0.0, wd=0.0, **extra):
    return parse_run_config(fuse(default_run_config(), {"algo": algo, "momentum": momentum,
                                                         "weight-decay": wd, **extra}))


def linear(weight, dtype=F64):
    model = torch.nn.Linear(len(weight), 1, bias=False, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight], dtype=dtype))
    return model


def a_norm(extra) -> float:
    values = extra[A_NORM_RECORD][A_NORM_KEY].numpy()
    assert values.shape == (1,) and values.dtype == np.float64
    return float(values[0])


# --------------------------------------------------------------------------- #
# client: ||a||_1
# --------------------------------------------------------------------------- #
GRADS = [[1.0, 1.0], [2.0, 0.0], [-1.0, 3.0]]


def injected_steps(momentum, wd, lr=0.1):
    """Three steps of the real solver and its optimizer from w0 = [0, 2] with
    the gradients GRADS put in p.grad; returns (final weights, extra records)."""
    solver = FedNovaSolver(cfg(momentum=momentum, wd=wd))
    model, state = linear([0.0, 2.0]), ContextState(RecordDict())
    solver.begin_round(model, train_config(lr=lr), state)
    opt = solver.make_optimizer(model, lr)
    for g in GRADS:
        opt.zero_grad()
        model.weight.grad = torch.tensor([g], dtype=F64)
        solver.transform_gradients(model)
        opt.step()
    solver.local_steps = len(GRADS)  # what close_round() sets from the trainer's report
    return model.weight.detach().numpy()[0], solver.end_round(model, state)


def test_plain_sgd_a_norm_is_the_step_count():
    """rho = 0: a = [1, 1, 1], ||a||_1 = tau = 3; y = x - lr (g0 + g1 + g2) = [0, 2] - 0.1 [2, 4]."""
    y, extra = injected_steps(momentum=0.0, wd=0.0)
    np.testing.assert_allclose(y, [-0.2, 1.6], atol=1e-15)
    assert a_norm(extra) == 3.0
    assert list(extra) == [A_NORM_RECORD]


def test_momentum_a_norm_by_hand():
    """rho = 0.5, tau = 3 (torch: v = rho v + g, w -= lr v, v0 = g0):
    a = [1 - rho^3, 1 - rho^2, 1 - rho] / (1 - rho) = [1.75, 1.5, 1], ||a||_1 = 4.25
    = [3 - 0.5 (1 - 0.125)/0.5] / 0.5. The displacement is lr G a:
    x - y = 0.1 (1.75 [1,1] + 1.5 [2,0] + 1 [-1,3]) = [0.375, 0.475]."""
    y, extra = injected_steps(momentum=0.5, wd=0.0)
    np.testing.assert_allclose(y, [-0.375, 1.525], atol=1e-15)
    assert a_norm(extra) == pytest.approx(4.25, abs=1e-15)


def test_weight_decay_changes_the_gradients_not_a():
    """rho = 0.5, wd = 0.5: the steps use d_k = g_k + wd w_k, and x - y = lr (1.75 d0 + 1.5 d1 + d2)
    with the same a. By hand: d0 = [1, 2], w1 = [-0.1, 1.8]; d1 = [1.95, 0.9], v = [2.45, 1.9],
    w2 = [-0.345, 1.61]; d2 = [-1.1725, 3.805], v = [0.0525, 4.755], w3 = [-0.35025, 1.1345];
    0.1 (1.75 [1,2] + 1.5 [1.95,0.9] + [-1.1725,3.805]) = [0.35025, 0.8655] = w0 - w3."""
    y, extra = injected_steps(momentum=0.5, wd=0.5)
    np.testing.assert_allclose(y, [-0.35025, 1.1345], atol=1e-14)
    assert a_norm(extra) == pytest.approx(4.25, abs=1e-15)


@pytest.mark.parametrize("epochs, momentum, want", [
    (2, 0.0, 6.0),        # 2 epochs x ceil(10 / 4) = 3 batches
    (1, 0.0, 3.0),        # a straggler's single epoch
    (2, 0.9, 17.82969),   # [6 - 0.9 (1 - 0.9^6)/0.1]/0.1 = (6 - 4.217031)/0.1
    (1, 0.9, 5.61),       # [3 - 0.9 (1 - 0.729)/0.1]/0.1 = (3 - 2.439)/0.1
])
def test_the_shared_loop_counts_epochs_times_batches(epochs, momentum, want):
    """Through ``fit`` (the shared SGD loop, contract checks): 10 examples,
    batch size 4 -> 3 mini-batches per epoch (the last one partial)."""
    conf = cfg(momentum=momentum, **{"batch-size": 4})
    solver = FedNovaSolver(conf)
    gen = torch.Generator().manual_seed(0)
    data = TrainData(torch.randn(10, 3, generator=gen), torch.arange(10) % 2)
    model = torch.nn.Linear(3, 2)
    result = solver.fit(model, data, train_config_record(1, 0.1, epochs), ContextState(RecordDict()), gen)
    assert result.metrics["local-steps"] == 3 * epochs
    assert a_norm(result.extra) == pytest.approx(want, rel=1e-12)


def test_normalizing_factor_formula_and_refusals():
    assert normalizing_factor(7, 0.0) == 7.0
    # the sum of the a-vector entries, term by term, for tau = 1..12
    for tau in range(1, 13):
        rho = 0.8
        assert normalizing_factor(tau, rho) == pytest.approx(
            sum((1 - rho ** k) / (1 - rho) for k in range(1, tau + 1)), rel=1e-13)
    with pytest.raises(ValueError, match="negative"):
        normalizing_factor(-1, 0.0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        normalizing_factor(3, 1.0)


def test_a_client_without_a_local_step_says_so():
    solver = FedNovaSolver(cfg())
    model, state = linear([0.0]), ContextState(RecordDict())
    solver.begin_round(model, train_config(), state)
    with pytest.raises(RuntimeError, match="no local step"):
        solver.end_round(model, state)


# --------------------------------------------------------------------------- #
# server: eq. (11)
# --------------------------------------------------------------------------- #
NODES = {0: 101, 1: 102, 2: 103}


def rec(v, dtype=np.float32):
    return ArrayRecord({"w": Array(np.asarray(v, dtype=dtype))})


def server_round(strategy, x, replies):
    """One round: configure_train from ``x``, then replies (y, n, a-norm record)."""
    msgs = list(strategy.configure_train(1, rec(x), ConfigRecord(), StubGrid(NODES.values())))
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    out = []
    for i, (p, (y, n, a_rec)) in enumerate(sorted(replies.items())):
        by_node[NODES[p]].metadata.__dict__["_message_id"] = f"m{i}"
        content = {"arrays": rec(y), "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0})}
        if a_rec is not None:
            content[A_NORM_RECORD] = a_rec
        out.append(Message(RecordDict(content), reply_to=by_node[NODES[p]]))
    arrays, _ = strategy.aggregate_train(1, out)
    return arrays


def test_server_step_by_hand():
    """x = [1, 2]; y = [0, 2], [2, -1], [-4, 7]; n = 10, 30, 60 (p = 0.1, 0.3, 0.6);
    ||a||_1 = 2, 6, 5.
    d_i = (x - y_i)/||a_i||_1 = [0.5, 0], [-1/6, 0.5], [1, -1];
    sum p_i d_i = [0.05 - 0.05 + 0.6, 0.15 - 0.6] = [0.6, -0.45];
    tau_eff = 0.1*2 + 0.3*6 + 0.6*5 = 5; x_new = [1, 2] - 5 [0.6, -0.45] = [-2, 4.25]
    (FedAvg's mean would be [-1.8, 4.1])."""
    strategy = get_algorithm("fednova").build_strategy(cfg(**{"clients-per-round": 3}), Federation(dict(NODES)))
    new = server_round(strategy, [1.0, 2.0], {0: ([0.0, 2.0], 10, a_norm_record(2.0)),
                                              1: ([2.0, -1.0], 30, a_norm_record(6.0)),
                                              2: ([-4.0, 7.0], 60, a_norm_record(5.0))})
    assert new["w"].dtype == "float32"  # computed in float64, returned in the sent dtype
    np.testing.assert_allclose(new["w"].numpy(), [-2.0, 4.25], atol=1e-6)
    log = strategy.rounds[1]
    assert log.bytes_up == 3 * (payload_bytes(rec([1.0, 2.0])) + payload_bytes(a_norm_record(1.0)))
    assert log.bytes_down == 3 * payload_bytes(rec([1.0, 2.0]))  # nothing extra sent down


def test_pure_rule_equal_a_is_fedavgs_mean_and_float64():
    x = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    ys = [{"w": np.array([0.0, 2.0])}, {"w": np.array([2.0, -1.0])}]
    new = normalized_average(x, ys, [3.0, 3.0], [10, 30])
    assert new["w"].dtype == np.float64
    np.testing.assert_allclose(new["w"], 0.25 * ys[0]["w"] + 0.75 * ys[1]["w"], atol=1e-15)
    with pytest.raises(ValueError, match="must be finite and > 0"):
        normalized_average(x, ys, [3.0, 0.0], [10, 30])
    with pytest.raises(ValueError, match="same non-zero number"):
        normalized_average(x, [], [], [])


@pytest.mark.parametrize("bad, reason", [
    (a_norm_record(0.0), "must be > 0"),
    (a_norm_record(-2.0), "must be > 0"),
    (ArrayRecord({A_NORM_KEY: Array(np.array([1.0, 2.0]))}), "expected one float"),
    (ArrayRecord({"tau": Array(np.array([1.0]))}), "expected ['a-norm']"),
    (None, "lacks the record 'fednova.a-norm'"),
])
def test_a_malformed_a_norm_is_rejected_and_the_round_goes_on(bad, reason, caplog):
    """The bad reply is rejected (logged with the reason); the one good reply
    alone gives x - a (x - y)/a = y."""
    strategy = get_algorithm("fednova").build_strategy(cfg(**{"clients-per-round": 2}), Federation(dict(NODES)))
    strategy.sample_cohort = lambda r: [0, 1]
    new = server_round(strategy, [1.0, 2.0], {0: ([0.0, 2.0], 10, a_norm_record(2.0)),
                                              1: ([5.0, 5.0], 30, bad)})
    np.testing.assert_allclose(new["w"].numpy(), [0.0, 2.0], atol=1e-7)
    assert strategy.rounds[1].rejected == 1
    assert reason in caplog.text


# --------------------------------------------------------------------------- #
# objective inconsistency: heterogeneous least squares, unequal local steps
# --------------------------------------------------------------------------- #
# (what is exact here and what is first order in eta: the module docstring)
N_CLIENTS, DIM = 6, 4
TAU = [1, 2, 4, 8, 12, 20]  # unequal local step counts
EXAMPLES = [40, 10, 30, 20, 10, 40]  # unequal n_i, not proportional to tau_i


@pytest.fixture(scope="module")
def lsq():
    H, c, _, _ = heterogeneous_least_squares(N_CLIENTS, DIM, 20, seed=0)
    p = np.asarray(EXAMPLES, dtype=float) / sum(EXAMPLES)
    z_star = np.linalg.solve(sum(pi * h for pi, h in zip(p, H)), sum(pi * ci for pi, ci in zip(p, c)))
    return H, c, p, z_star


def local_affine(h, c, eta, rho, steps):
    """(A, b) with y = A x + b after ``steps`` steps of torch's momentum GD on f."""
    A_w, b_w = np.eye(len(c)), np.zeros(len(c))
    A_v, b_v = np.zeros((len(c), len(c))), np.zeros(len(c))
    for _ in range(steps):
        A_v, b_v = rho * A_v + h @ A_w, rho * b_v + h @ b_w - c
        A_w, b_w = A_w - eta * A_v, b_w - eta * b_v
    return A_w, b_w


def fixed_points(lsq, eta, rho):
    """Closed forms: FedNova's and FedAvg's fixed points, and the minimizer of
    FedAvg's surrogate sum_i p_i ||a_i||_1 f_i."""
    H, c, p, _ = lsq
    a = [normalizing_factor(t, rho) for t in TAU]
    maps = [local_affine(h, ci, eta, rho, t) for h, ci, t in zip(H, c, TAU)]
    eye = np.eye(DIM)
    nova = np.linalg.solve(sum(pi * (eye - A) / ai for pi, ai, (A, _) in zip(p, a, maps)),
                           sum(pi * b / ai for pi, ai, (_, b) in zip(p, a, maps)))
    avg = np.linalg.solve(sum(pi * (eye - A) for pi, (A, _) in zip(p, maps)),
                          sum(pi * b for pi, (_, b) in zip(p, maps)))
    surrogate = np.linalg.solve(sum(pi * ai * h for pi, ai, h in zip(p, a, H)),
                                sum(pi * ai * ci for pi, ai, ci in zip(p, a, c)))
    return nova, avg, surrogate


def federated_rounds(lsq, algo, x0, eta, rho, rounds):
    """The real strategy (configure_train / aggregate_train) and solver, full
    participation, client p taking TAU[p] exact-gradient steps and reporting
    EXAMPLES[p]; returns the global model after ``rounds`` rounds."""
    H, c, _, _ = lsq
    conf = cfg(algo, momentum=rho, **{"clients-per-round": N_CLIENTS})
    nodes = {p: 301 + p for p in range(N_CLIENTS)}
    strategy = get_algorithm(algo).build_strategy(conf, Federation(dict(nodes)))
    solver = get_algorithm(algo).solver(conf)
    x = ArrayRecord({"weight": Array(np.asarray(x0, dtype=np.float64)[None])})
    for r in range(1, rounds + 1):
        replies = []
        for i, msg in enumerate(strategy.configure_train(r, x, ConfigRecord(), StubGrid(nodes.values()))):
            msg.metadata.__dict__["_message_id"] = f"r{r}m{i}"
            p = strategy.federation.partition_of_node[msg.metadata.dst_node_id]
            model, state = linear(msg.content["arrays"]["weight"].numpy()[0].tolist()), ContextState(RecordDict())
            solver.begin_round(model, train_config(server_round=r, lr=eta), state)
            quadratic_local_steps(solver, model, eta, H[p], c[p], TAU[p])
            extra = solver.end_round(model, state)
            content = {"arrays": ArrayRecord({"weight": Array(model.weight.detach().numpy().copy())}),
                       "metrics": MetricRecord({"num-examples": EXAMPLES[p], "train-loss": 1.0}), **extra}
            replies.append(Message(RecordDict(content), reply_to=msg))
        x, _ = strategy.aggregate_train(r, replies)
    return x["weight"].numpy()[0]


@pytest.mark.parametrize("rho", [0.5])  # rho = 0's fixed points: kept exactly by one round in the next test
def test_rounds_reach_the_closed_form_fixed_points(lsq, rho):
    """From x = 0, eta = 0.05, 100 rounds (the round maps contract by <= 0.74 here):
    FedNova ends at its fixed point, FedAvg at its own, both to 1e-9 (at this
    large eta FedNova's is only somewhat closer to z*; the next test takes eta
    to 0)."""
    nova, avg, _ = fixed_points(lsq, 0.05, rho)
    got_nova = federated_rounds(lsq, "fednova", np.zeros(DIM), 0.05, rho, 100)
    got_avg = federated_rounds(lsq, "fedavg", np.zeros(DIM), 0.05, rho, 100)
    np.testing.assert_allclose(got_nova, nova, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got_avg, avg, rtol=0, atol=1e-9)
    z_star = lsq[3]
    assert np.linalg.norm(nova - z_star) < np.linalg.norm(avg - z_star)


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_fednova_error_is_first_order_in_eta_fedavg_keeps_the_surrogate_bias(lsq, rho):
    """eta = 0.02, 0.01, 0.005: each closed-form fixed point is kept by one
    round of the real code (so it is the implementation's limit), then
    - FedNova: ||x_N - z*|| / eta changes by < 10 % when eta halves (error
      proportional to eta, hence -> 0), and is below a tenth of FedAvg's bias
      at eta = 0.005;
    - FedAvg: ||x_A - z*|| > 0.8 ||x~ - z*|| > 1 at every eta, x~ the minimizer
      of the tau-weighted surrogate, and ||x_A - x~|| / eta is as stable: FedAvg
      converges to the surrogate, not to the objective."""
    z_star = lsq[3]
    nova_err, avg_gap, bias = [], [], None
    for eta in (0.02, 0.01, 0.005):
        nova, avg, surrogate = fixed_points(lsq, eta, rho)
        np.testing.assert_allclose(federated_rounds(lsq, "fednova", nova, eta, rho, 1), nova, rtol=0, atol=1e-12)
        np.testing.assert_allclose(federated_rounds(lsq, "fedavg", avg, eta, rho, 1), avg, rtol=0, atol=1e-12)
        bias = np.linalg.norm(surrogate - z_star)
        assert bias > 1.0
        assert np.linalg.norm(avg - z_star) > 0.8 * bias
        nova_err.append(np.linalg.norm(nova - z_star) / eta)
        avg_gap.append(np.linalg.norm(avg - surrogate) / eta)
    for series in (nova_err, avg_gap):
        assert all(abs(b / a - 1) < 0.1 for a, b in zip(series, series[1:])), series
    assert nova_err[-1] * 0.005 < 0.1 * bias


def test_fednova_first_order_term_by_hand(lsq):
    """Plain GD: (x - y_i)/tau_i = eta H_i e_i - eta^2 (tau_i - 1)/2 H_i^2 e_i + O(eta^3),
    e_i = x - x_i*, so sum_i p_i (x - y_i)/tau_i = 0 at x = z* + eta v + O(eta^2) with
    H v = sum_i p_i (tau_i - 1)/2 H_i (H_i z* - c_i), H = sum_i p_i H_i.
    The remainder ||x_N - z* - eta v|| is O(eta^2) (about 75 eta^2 here)."""
    H, c, p, z_star = lsq
    H_bar = sum(pi * h for pi, h in zip(p, H))
    v = np.linalg.solve(H_bar, sum(pi * (t - 1) / 2 * h @ (h @ z_star - ci)
                                   for pi, t, h, ci in zip(p, TAU, H, c)))
    for eta in (0.02, 0.01, 0.005):
        nova, _, _ = fixed_points(lsq, eta, 0.0)
        assert np.linalg.norm(nova - z_star - eta * v) < 100 * eta ** 2
        assert np.linalg.norm(nova - z_star) > 0.5 * eta * np.linalg.norm(v)  # v is the whole first order


# --------------------------------------------------------------------------- #
# short runs through the fast runner
# --------------------------------------------------------------------------- #
@pytest.fixture
def no_plot(monkeypatch):
    """curves.png is most of a short run's time and is tested elsewhere (tests/test_results.py)."""
    monkeypatch.setattr("fedaccel.results.plot_curves", lambda *args, **kwargs: None)


SMALL = {"num-server-rounds": 4, "clients-per-round": 3, "local-epochs": 2, "accl-every": 0,
         "synthetic.max-samples": 120, "batch-size": 16}


def run(tmp_path, name, **overrides):
    conf = fuse(default_run_config(), {**SMALL, "algo": "fednova", "results-dir": str(tmp_path),
                                       "run-name": name, **overrides})
    run_dir = run_local(conf, num_clients=6, quiet=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = dict(np.load(run_dir / "final_model.npz"))
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows], final


def test_short_run_is_deterministic_and_learns(tmp_path, no_plot):
    first, model = run(tmp_path, "a")
    again, model_again = run(tmp_path, "b")
    assert first == again and all(np.array_equal(model[k], model_again[k]) for k in model)
    assert [r["round"] for r in first] == [1, 2, 3, 4]
    assert all(r["clients"] == 3 and r["failures"] == 0 for r in first)
    assert first[-1]["loss"] < first[0]["loss"] and first[-1]["accg"] > 0.4


def test_stragglers_partial_work_is_aggregated(tmp_path, no_plot):
    """straggler-fraction 0.5 of a 3-client cohort = 2 stragglers per round, each
    doing 1 or 2 of the 2 epochs; with 'partial' their replies (smaller ||a||_1)
    are normalized and used, so the run differs from 'drop' with the same seed
    (that a seeded run repeats exactly is the test above)."""
    stragglers = {"straggler-fraction": 0.5, "straggler-policy": "partial"}
    partial, model = run(tmp_path, "p", **stragglers)
    dropped, model_dropped = run(tmp_path, "d", **{**stragglers, "straggler-policy": "drop"})
    assert all(r["clients"] == 3 and r["failures"] == 0 for r in partial)
    assert all(np.isfinite(model[k]).all() for k in model)
    assert partial[-1]["loss"] < partial[0]["loss"]
    assert any(not np.array_equal(model[k], model_dropped[k]) for k in model)


def test_equal_local_work_is_fedavg(tmp_path, no_plot):
    """A batch larger than any client's split: every client takes local-epochs
    steps, all ||a_i||_1 are equal and eq. (11) is FedAvg's mean (to float32
    rounding: FedNova computes in float64)."""
    nova, model_nova = run(tmp_path, "n", **{"batch-size": 1000})
    avg, model_avg = run(tmp_path, "f", algo="fedavg", **{"batch-size": 1000})
    for k in model_avg:
        np.testing.assert_allclose(model_nova[k], model_avg[k], rtol=0, atol=1e-5)
    assert [r["accg"] for r in nova] == pytest.approx([r["accg"] for r in avg], abs=0.02)


def test_auto_straggler_policy_is_partial() -> None:
    """FedNova is built for unequal local work: 'auto' keeps stragglers' partial updates."""
    from fedaccel.local_run import default_run_config
    from fedaccel.run_config import parse_run_config

    cfg = default_run_config()
    cfg.update({"algo": "fednova", "straggler-policy": "auto"})
    assert parse_run_config(cfg).straggler_policy == "partial"
