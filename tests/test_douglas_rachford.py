"""Douglas-Rachford methods (FedCDR, FedDR) against Algorithm 1 of the
FedCDR paper ("Mitigating Data Heterogeneity Effect in Client-Reshuffling-
Based Federated Learning") and the public FedDR code (Tran-Dinh et al.,
NeurIPS 2021, arXiv:2103.03452).

1. the pure rules (relax, reflect, server step) on hand-computed values;
2. the real client solver's hooks (proximal gradient, upload, stored state),
   including two local SGD steps with momentum and weight decay by hand;
3. the server invariant x == mean_i xhat_i on real fast-runner runs, and
   the server's first aggregation with ``init='zeros'``;
4. the behaviour that motivates DR: on a heterogeneous federated
   least-squares problem with exact prox, FedCDR and FedDR reach the global
   minimizer while FedAvg with local steps stalls at a biased point.

The invariant and cohort tests also guard fixed bugs: clients first selected
after round 1 used to initialise y/x_i/xhat from the model they received
then instead of x0; ``init='zeros'`` used to zero x_i and the server model
too (the FedDR code zeroes only y_i and xhat_i), so a ReLU MLP never left
its all-zero start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedaccel.clients.douglas_rachford import DouglasRachfordSolver, reflect, relax, server_step
from fedaccel.clients.base import TrainData
from fedaccel.clients.state import ContextState, context_client_state
from fedaccel.config import ConfigError
from fedaccel.contract import train_config_record
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse
from fakes import StubGrid, heterogeneous_least_squares, quadratic_local_steps, train_config
from fedaccel.registry import get_algorithm
from fedaccel.membership import Federation
from fedaccel.samplers import reshuffle_cohort, uniform_cohort

CPU = torch.device("cpu")

def x0_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the ClientApp gives the solver: the run's initial model (here the
    first received one, as in round 1)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def dr_cfg(algo: str = "fedcdr", **params):
    overrides = {"algo": algo, "momentum": 0.0, "weight-decay": 0.0}
    overrides.update({f"{algo}.{k}": v for k, v in params.items()})
    return parse_run_config(fuse(default_run_config(), overrides))


def linear(weight, bias=None, dtype=torch.float32) -> torch.nn.Linear:
    w = torch.tensor(weight, dtype=dtype)
    model = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(w)
        if bias is not None:
            model.bias.copy_(torch.tensor(bias, dtype=dtype))
    return model


def set_weight(model, weight):
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight, dtype=model.weight.dtype))


def t(values):
    return torch.tensor(values, dtype=torch.float32)


# --------------------------------------------------------------------------- #
# 1. the pure rules
# --------------------------------------------------------------------------- #
def test_one_dr_step_by_hand():
    y, x_server, x_i, xhat_old = map(np.array, ([1.0, 2.0], [3.0, 0.0], [2.0, 1.0], [1.0, 1.0]))
    y_new = relax(y, x_server, x_i, 0.5)
    np.testing.assert_allclose(y_new, [1.5, 1.5])
    # exact prox of f(z) = 0.5 ||z - c||^2 with eta = 1: (c + y / eta) / (1 + 1 / eta)
    c, eta = np.array([0.0, 4.0]), 1.0
    x_new = (c + y_new / eta) / (1 + 1 / eta)
    np.testing.assert_allclose(x_new, [0.75, 2.75])
    xhat_new = reflect(x_new, y_new)
    np.testing.assert_allclose(xhat_new, [0.0, 4.0])
    g = xhat_new - xhat_old
    np.testing.assert_allclose(g, [-1.0, 3.0])
    # server, n = 4 clients of which this one trained: x + g / n
    np.testing.assert_allclose(server_step(x_server, g, 4), [2.75, 0.75])
    # the inputs are untouched
    np.testing.assert_array_equal(y, [1.0, 2.0])
    np.testing.assert_array_equal(x_server, [3.0, 0.0])


def test_rules_on_tensors_and_alpha():
    y, x, xi = t([1.0, 2.0]), t([3.0, 0.0]), t([2.0, 1.0])
    torch.testing.assert_close(relax(y, x, xi, 1.0), t([2.0, 1.0]))
    torch.testing.assert_close(relax(y, x, xi, 1.5), t([2.5, 0.5]))
    torch.testing.assert_close(relax(y, x, x, 1.9), y)  # x_i == x: no change
    torch.testing.assert_close(reflect(t([0.75, 2.75]), t([1.5, 1.5])), t([0.0, 4.0]))
    torch.testing.assert_close(server_step(x, t([6.0, -3.0]), 3), t([5.0, -1.0]))
    torch.testing.assert_close(y, t([1.0, 2.0]))


@pytest.mark.parametrize("algo", ["fedcdr", "feddr"])
def test_alpha_range_is_the_papers_half_open_interval(algo):
    """FedCDR appendix A: "alpha in (0, 2] is a relaxation coefficient": 2 is
    accepted (relax by hand: [1, 2] + 2 ([3, 0] - [2, 1]) = [3, 0]), 0 and
    anything above 2 are refused in one line naming the key."""
    assert dr_cfg(algo, alpha=2.0).algo_params.alpha == 2.0
    torch.testing.assert_close(relax(t([1.0, 2.0]), t([3.0, 0.0]), t([2.0, 1.0]), 2.0), t([3.0, 0.0]))
    for bad in (0.0, 2.01, -1.0):
        with pytest.raises(ConfigError, match=f"{algo}.alpha"):
            dr_cfg(algo, alpha=bad)


def test_server_step_keeps_mean_of_xhat():
    rng = np.random.default_rng(1)
    xhat = rng.standard_normal((6, 3))
    x = xhat.mean(axis=0)
    for _ in range(5):
        chosen = rng.choice(6, size=2, replace=False)
        new = rng.standard_normal((2, 3))
        g_sum = (new - xhat[chosen]).sum(axis=0)
        xhat[chosen] = new
        x = server_step(x, g_sum, 6)
        np.testing.assert_allclose(x, xhat.mean(axis=0), atol=1e-12)


# --------------------------------------------------------------------------- #
# 2. the real client solver
# --------------------------------------------------------------------------- #
def saved(state: ContextState) -> dict[str, list]:
    return {k: v.tolist() for k, v in state.get("dr", CPU).items()}


def test_first_round_prox_gradient_and_upload_by_hand():
    solver = DouglasRachfordSolver(dr_cfg(eta=2.0, alpha=0.5))
    state = ContextState(RecordDict())
    model = linear([[1.0, 2.0]], bias=[0.5])  # the received (initial) model
    solver.initial_model = x0_of(model)
    solver.begin_round(model, train_config(), state)
    assert state.get("dr", CPU) is None  # nothing stored before upload
    # train "somewhere": the hook must use the current weights, y = received
    set_weight(model, [[3.0, -1.0]])
    model.weight.grad = t([[0.1, 0.2]])
    model.bias.grad = t([0.0])
    solver.transform_gradients(model)
    # grad + (w - y) / eta = 0.1 + (3 - 1)/2, 0.2 + (-1 - 2)/2
    torch.testing.assert_close(model.weight.grad, t([[1.1, -1.3]]))
    torch.testing.assert_close(model.bias.grad, t([0.0]))  # bias did not move

    g = solver.upload(model, state)
    # xhat' = 2 x - y = [[5, -4]], xhat_old = received = [[1, 2]] -> g = [[4, -6]]
    np.testing.assert_allclose(g["weight"].numpy(), [[4.0, -6.0]])
    np.testing.assert_allclose(g["bias"].numpy(), [0.0])
    assert g["weight"].numpy().dtype == np.float32
    assert saved(state) == {
        "y.weight": [[1.0, 2.0]], "y.bias": [0.5],
        "x.weight": [[3.0, -1.0]], "x.bias": [0.5],
        "xhat.weight": [[5.0, -4.0]], "xhat.bias": [0.5],
    }


@pytest.mark.parametrize("prox_start", ["server", "local"])
def test_second_round_relax_prox_start_and_upload(prox_start):
    solver = DouglasRachfordSolver(dr_cfg(eta=2.0, alpha=0.5, **{"prox-start": prox_start}))
    state = ContextState(RecordDict())
    model = linear([[1.0, 2.0]])
    solver.initial_model = x0_of(model)
    solver.begin_round(model, train_config(), state)
    set_weight(model, [[3.0, -1.0]])
    solver.upload(model, state)  # y = [[1, 2]], x_i = [[3, -1]], xhat = [[5, -4]]

    set_weight(model, [[0.0, 0.0]])  # the next received server model x
    solver.begin_round(model, train_config(), state)
    # prox start: 'local' warm-starts from x_i, 'server' keeps the received x
    start = [[3.0, -1.0]] if prox_start == "local" else [[0.0, 0.0]]
    torch.testing.assert_close(model.weight.detach(), t(start))
    # y' = y + alpha (x - x_i) = [[1, 2]] + 0.5 [[-3, 1]] = [[-0.5, 2.5]]
    set_weight(model, [[0.0, 0.0]])
    model.weight.grad = torch.zeros(1, 2)
    solver.transform_gradients(model)
    torch.testing.assert_close(model.weight.grad, t([[0.25, -1.25]]))  # (0 - y') / 2
    set_weight(model, [[1.0, 1.0]])
    g = solver.upload(model, state)
    # xhat'' = 2 [[1, 1]] - y' = [[2.5, -0.5]]; g = xhat'' - [[5, -4]]
    np.testing.assert_allclose(g["weight"].numpy(), [[-2.5, 3.5]])
    assert saved(state) == {"y.weight": [[-0.5, 2.5]], "x.weight": [[1.0, 1.0]],
                            "xhat.weight": [[2.5, -0.5]]}


def test_init_zeros_zeroes_y_and_xhat_but_x_i_starts_at_x0():
    """init='zeros' as the FedDR code (client_dr.py: y_i = x_hat = 0, the
    client's model x_i = the initial model): x0 = [1, 2], a client first
    selected in a later round receives x = [3, 0], alpha 1, eta 4.
    y' = 0 + 1 * ([3, 0] - [1, 2]) = [2, -2]; prox-start local starts at
    x_i = x0 = [1, 2]; prox gradient there (x0 - y') / 4 = [-0.25, 1];
    xhat' = 2 [1, 2] - [2, -2] = [0, 6]; g = xhat' - 0 = [0, 6].
    (The old code started x_i at 0: the solver started at [0, 0].)"""
    solver = DouglasRachfordSolver(dr_cfg("feddr", eta=4.0, init="zeros", **{"prox-start": "local"}))
    state = ContextState(RecordDict())
    model = linear([[3.0, 2.0]])
    solver.initial_model = {"weight": t([[1.0, 2.0]])}
    set_weight(model, [[3.0, 0.0]])  # the server model of a later round
    solver.begin_round(model, train_config(), state)
    torch.testing.assert_close(solver.y["weight"], t([[2.0, -2.0]]))
    torch.testing.assert_close(model.weight.detach(), t([[1.0, 2.0]]))  # x_i = x0
    model.weight.grad = torch.zeros(1, 2)
    solver.transform_gradients(model)
    torch.testing.assert_close(model.weight.grad, t([[-0.25, 1.0]]))
    g = solver.upload(model, state)
    np.testing.assert_allclose(g["weight"].numpy(), [[0.0, 6.0]])
    assert saved(state) == {"y.weight": [[2.0, -2.0]], "x.weight": [[1.0, 2.0]],
                            "xhat.weight": [[0.0, 6.0]]}


def test_two_prox_sgd_steps_with_momentum_and_weight_decay_by_hand():
    """Two local steps on f(z) = 0.5 z^T h z - c^T z, h = diag(1, 2), c = [1, 1],
    with torch SGD: lr 0.5, momentum 0.5, weight decay 0.1; eta 2, alpha 0.5.
    x0 = [1, 2]; first selected in a later round, receiving x = [3, 0]:
    y = x0 + 0.5 (x - x0) = [2, 1]; xhat_old = x0 = [1, 2]; the solver starts
    at x (prox-start server): p0 = [3, 0].

    step 1: grad f(p0) = [3 - 1, 0 - 1] = [2, -1]
            + (p0 - y)/eta = [1, -1]/2 = [0.5, -0.5]   -> p.grad = [2.5, -1.5]
            + weight decay 0.1 p0 = [0.3, 0]           -> d1 = [2.8, -1.5]
            buf1 = d1;  p1 = p0 - 0.5 buf1 = [1.6, 0.75]
    step 2: grad f(p1) = [1.6 - 1, 1.5 - 1] = [0.6, 0.5]
            + (p1 - y)/eta = [-0.4, -0.25]/2 = [-0.2, -0.125] -> [0.4, 0.375]
            + 0.1 p1 = [0.16, 0.075]                   -> d2 = [0.56, 0.45]
            buf2 = 0.5 buf1 + d2 = [1.4 + 0.56, -0.75 + 0.45] = [1.96, -0.3]
            p2 = p1 - 0.5 buf2 = [1.6 - 0.98, 0.75 + 0.15] = [0.62, 0.9]
    x_i = p2 = [0.62, 0.9]; xhat = 2 p2 - y = [-0.76, 0.8];
    g = xhat - xhat_old = [-1.76, -1.2].

    Wrong rules end elsewhere: the prox step applied after each optimizer
    step (p -= lr (p - y)/eta, outside momentum) gives p2 = [1.0808, 0.7891];
    no prox gradient [0.7575, 0.725]; the received x instead of the relaxed
    y [1.045, 0.6]; plain SGD without momentum [1.32, 0.525]."""
    cfg = parse_run_config(fuse(default_run_config(), {
        "algo": "fedcdr", "momentum": 0.5, "weight-decay": 0.1,
        "fedcdr.eta": 2.0, "fedcdr.alpha": 0.5}))
    solver = DouglasRachfordSolver(cfg)
    solver.initial_model = {"weight": torch.tensor([[1.0, 2.0]], dtype=torch.float64)}
    state = ContextState(RecordDict())
    model = linear([[3.0, 0.0]], dtype=torch.float64)
    solver.begin_round(model, train_config(), state)
    quadratic_local_steps(solver, model, 0.5, np.diag([1.0, 2.0]), np.array([1.0, 1.0]), steps=2)
    g = solver.upload(model, state)
    np.testing.assert_allclose(g["weight"].numpy(), [[-1.76, -1.2]], rtol=0, atol=1e-12)
    stored = {k: v.numpy() for k, v in state.get("dr", CPU).items()}
    np.testing.assert_allclose(stored["y.weight"], [[2.0, 1.0]], rtol=0, atol=1e-12)
    np.testing.assert_allclose(stored["x.weight"], [[0.62, 0.9]], rtol=0, atol=1e-12)
    np.testing.assert_allclose(stored["xhat.weight"], [[-0.76, 0.8]], rtol=0, atol=1e-12)


def test_fit_runs_prox_sgd_by_hand():
    """fit(): 2 epochs over one sample (x=[1, 0], label 0), lr 1, eta 2, W0 = 0.

    Step 1: W = y = 0, so only the cross-entropy gradient [[-1/2, 0], [1/2, 0]]
    -> W1 = [[1/2, 0], [-1/2, 0]]. Step 2: CE gradient at W1 plus (W1 - 0)/2.
    Upload: g = (2 W2 - y) - xhat_old = 2 W2.
    """
    solver = DouglasRachfordSolver(dr_cfg(eta=2.0))
    state = ContextState(RecordDict())
    model = linear([[0.0, 0.0], [0.0, 0.0]])
    solver.initial_model = x0_of(model)
    data = TrainData(x=t([[1.0, 0.0]]), y=torch.tensor([0]))
    result = solver.fit(model, data, {**train_config_record(1, 1.0, 2), "accepted-round": 0}, state,
                        torch.Generator().manual_seed(0))
    w1 = np.array([[0.5, 0.0], [-0.5, 0.0]])
    p0 = 1.0 / (1.0 + np.exp(-1.0))
    w2 = w1 - (np.array([[p0 - 1.0, 0.0], [1.0 - p0, 0.0]]) + w1 / 2)
    np.testing.assert_allclose(result.arrays["weight"].numpy(), 2 * w2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.get("dr", CPU)["x.weight"].numpy(), w2, rtol=1e-6, atol=1e-7)
    assert result.metrics["local-steps"] == 2 and result.metrics["num-examples"] == 1


# --------------------------------------------------------------------------- #
# 3. the server invariant on real runs
# --------------------------------------------------------------------------- #
def run_on_grid(tmp_path: Path, algo: str, num_clients: int = 6, **overrides):
    """The real ServerApp/ClientApp on a LocalGrid we keep, to read client state."""
    from fedaccel.apps.client_app import app as client_app
    from fedaccel.apps.server_app import QUIET, app as server_app
    from fedaccel.local_grid import LocalGrid

    cfg = fuse(default_run_config(), {
        "algo": algo, "synthetic.max-samples": 60, "clients-per-round": 3, "local-epochs": 1,
        "num-server-rounds": 4, "accl-every": 0, "client-state": "context",
        "results-dir": str(tmp_path), "run-name": algo, **overrides})
    grid = LocalGrid(client_app, cfg, num_clients, seed=int(cfg["seed"]))
    grid.serve(server_app, Context(run_id=grid.run.run_id, node_id=0, node_config={QUIET: True},
                             state=RecordDict(), run_config=cfg))
    final = dict(np.load(tmp_path / algo / "final_model.npz"))
    return cfg, grid, final


def initial_model(cfg: dict, num_clients: int) -> dict[str, np.ndarray]:
    from fedaccel.runtime import build_model_for, data_config_for, load_data

    rc = parse_run_config(cfg)
    model = build_model_for(rc, load_data(data_config_for(rc, num_clients)))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def mean_xhat(grid, final, x0) -> tuple[dict[str, np.ndarray], int]:
    """Mean over ALL clients of xhat_i; a client that never trained counts as x0."""
    total = {k: np.zeros_like(v, dtype=np.float64) for k, v in final.items()}
    trained = 0
    for context in grid.contexts.values():
        stored = context_client_state(context.state).get("dr", CPU)
        trained += stored is not None
        for k in final:
            total[k] += stored[f"xhat.{k}"].numpy() if stored is not None else x0[k]
    n = len(grid.contexts)
    return {k: v / n for k, v in total.items()}, trained


def test_invariant_full_participation_real_run(tmp_path):
    """6 of 6 clients every round: every client starts from x0 in round 1, so
    the global model stays the mean of the clients' xhat."""
    cfg, grid, final = run_on_grid(tmp_path, "fedcdr", **{"clients-per-round": 6})
    x0 = initial_model(cfg, 6)
    mean, trained = mean_xhat(grid, final, x0)
    assert trained == 6
    for k in final:
        assert final[k].dtype == np.float32
        assert not np.allclose(final[k], x0[k], atol=1e-4)  # it did move
        np.testing.assert_allclose(final[k], mean[k], atol=1e-5, rtol=0)


def test_invariant_fedcdr_reshuffled_real_run(tmp_path):
    """6 clients, 3 per round, 4 rounds = 2 meta-epochs: every client trained."""
    cfg, grid, final = run_on_grid(tmp_path, "fedcdr")
    mean, trained = mean_xhat(grid, final, initial_model(cfg, 6))
    assert trained == 6
    for k in final:
        np.testing.assert_allclose(final[k], mean[k], atol=1e-5, rtol=0)


def test_invariant_feddr_uniform_real_run(tmp_path):
    """seed 1: partition 0 is never sampled in 4 rounds (it counts as x0)."""
    cfg, grid, final = run_on_grid(tmp_path, "feddr", seed=1)
    never = [p for p in range(6) if all(p not in uniform_cohort(1, r, 6, 3) for r in range(1, 5))]
    assert never == [0]
    mean, trained = mean_xhat(grid, final, initial_model(cfg, 6))
    assert trained == 5
    for k in final:
        np.testing.assert_allclose(final[k], mean[k], atol=1e-5, rtol=0)


def test_invariant_and_symmetry_breaking_feddr_init_zeros_real_run(tmp_path):
    """init='zeros', seed 1: partition 0 never trains, its xhat counts as 0.
    The global model stays the mean over all 6 clients of xhat_i, and the
    MLP's hidden layer leaves its initialization with distinct rows. (With
    the old code, which zeroed x_i and the server model too, fc1 stayed
    exactly zero: a ReLU MLP at zero has no gradient into its hidden layer.)"""
    cfg, grid, final = run_on_grid(tmp_path, "feddr", seed=1, **{"feddr.init": "zeros"})
    zeros = {k: np.zeros_like(v) for k, v in final.items()}
    mean, trained = mean_xhat(grid, final, zeros)
    assert trained == 5
    for k in final:
        np.testing.assert_allclose(final[k], mean[k], atol=1e-5, rtol=0)
    w1 = final["fc1.weight"]
    assert np.abs(w1).max() > 1e-2
    assert len(np.unique(w1.round(6), axis=0)) == w1.shape[0]  # 32 distinct hidden units


NODES = {0: 101, 1: 102, 2: 103}


def _strategy(init: str):
    cfg = parse_run_config(fuse(default_run_config(), {
        "algo": "feddr", "clients-per-round": 3, "feddr.init": init}))
    return get_algorithm("feddr").build_strategy(cfg, Federation(dict(NODES)))


def _record(values) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.asarray(values, dtype=np.float64))})


def _round(strategy, server_round: int, sent, g_by_node: dict[int, list]) -> np.ndarray:
    msgs = list(strategy.configure_train(server_round, _record(sent), ConfigRecord(),
                                         StubGrid(NODES.values())))
    replies = []
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
        content = RecordDict({"arrays": _record(g_by_node[m.metadata.dst_node_id]),
                              "metrics": MetricRecord({"num-examples": 1, "train-loss": 1.0})})
        replies.append(Message(content, reply_to=m))
    new, _ = strategy.aggregate_train(server_round, replies)
    return new["w"].numpy()


@pytest.mark.usefixtures("server_identity")
@pytest.mark.parametrize("init", ["model", "zeros"])
def test_server_sends_x0_and_first_aggregation_starts_from_mean_of_initial_xhat(init):
    """n = 3, x0 = [1, 2]; both inits send x0 in round 1 (the FedDR code's
    server starts at the model's initialization). Round 1 replies g = [3, 0],
    [0, 3], [0, 0]: x1 = mean(xhat^0) + [3, 3]/3, with mean(xhat^0) = x0 for
    'model' ([2, 3]) and 0 for 'zeros' ([1, 1]). Round 2 (g sum [3, -3]) adds
    to the model sent, x1, in both."""
    strategy = _strategy(init)
    x0 = _record([1.0, 2.0])
    np.testing.assert_array_equal(strategy.initial_model(x0)["w"].numpy(), [1.0, 2.0])
    x1 = _round(strategy, 1, [1.0, 2.0], {101: [3.0, 0.0], 102: [0.0, 3.0], 103: [0.0, 0.0]})
    np.testing.assert_allclose(x1, [2.0, 3.0] if init == "model" else [1.0, 1.0], rtol=0, atol=1e-15)
    x2 = _round(strategy, 2, x1, {101: [3.0, 0.0], 102: [0.0, -3.0], 103: [0.0, 0.0]})
    np.testing.assert_allclose(x2, x1 + [1.0, -1.0], rtol=0, atol=1e-15)


# --------------------------------------------------------------------------- #
# 4. heterogeneity: federated least squares with exact prox
# --------------------------------------------------------------------------- #
N, D, M = 10, 5, 20


@pytest.fixture(scope="module")
def lsq():
    """Client i: f_i(z) = 0.5/m ||A_i z - b_i||^2 with b_i = A_i w_i, w_i far apart."""
    H, c, z_star, w = heterogeneous_least_squares(N, D, M)
    # the clients really disagree: each local minimizer is far from z*
    assert min(np.linalg.norm(wi - z_star) for wi in w) > 1.0
    return H, c, z_star


def run_dr(lsq, sampler, cohort_size, eta=3.0, alpha=1.0, rounds=300):
    """Algorithm 1 with exact prox; all states start at x0 = 0."""
    H, c, z_star = lsq
    prox = [np.linalg.inv(h + np.eye(D) / eta) for h in H]
    x = np.zeros(D)
    y, xi, xhat = (np.zeros((N, D)) for _ in range(3))
    errors = []
    for r in range(1, rounds + 1):
        g_sum = np.zeros(D)
        for i in sampler(0, r, N, cohort_size):
            y[i] = relax(y[i], x, xi[i], alpha)
            xi[i] = prox[i] @ (c[i] + y[i] / eta)
            new = reflect(xi[i], y[i])
            g_sum += new - xhat[i]
            xhat[i] = new
        x = server_step(x, g_sum, N)
        assert np.allclose(x, xhat.mean(axis=0), atol=1e-12)
        errors.append(np.linalg.norm(x - z_star))
    return x, errors


def run_fedavg(lsq, sampler, cohort_size, lr=0.05, steps=5, rounds=300):
    H, c, z_star = lsq
    x = np.zeros(D)
    errors = []
    for r in range(1, rounds + 1):
        models = []
        for i in sampler(0, r, N, cohort_size):
            z = x.copy()
            for _ in range(steps):
                z = z - lr * (H[i] @ z - c[i])
            models.append(z)
        x = np.mean(models, axis=0)  # equal client sizes: weighted = plain mean
        errors.append(np.linalg.norm(x - z_star))
    return x, errors


@pytest.mark.parametrize("sampler", [reshuffle_cohort, uniform_cohort], ids=["fedcdr", "feddr"])
def test_dr_reaches_global_minimizer_with_partial_participation(lsq, sampler):
    x, errors = run_dr(lsq, sampler, 5)
    assert errors[-1] < 1e-6
    assert errors[0] > 0.1  # it was not there from the start


@pytest.mark.parametrize("eta, alpha", [(1.0, 1.0), (10.0, 1.5)])
def test_dr_full_participation(lsq, eta, alpha):
    x, errors = run_dr(lsq, reshuffle_cohort, N, eta=eta, alpha=alpha, rounds=300)
    assert errors[-1] < 1e-6


@pytest.mark.parametrize("sampler", [reshuffle_cohort, uniform_cohort], ids=["cr", "uniform"])
def test_fedavg_with_local_steps_stalls_at_biased_point(lsq, sampler):
    _, errors = run_fedavg(lsq, sampler, 5)
    last, before = min(errors[-50:]), min(errors[-100:-50])
    assert last > 1e-2
    assert last > 0.5 * before  # not improving any more
    _, dr_errors = run_dr(lsq, sampler, 5)
    assert dr_errors[-1] < 1e-4 * last


def test_fedavg_full_participation_converges_to_wrong_fixed_point(lsq):
    _, errors = run_fedavg(lsq, reshuffle_cohort, N)
    assert errors[-1] > 1e-2
    assert max(errors[-50:]) - min(errors[-50:]) < 1e-9  # settled, not drifting


def run_dr_real_solver(lsq, cohort_size, init="model", x0=1.0, eta=1.0, rounds=100):
    """The real DouglasRachfordSolver (state handling, relax, reflect, upload)
    with the local training replaced by the exact prox of the client's
    least-squares loss; the server as the strategy does it: round 1 sends x0,
    then x = mean(initial xhat) + sum(g)/n, and x + sum(g)/n after that.
    Checks x == mean over all clients of xhat_i after every round (a client
    that never trained counts with its initial xhat: x0, or 0 for 'zeros')."""
    H, c, z_star = lsq
    solver = DouglasRachfordSolver(dr_cfg("fedcdr", eta=eta, init=init))
    solver.initial_model = {"weight": torch.full((1, D), x0, dtype=torch.float64)}
    prox = [np.linalg.inv(h + np.eye(D) / eta) for h in H]
    states = [ContextState(RecordDict()) for _ in range(N)]
    model = torch.nn.Linear(D, 1, bias=False, dtype=torch.float64)
    initial_xhat = np.zeros(D) if init == "zeros" else np.full(D, x0)
    x, base = np.full(D, x0), initial_xhat  # sent in round 1; mean of the xhat_i
    for r in range(1, rounds + 1):
        g_sum = np.zeros(D)
        for i in reshuffle_cohort(0, r, N, cohort_size):
            set_weight(model, x[None])
            solver.begin_round(model, train_config(), states[i])
            y = solver.y["weight"].numpy()[0]
            set_weight(model, (prox[i] @ (c[i] + y / eta))[None])
            g_sum += solver.upload(model, states[i])["weight"].numpy()[0]
        x = base = server_step(base, g_sum, N)
        xhat = [st.get("dr", CPU) for st in states]
        mean = np.mean([initial_xhat if s is None else s["xhat.weight"].numpy()[0] for s in xhat], axis=0)
        np.testing.assert_allclose(x, mean, rtol=0, atol=1e-12)
    return np.linalg.norm(x - z_star)


def test_real_solver_exact_prox_full_participation(lsq):
    assert run_dr_real_solver(lsq, N) < 1e-8


def test_real_solver_exact_prox_reshuffled_cohorts(lsq):
    """The numpy reference (test above, same cohorts) converges to 1e-15; so
    must the real solver (it stalled 0.8 away when clients initialised lazily)."""
    assert run_dr_real_solver(lsq, 5) < 1e-6


@pytest.mark.parametrize("cohort_size", [N, 5])
def test_real_solver_init_zeros_reaches_minimizer(lsq, cohort_size):
    assert run_dr_real_solver(lsq, cohort_size, init="zeros") < 1e-6


def test_a_model_whose_state_mixes_dtypes_is_refused_in_one_line():
    """y, x and xhat are flat vectors of the model's one dtype: a model with
    an integer buffer (a BatchNorm counter) is refused, not relaxed."""
    from fedaccel.config import ConfigError

    model = linear([[1.0, 2.0]], bias=[0.5])
    model.register_buffer("steps", torch.tensor(3))
    solver = DouglasRachfordSolver(dr_cfg(eta=2.0, alpha=0.5))
    solver.initial_model = x0_of(model)
    with pytest.raises(ConfigError, match=r"mixes dtypes \(\['float32', 'int64'\]\)"):
        solver.begin_round(model, train_config(), ContextState(RecordDict()))
