"""SCAFFOLD (Karimireddy et al. 2020, option II) and FedDyn (Acar et al. 2021).

- corrections by hand through the real solvers (both go through momentum);
- SCAFFOLD's c_i rule with local momentum: the mean trajectory gradient is
  exact, option II's (x - y)/(K lr) overstates it ~1/(1-m) = 5x at m = 0.8;
- SCAFFOLD's mean-gradient c_i includes weight decay (by hand; equals option II
  with weight decay and no momentum);
- server steps by hand, with partial participation (N counts every client);
  control variates counted in bytes_down / bytes_up;
- the server state is the mean over ALL N clients of the client states (FedDyn:
  h = mean grad_prev_i; SCAFFOLD: c = mean c_i), real strategy and solvers over
  several rounds of partial participation with a never-sampled client;
- heterogeneous least squares, full participation: both reach the global
  minimizer where FedAvg with local steps stalls at a biased point.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.feddyn import FedDynSolver, dynamic_gradient, grad_prev_update
from fedaccel.clients.scaffold import (
    C_RECORD, DC_RECORD, FedDCSolver, ScaffoldSolver, control_variate_record, corrected_gradient, drift_gradient,
    drift_update, option_ii_control_variate, received_control_variate,
)
from fedaccel.clients.state import ContextState
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse
from fedaccel.registry import get_algorithm
from fedaccel.torch_utils import payload_bytes
from fedaccel.membership import Federation
from fedaccel.strategies.feddc import drift_sum_update, server_model as feddc_server_model
from fedaccel.strategies.feddyn import h_update, server_model
from fedaccel.strategies.scaffold import model_step
from fedaccel.strategies.server_steps import control_step

from fakes import train_config, StubGrid, heterogeneous_least_squares, quadratic_local_steps

pytestmark = pytest.mark.usefixtures("server_identity")

NODES = {0: 101, 1: 102, 2: 103}
F64 = torch.float64


def cfg(algo, momentum=0.0, wd=0.0, **params):
    o = {"algo": algo, "momentum": momentum, "weight-decay": wd, "clients-per-round": 3}
    o.update({f"{algo}.{k}": v for k, v in params.items()})
    return parse_run_config(fuse(default_run_config(), o))


def linear(weight, dtype=F64):
    model = torch.nn.Linear(len(weight), 1, bias=False, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight], dtype=dtype))
    return model


def c_config(solver, c, lr=0.1, r=1):
    """The round's config; the server's c arrives as the ``scaffold.c`` record."""
    solver.received = {C_RECORD: control_variate_record({"weight": np.asarray([c], dtype=np.float64)})}
    return train_config(server_round=r, lr=lr)


def sgd_steps(solver, model, grads, lr):
    opt = solver.make_optimizer(model, lr)
    for g in grads:
        opt.zero_grad()
        model.weight.grad = torch.tensor([g], dtype=model.weight.dtype)
        solver.transform_gradients(model)
        opt.step()
    solver.local_steps = len(grads)  # what close_round() sets from the trainer's report


# --------------------------------------------------------------------------- #
# SCAFFOLD client
# --------------------------------------------------------------------------- #
def test_control_variate_roundtrip():
    model = linear([1.0, 2.0], dtype=torch.float32)
    record = control_variate_record({"weight": np.array([[0.5, -1.5]], dtype=np.float32)})
    assert received_control_variate({C_RECORD: record}, model)["weight"].tolist() == [[0.5, -1.5]]
    with pytest.raises(KeyError, match="scaffold.c"):
        received_control_variate({}, model)
    # a float64 record for a float32 model arrives as float32 (the model's dtype)
    record = control_variate_record({"weight": np.array([[0.25, -1.0]], dtype=np.float64)})
    got = received_control_variate({C_RECORD: record}, model)["weight"]
    assert got.dtype == torch.float32 and got.tolist() == [[0.25, -1.0]]
    # ... and on the model's device (a meta-device model stands in for a GPU one)
    meta = torch.nn.Linear(2, 1, bias=False, device="meta")
    assert received_control_variate({C_RECORD: record}, meta)["weight"].device.type == "meta"



def test_solver_gradient_is_corrected_gradient():
    """What the solver leaves in p.grad is corrected_gradient(g, c, c_i) = g + c - c_i."""
    np.testing.assert_allclose(corrected_gradient(np.array([1.0, 1.0]), np.array([1.0, 0.0]),
                                                  np.array([0.0, 2.0])), [2.0, -1.0])
    solver = ScaffoldSolver(cfg("scaffold"))
    model, state = linear([0.0, 2.0]), ContextState(RecordDict())
    state.put("scaffold", {"c.weight": torch.tensor([[0.0, 2.0]], dtype=F64)})
    solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
    model.weight.grad = torch.tensor([[1.0, 1.0]], dtype=F64)
    solver.transform_gradients(model)
    assert model.weight.grad.tolist() == [[2.0, -1.0]]


@pytest.mark.parametrize("steps", [0, 1])
def test_scaffold_control_variate_after_zero_and_one_local_step(steps):
    """No local step (nothing to train on): c_i is kept and dc = 0. One step:
    c_i+ = g + wd * y0 (the mean of one gradient), for both rules."""
    for rule in ("mean-gradient", "option-ii"):
        solver = ScaffoldSolver(cfg("scaffold", wd=0.5, **{"cv-update": rule}))
        model, state = linear([0.0, 2.0]), ContextState(RecordDict())
        state.put("scaffold", {"c.weight": torch.tensor([[0.0, 2.0]], dtype=F64)})
        solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
        sgd_steps(solver, model, [[1.0, 1.0]] * steps, 0.1)
        dc = solver.end_round(model, state)[DC_RECORD]["weight"].numpy()[0]
        new = state.get("scaffold", torch.device("cpu"))["c.weight"].numpy()[0]
        want = [0.0, 2.0] if steps == 0 else [1.0, 2.0]  # g + 0.5 * [0, 2]
        np.testing.assert_allclose(new, want, atol=1e-14, err_msg=rule)
        np.testing.assert_allclose(dc, np.subtract(want, [0.0, 2.0]), atol=1e-14, err_msg=rule)


def test_scaffold_correction_through_momentum_and_dc_by_hand():
    """c = [1, 0], c_i = [0, 2] (stored), lr 0.1, momentum 0.5, grads [1,1], [2,0]."""
    solver = ScaffoldSolver(cfg("scaffold", momentum=0.5))
    model, state = linear([0.0, 2.0]), ContextState(RecordDict())
    state.put("scaffold", {"c.weight": torch.tensor([[0.0, 2.0]], dtype=F64)})
    solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
    sgd_steps(solver, model, [[1.0, 1.0], [2.0, 0.0]], 0.1)
    # corrected: [2,-1] then [3,-2]; buf [2,-1] then [4,-2.5]; w [-0.2,2.1] then [-0.6,2.35]
    np.testing.assert_allclose(model.weight.detach().numpy()[0], [-0.6, 2.35], atol=1e-14)
    extra = solver.end_round(model, state)
    # mean-gradient rule: c_i+ = mean([1,1],[2,0]) = [1.5, 0.5]; dc = [1.5, -1.5]
    np.testing.assert_allclose(extra[DC_RECORD]["weight"].numpy()[0], [1.5, -1.5], atol=1e-14)
    assert state.get("scaffold", torch.device("cpu"))["c.weight"].tolist() == [[1.5, 0.5]]


def test_scaffold_mean_gradient_includes_weight_decay_by_hand():
    """c = [1, 0], c_i = [0, 2], lr 0.1, weight decay 0.5, no momentum, grads [1,1], [2,0].

    The mean-gradient c_i+ is the mean of g_k + wd * y_k (the gradient of the
    local objective SGD minimises), y_k the weights the gradient was taken at."""
    solver = ScaffoldSolver(cfg("scaffold", wd=0.5))
    model, state = linear([0.0, 2.0]), ContextState(RecordDict())
    state.put("scaffold", {"c.weight": torch.tensor([[0.0, 2.0]], dtype=F64)})
    solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
    sgd_steps(solver, model, [[1.0, 1.0], [2.0, 0.0]], 0.1)
    # step 1 at y0 = [0, 2]: g + wd y = [1, 2]; SGD direction [2,-1] + 0.5 [0,2] = [2, 0]; y1 = [-0.2, 2]
    # step 2 at y1: g + wd y = [1.9, 1]; direction [3,-2] + 0.5 [-0.2,2] = [2.9, -1]; y2 = [-0.49, 2.1]
    np.testing.assert_allclose(model.weight.detach().numpy()[0], [-0.49, 2.1], atol=1e-14)
    extra = solver.end_round(model, state)
    # c_i+ = mean([1, 2], [1.9, 1]) = [1.45, 1.5]; dc = c_i+ - c_i = [1.45, -0.5]
    np.testing.assert_allclose(extra[DC_RECORD]["weight"].numpy()[0], [1.45, -0.5], atol=1e-14)
    np.testing.assert_allclose(state.get("scaffold", torch.device("cpu"))["c.weight"].numpy()[0],
                               [1.45, 1.5], atol=1e-14)


@pytest.mark.parametrize("wd", [0.0, 0.5])
def test_option_ii_equals_mean_gradient_without_momentum(wd):
    """Plain SGD: (x - y_K)/(K lr) + c_i - c = mean of (g_k + wd y_k), weight decay included."""
    out = {}
    for rule in ("mean-gradient", "option-ii"):
        solver = ScaffoldSolver(cfg("scaffold", wd=wd, **{"cv-update": rule}))
        model, state = linear([0.0, 2.0]), ContextState(RecordDict())
        state.put("scaffold", {"c.weight": torch.tensor([[0.0, 2.0]], dtype=F64)})
        solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
        sgd_steps(solver, model, [[1.0, 1.0], [2.0, 0.0], [-1.0, 3.0]], 0.1)
        out[rule] = solver.end_round(model, state)[DC_RECORD]["weight"].numpy()[0]
    np.testing.assert_allclose(out["option-ii"], out["mean-gradient"], atol=1e-13)
    np.testing.assert_allclose(option_ii_control_variate(0.0, 0.0, 1.0, 0.5, 5, 0.1), 1.0)


def test_option_ii_overstates_control_variate_with_momentum():
    """Constant gradient g=1, 50 local steps, momentum 0.8: option II gives ~5."""
    got = {}
    for rule in ("mean-gradient", "option-ii"):
        solver = ScaffoldSolver(cfg("scaffold", momentum=0.8, **{"cv-update": rule}))
        model, state = linear([0.0]), ContextState(RecordDict())
        solver.begin_round(model, c_config(solver, [0.0], lr=0.01), state)
        sgd_steps(solver, model, [[1.0]] * 50, 0.01)
        got[rule] = float(solver.end_round(model, state)[DC_RECORD]["weight"].numpy()[0, 0])
    assert got["mean-gradient"] == pytest.approx(1.0, abs=1e-14)
    # (K - m (1 - m^K)/(1 - m)) / (K (1 - m)) = (50 - 4)/10 = 4.6
    assert got["option-ii"] == pytest.approx(4.6, abs=1e-4)


# --------------------------------------------------------------------------- #
# servers and byte accounting
# --------------------------------------------------------------------------- #

def rec(v):
    return ArrayRecord({"w": Array(np.asarray(v, dtype=np.float32))})


def one_round(strategy, r, x, models, extra=None):
    msgs = list(strategy.configure_train(r, rec(x), ConfigRecord(), StubGrid(NODES.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{r}m{i}"
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    replies = []
    for p in range(3):
        content = {"arrays": rec(models[p]), "metrics": MetricRecord({"num-examples": 10 * (p + 1), "train-loss": 1.0})}
        if extra:
            content[DC_RECORD] = rec(extra[p])
        replies.append(Message(RecordDict(content), reply_to=by_node[NODES[p]]))
    arrays, _ = strategy.aggregate_train(r, replies)
    return msgs, replies, arrays["w"].numpy()


def test_scaffold_server_steps_and_bytes_by_hand():
    nodes = {**NODES, 3: 104}  # N = 4 clients, 3 sampled
    strategy = get_algorithm("scaffold").build_strategy(cfg("scaffold", **{"server-lr": 0.5}), Federation(nodes))
    strategy.sample_cohort = lambda r: [0, 1, 2]
    msgs, replies, x = one_round(strategy, 1, [1.0, 2.0], [[0.5, 1.0], [2.0, 4.0], [3.5, 1.0]],
                                 extra=[[1.0, 0.0], [2.0, 4.0], [3.0, -4.0]])
    # x + 0.5 * (mean - x) = [1,2] + 0.5 * ([2,2] - [1,2]) = [1.5, 2]
    np.testing.assert_allclose(x, [1.5, 2.0], atol=1e-6)
    np.testing.assert_allclose(strategy.c["w"], [6.0 / 4, 0.0], atol=1e-7)  # c += sum(dc)/N
    assert all(m.content.array_records[C_RECORD]["w"].numpy().tolist() == [0.0, 0.0] for m in msgs)
    model_bytes = payload_bytes(rec([1.0, 2.0]))
    log = strategy.rounds[1]
    c_bytes = payload_bytes(msgs[0].content.array_records[C_RECORD])
    assert c_bytes > 2 * 4  # the float32 c with its .npy header
    assert log.bytes_down == 3 * (model_bytes + c_bytes)  # model + c, per client
    assert log.bytes_up == 3 * (model_bytes + payload_bytes(rec([1.0, 0.0])))  # y_i + dc_i
    # round 2 sends the new c
    msgs, _, _ = one_round(strategy, 2, x, [[0.0, 0.0]] * 3, extra=[[0.0, 0.0]] * 3)
    assert msgs[0].content.array_records[C_RECORD]["w"].numpy().tolist() == [1.5, 0.0]


# --------------------------------------------------------------------------- #
# FedDC (SCAFFOLD's correction plus a local drift variable)
# --------------------------------------------------------------------------- #
def feddc_state(c_i, h_i):
    state = ContextState(RecordDict())
    state.put("feddc", {"c.weight": torch.tensor([c_i], dtype=F64), "h.weight": torch.tensor([h_i], dtype=F64)})
    return state


def test_feddc_rules_by_hand():
    np.testing.assert_allclose(drift_gradient(np.array([0.0, 2.0]), np.array([1.0, 1.0]), np.array([2.0, -1.0]), 0.5),
                               [0.5, 0.0])  # 0.5 ([0,2] - [1,1] + [2,-1])
    np.testing.assert_allclose(drift_update(np.array([1.0, -1.0]), np.array([0.5, 3.0]), np.array([0.0, 2.0])),
                               [1.5, 0.0])
    assert drift_sum_update(1.0, 3.0) == 4.0 and feddc_server_model(2.0, 3.0, 4) == 2.75


@pytest.mark.parametrize("rule, formula", [
    (drift_gradient, lambda theta, x, h, alpha: alpha * (theta - x + h)),  # FedDC's: + h_i
    (dynamic_gradient, lambda theta, x, h, alpha: alpha * (theta - x) - h),  # FedDyn's: - grad_prev
], ids=["feddc-drift", "feddyn-dynamic"])
def test_a_per_step_pull_formed_in_place_leaves_its_inputs_alone_and_is_the_formula_bit_for_bit(rule, formula):
    """FedDC's drift and FedDyn's dynamic gradient are formed in place in one
    new array: on a cohort's stacks (the anchor expanded over the clients,
    as the cohort trainer passes it) each is its formula to the bit, and
    none of the three inputs changes."""
    gen = torch.Generator().manual_seed(0)
    theta, third = torch.randn(5, 3, 4, generator=gen), torch.randn(5, 3, 4, generator=gen)
    x = torch.randn(3, 4, generator=gen).expand(5, 3, 4)
    before = [t.clone() for t in (theta, x, third)]
    got = rule(theta, x, third, 0.37)
    assert torch.equal(got, formula(*before, 0.37))
    assert all(torch.equal(t, b) for t, b in zip((theta, x, third), before))
    assert got.data_ptr() not in {t.data_ptr() for t in (theta, x, third)}


def test_feddc_steps_through_momentum_and_new_state_by_hand():
    """alpha 0.5, x = [0, 2], c = [1, 0], c_i = [0, 2], h_i = [1, -1], lr 0.1,
    momentum 0.5, task gradients [1, 1] then [2, 0]."""
    solver = FedDCSolver(cfg("feddc", momentum=0.5, alpha=0.5))
    model, state = linear([0.0, 2.0]), feddc_state([0.0, 2.0], [1.0, -1.0])
    solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
    sgd_steps(solver, model, [[1.0, 1.0], [2.0, 0.0]], 0.1)
    # step 1: drift 0.5([0,0] + [1,-1]) = [0.5,-0.5]; d = [1.5,0.5] + [1,-2] = [2.5,-1.5]; w = [-0.25, 2.15]
    # step 2: drift 0.5([-0.25,0.15] + [1,-1]) = [0.375,-0.425]; d = [2.375,-0.425] + [1,-2] = [3.375,-2.425];
    #         buf = 0.5 [2.5,-1.5] + d = [4.625,-3.175]; w = [-0.7125, 2.4675]
    np.testing.assert_allclose(model.weight.detach().numpy()[0], [-0.7125, 2.4675], atol=1e-14)
    extra = solver.end_round(model, state)
    # c_i+ = mean of g + drift = ([1.5,0.5] + [2.375,-0.425]) / 2 = [1.9375, 0.0375]; dc = c_i+ - [0, 2]
    np.testing.assert_allclose(extra[DC_RECORD]["weight"].numpy()[0], [1.9375, -1.9625], atol=1e-14)
    kept = state.get("feddc", torch.device("cpu"))
    np.testing.assert_allclose(kept["c.weight"].numpy()[0], [1.9375, 0.0375], atol=1e-14)
    # h_i+ = h_i + (w - x) = [1,-1] + [-0.7125, 0.4675]
    np.testing.assert_allclose(kept["h.weight"].numpy()[0], [0.2875, -0.5325], atol=1e-14)


def test_feddc_control_variate_rules_agree_without_momentum():
    """Plain SGD (no momentum, clipping or local GC): option II's
    c_i - c + (x - y)/(K lr) is the mean of the steps' gradients without the
    correction (task, weight decay, drift), the mean-gradient rule. One step,
    no weight decay, by hand: g + alpha (x - x + h_i) = [1.5, 0.5]; three
    steps with weight decay: the two rules agree."""
    def new_c_i(rule, grads, wd):
        solver = FedDCSolver(cfg("feddc", wd=wd, alpha=0.5, **{"cv-update": rule}))
        model, state = linear([0.0, 2.0]), feddc_state([0.0, 2.0], [1.0, -1.0])
        solver.begin_round(model, c_config(solver, [1.0, 0.0]), state)
        sgd_steps(solver, model, grads, 0.1)
        solver.end_round(model, state)
        return state.get("feddc", torch.device("cpu"))["c.weight"].numpy()[0]

    for rule in ("mean-gradient", "option-ii"):
        np.testing.assert_allclose(new_c_i(rule, [[1.0, 1.0]], 0.0), [1.5, 0.5], atol=1e-13, err_msg=rule)
    grads = [[1.0, 1.0], [2.0, -0.5], [-1.0, 3.0]]
    np.testing.assert_allclose(new_c_i("option-ii", grads, 0.1), new_c_i("mean-gradient", grads, 0.1), atol=1e-12)


def test_feddc_server_by_hand():
    """N = 4, three replies: c += sum(dc) / N, H += sum(theta_i - x), x = mean + H / N;
    a second round with no movement adds the mean drift again (the authors' rule)."""
    nodes = {**NODES, 3: 104}
    strategy = get_algorithm("feddc").build_strategy(cfg("feddc"), Federation(nodes))
    strategy.sample_cohort = lambda r: [0, 1, 2]
    msgs, _, x = one_round(strategy, 1, [1.0, 2.0], [[0.5, 1.0], [2.0, 4.0], [3.5, 1.0]],
                           extra=[[1.0, 0.0], [2.0, 4.0], [3.0, -4.0]])
    assert all(m.content.array_records[C_RECORD]["w"].numpy().tolist() == [0.0, 0.0] for m in msgs)
    np.testing.assert_allclose(strategy.c["w"], [1.5, 0.0], atol=1e-7)
    np.testing.assert_allclose(strategy.h_sum["w"], [3.0, 0.0], atol=1e-12)  # 3 ([2,2] - [1,2])
    np.testing.assert_allclose(x, [2.75, 2.0], atol=1e-6)  # [2,2] + [3,0] / 4
    msgs, _, x = one_round(strategy, 2, x, [[2.75, 2.0]] * 3, extra=[[0.0, 0.0]] * 3)
    assert msgs[0].content.array_records[C_RECORD]["w"].numpy().tolist() == [1.5, 0.0]
    np.testing.assert_allclose(x, [3.5, 2.0], atol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_feddc_alpha_must_be_positive(alpha):
    with pytest.raises(ConfigError, match=rf"feddc.alpha={alpha!r}: must be > 0"):
        cfg("feddc", alpha=alpha)


@pytest.mark.parametrize("alpha", [0.0, -0.5])
def test_feddyn_alpha_must_be_positive(alpha):
    """alpha = 0 would divide h by zero in the server step: refused by name."""
    with pytest.raises(ConfigError, match=rf"feddyn.alpha={alpha!r}: must be > 0"):
        cfg("feddyn", alpha=alpha)


def test_pure_server_rules():
    assert model_step(1.0, 2.0, 0.5) == 2.0 and control_step(1.0, 6.0, 4) == 2.5
    assert h_update(1.0, 3.0, 0.5, 3) == 0.5 and server_model(2.0, 0.5, 0.25) == 0.0


def test_feddyn_server_by_hand():
    strategy = get_algorithm("feddyn").build_strategy(cfg("feddyn", alpha=0.5), Federation(dict(NODES)))
    _, _, x = one_round(strategy, 1, [1.0, 2.0], [[0.5, 1.0], [2.0, 4.0], [3.5, 1.0]])
    # sum(theta_k - x) = [3, 0]; h = -0.5/3 [3, 0] = [-0.5, 0]; theta = [2,2] - h/0.5 = [3, 2]
    np.testing.assert_allclose(strategy.h["w"], [-0.5, 0.0], atol=1e-12)
    np.testing.assert_allclose(x, [3.0, 2.0], atol=1e-6)


def test_feddyn_server_divides_by_all_clients_by_hand():
    """N = 4 clients, 3 sampled: h moves by alpha/N (not alpha/|P|) times the summed updates."""
    nodes = {**NODES, 3: 104}
    strategy = get_algorithm("feddyn").build_strategy(cfg("feddyn", alpha=0.5), Federation(nodes))
    strategy.sample_cohort = lambda r: [0, 1, 2]
    _, _, x = one_round(strategy, 1, [1.0, 2.0], [[0.5, 1.0], [2.0, 4.0], [3.5, 1.0]])
    # sum(theta_k - x) = [3, 0]; h = -0.5/4 [3, 0] = [-0.375, 0]; theta = [2, 2] - h/0.5 = [2.75, 2]
    np.testing.assert_allclose(strategy.h["w"], [-0.375, 0.0], atol=1e-12)
    np.testing.assert_allclose(x, [2.75, 2.0], atol=1e-6)
    # round 2 from [2.75, 2], client 3 alone: sum = [0.25, 1]; h = [-0.375, 0] - 0.5/4 [0.25, 1]
    strategy.sample_cohort = lambda r: [3]
    msgs = list(strategy.configure_train(2, rec(x), ConfigRecord(), StubGrid(nodes.values())))
    msgs[0].metadata.__dict__["_message_id"] = "r2m0"
    reply = Message(RecordDict({"arrays": rec([3.0, 3.0]),
                                "metrics": MetricRecord({"num-examples": 5, "train-loss": 1.0})}),
                    reply_to=msgs[0])
    arrays, _ = strategy.aggregate_train(2, [reply])
    np.testing.assert_allclose(strategy.h["w"], [-0.40625, -0.125], atol=1e-12)
    np.testing.assert_allclose(arrays["w"].numpy(), [3.8125, 3.25], atol=1e-6)  # [3,3] - h/0.5


def federated_rounds(algo, cohorts, n=4, momentum=0.5, wd=0.1, lr=0.05, steps=4, **params):
    """The real strategy (configure_train / aggregate_train) and the real solver
    on client p's least squares (float64 one-row linear model), one cohort per
    round; yields (round, strategy, client states) after every round."""
    H, c, _, _ = heterogeneous_least_squares(n, 3, 8, seed=1)
    nodes = {p: 201 + p for p in range(n)}
    conf = cfg(algo, momentum=momentum, wd=wd, **params)
    strategy = get_algorithm(algo).build_strategy(conf, Federation(dict(nodes)))
    strategy.sample_cohort = lambda r: list(cohorts[r - 1])
    solver = get_algorithm(algo).solver(conf)
    states = [ContextState(RecordDict()) for _ in range(n)]
    x = ArrayRecord({"weight": Array(np.zeros((1, 3)))})
    for r in range(1, len(cohorts) + 1):
        replies = []
        for i, msg in enumerate(strategy.configure_train(r, x, ConfigRecord(), StubGrid(nodes.values()))):
            msg.metadata.__dict__["_message_id"] = f"r{r}m{i}"
            p = strategy.federation.partition_of_node[msg.metadata.dst_node_id]
            model = linear(msg.content["arrays"]["weight"].numpy()[0].tolist())
            solver.received = {k: v for k, v in msg.content.array_records.items() if k != "arrays"}
            solver.begin_round(model, train_config(server_round=r, lr=lr), states[p])
            quadratic_local_steps(solver, model, lr, H[p], c[p], steps)
            extra = solver.end_round(model, states[p])
            content = {"arrays": ArrayRecord({"weight": Array(model.weight.detach().numpy().copy())}),
                       "metrics": MetricRecord({"num-examples": 10 * (p + 1), "train-loss": 1.0}), **extra}
            replies.append(Message(RecordDict(content), reply_to=msg))
        x, _ = strategy.aggregate_train(r, replies)
        yield r, strategy, states


@pytest.mark.parametrize("algo, name, key, server_state", [
    ("feddyn", "feddyn", "grad_prev.weight", lambda s: s.h["weight"]),
    ("scaffold", "scaffold", "c.weight", lambda s: s.c["weight"]),
    ("feddc", "feddc", "c.weight", lambda s: s.c["weight"]),
    ("feddc", "feddc", "h.weight", lambda s: s.h_sum["weight"] / 4),  # H / N = the mean drift
])
def test_server_state_is_mean_over_all_clients(algo, name, key, server_state):
    """Partial participation (2 of N = 4 per round, client 3 never sampled):
    FedDyn's h equals the mean over all N clients of their grad_prev, and
    SCAFFOLD's c the mean over all N of their c_i (a never-sampled client
    counts with its zero state), after every round."""
    cohorts = [(0, 1), (1, 2), (0, 2), (2, 1), (0, 1)]
    params = {"alpha": 0.5} if algo in ("feddyn", "feddc") else {}
    for r, strategy, states in federated_rounds(algo, cohorts, **params):
        client = [st.get(name, torch.device("cpu")) for st in states]
        assert client[3] is None  # never sampled: its state is still the initial zero
        mean = sum(s[key].numpy() for s in client if s is not None) / len(states)
        assert np.abs(mean).max() > 1e-3  # not trivially zero
        np.testing.assert_allclose(server_state(strategy), mean, rtol=0, atol=1e-12, err_msg=f"round {r}")


# --------------------------------------------------------------------------- #
# FedDyn client
# --------------------------------------------------------------------------- #
def test_feddyn_gradient_through_momentum_and_state_by_hand():
    """alpha 0.5, grad_prev [1, -1], server [0, 2], lr 0.1, momentum 0.5."""
    solver = FedDynSolver(cfg("feddyn", momentum=0.5, alpha=0.5))
    model, state = linear([0.0, 2.0]), ContextState(RecordDict())
    state.put("feddyn", {"grad_prev.weight": torch.tensor([[1.0, -1.0]], dtype=F64)})
    solver.begin_round(model, train_config(server_round=2), state)
    sgd_steps(solver, model, [[1.0, 1.0], [2.0, 0.0]], 0.1)
    # step 1: d = [1,1] - [1,-1] + 0 = [0, 2]; buf [0,2]; w = [0, 1.8]
    # step 2: d = [2,0] - [1,-1] + 0.5 [0,-0.2] = [1, 0.9]; buf = [1, 1.9]; w = [-0.1, 1.61]
    np.testing.assert_allclose(model.weight.detach().numpy()[0], [-0.1, 1.61], atol=1e-14)
    solver.end_round(model, state)
    # grad_prev - 0.5 (w - server) = [1,-1] - 0.5 [-0.1, -0.39] = [1.05, -0.805]
    got = state.get("feddyn", torch.device("cpu"))["grad_prev.weight"].numpy()[0]
    np.testing.assert_allclose(got, [1.05, -0.805], atol=1e-14)
    np.testing.assert_allclose(dynamic_gradient(np.array([1.0]), np.array([0.0]), np.array([2.0]), 0.5), [-1.5])
    np.testing.assert_allclose(grad_prev_update(1.0, 3.0, 1.0, 0.5), 0.0)


# --------------------------------------------------------------------------- #
# heterogeneous least squares, full participation, real solvers
# --------------------------------------------------------------------------- #
N, D, M = 10, 5, 20


@pytest.fixture(scope="module")
def lsq():
    H, c, z_star, _ = heterogeneous_least_squares(N, D, M)
    return H, c, z_star


def run(lsq, algo, rounds, momentum=0.0, lr=0.05, steps=5, **params):
    """The real solver with client i's least-squares gradient in p.grad; the
    server steps of the strategy module (pure rules), full participation."""
    H, c, z_star = lsq
    conf = cfg(algo, momentum=momentum, **params) if algo != "fedavg" else cfg("fedavg", momentum=momentum)
    solver = get_algorithm(algo).solver(conf)
    states = [ContextState(RecordDict()) for _ in range(N)]
    model = torch.nn.Linear(D, 1, bias=False, dtype=F64)
    x, cv, h = np.zeros(D), np.zeros(D), np.zeros(D)
    for r in range(1, rounds + 1):
        ys, dcs = [], []
        for i in range(N):
            with torch.no_grad():
                model.weight.copy_(torch.tensor(x[None]))
            config = train_config(server_round=r, lr=lr)
            solver.received = {C_RECORD: control_variate_record({"weight": cv[None]})}
            solver.begin_round(model, config, states[i])
            quadratic_local_steps(solver, model, lr, H[i], c[i], steps)
            extra = solver.end_round(model, states[i])
            ys.append(model.weight.detach().numpy()[0].copy())
            if DC_RECORD in extra:
                dcs.append(extra[DC_RECORD]["weight"].numpy()[0])
        mean = np.mean(ys, axis=0)
        if algo == "scaffold":
            x, cv = model_step(x, mean - x, 1.0), control_step(cv, sum(dcs), N)
        elif algo == "feddc":
            h = drift_sum_update(h, sum(y - x for y in ys))
            x, cv = feddc_server_model(mean, h, N), control_step(cv, sum(dcs), N)
        elif algo == "feddyn":
            alpha = conf.algo_params.alpha
            h = h_update(h, sum(y - x for y in ys), alpha, N)
            x = server_model(mean, h, alpha)
        else:
            x = mean
    return np.linalg.norm(x - z_star)


@pytest.fixture(scope="module")
def fedavg_error(lsq):
    return run(lsq, "fedavg", 80)


def test_fedavg_stalls_at_biased_point(lsq, fedavg_error):
    assert fedavg_error > 0.1


@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_scaffold_reaches_global_minimizer(lsq, fedavg_error, momentum):
    assert run(lsq, "scaffold", 100, momentum=momentum) < 1e-7 < 1e-5 * fedavg_error


def test_scaffold_option_ii_with_momentum_diverges(lsq, fedavg_error):
    """The notes' pitfall, reproduced: option II's c_i with momentum 0.8 blows up."""
    early = run(lsq, "scaffold", 30, momentum=0.8, **{"cv-update": "option-ii"})
    late = run(lsq, "scaffold", 60, momentum=0.8, **{"cv-update": "option-ii"})
    assert late > 10 * early > 10 * fedavg_error


@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_feddc_reaches_global_minimizer(lsq, fedavg_error, momentum):
    """FedDC (SCAFFOLD's correction plus the drift pull) on the heterogeneous
    least squares, full participation: the exact global minimizer, where FedAvg stalls."""
    assert run(lsq, "feddc", 200, momentum=momentum, alpha=0.5) < 1e-10 < 1e-8 * fedavg_error


def test_feddyn_reaches_global_minimizer(lsq, fedavg_error):
    assert run(lsq, "feddyn", 80, alpha=1.0) < 1e-6 < 1e-4 * fedavg_error
