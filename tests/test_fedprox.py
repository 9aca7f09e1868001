"""FedProx: the local proximal hook (``fedaccel/clients/fedprox.py``) checked against
values computed by hand, and the ``proximal-mu`` its strategy
(``fedaccel/strategies/fedprox.py``) sends with every training message."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fedaccel.clients.base import TrainData
from fedaccel.clients.fedprox import FedProxSolver
from fakes import arrays, build, configure, run_cfg, train_config
from fedaccel.contract import ContractError, train_config_record

pytestmark = pytest.mark.usefixtures("server_identity")


# --------------------------------------------------------------------------- #
# FedProx local hook
# --------------------------------------------------------------------------- #
def fedprox_solver(mu: float = 0.5) -> FedProxSolver:
    return FedProxSolver(run_cfg("fedprox", **{"fedprox.mu": mu}))


def linear(weight) -> torch.nn.Linear:
    w = torch.tensor(weight, dtype=torch.float32)
    model = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    return model


def test_fedprox_adds_proximal_gradient():
    solver = fedprox_solver()
    model = linear([[1.0, 2.0]])
    solver.begin_round(model, train_config(**{"proximal-mu": 0.5}), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))  # in place: the anchor must be a copy
    model.weight.grad = torch.tensor([[0.1, 0.2]])
    solver.transform_gradients(model)
    # 0.1 + 0.5 * (3 - 1), 0.2 + 0.5 * (-1 - 2)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.1, -1.3]]))


def test_fedprox_mu_from_config_overrides_params():
    solver = fedprox_solver(mu=0.5)
    model = linear([[0.0, 0.0]])
    solver.begin_round(model, train_config(**{"proximal-mu": 2.0}), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    model.weight.grad = torch.zeros(1, 2)
    solver.transform_gradients(model)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[2.0, -2.0]]))


def test_fedprox_message_without_mu_is_refused_naming_algorithm_and_key():
    """proximal-mu is in FedProx's message contract: a training message without
    it (another fedaccel version on the server) is refused, not defaulted."""
    solver = fedprox_solver(mu=0.25)
    model = linear([[0.0, 0.0]])
    data = TrainData(x=torch.tensor([[1.0, 0.0]]), y=torch.tensor([0]))
    with pytest.raises(ContractError, match=r"fedprox: .*config lacks 'proximal-mu'"):
        solver.fit(model, data, train_config_record(1, 1.0, 1), RecordDict(), torch.Generator())


def test_fedprox_mu_zero_leaves_gradient_unchanged():
    solver = fedprox_solver()
    model = linear([[1.0, 2.0]])
    solver.begin_round(model, train_config(**{"proximal-mu": 0.0}), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))
    model.weight.grad = torch.tensor([[0.1, 0.2]])
    solver.transform_gradients(model)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.1, 0.2]]))


def test_fedprox_hook_then_sgd_step():
    solver = fedprox_solver()
    model = linear([[1.0, 2.0]])
    solver.begin_round(model, train_config(**{"proximal-mu": 0.5}), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))
    optimizer = solver.make_optimizer(model, lr=0.1)
    model.weight.grad = torch.tensor([[0.1, 0.2]])
    solver.transform_gradients(model)
    optimizer.step()
    # w - lr * (g + mu (w - w0)) = [3 - 0.1*1.1, -1 + 0.1*1.3]
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[2.89, -0.87]]))


def test_fedprox_fit_two_steps_by_hand():
    """fit(): 2 epochs over one sample (x=[1, 0], y=0), lr 1, mu 0.5, W0 = 0.

    Step 1: logits 0, softmax (1/2, 1/2), dL/dW = [[-1/2, 0], [1/2, 0]], no
    proximal pull (W = W0) -> W1 = [[1/2, 0], [-1/2, 0]], loss ln 2.
    Step 2: logits (1/2, -1/2), p0 = sigmoid(1); dL/dW = [[p0-1, 0], [1-p0, 0]]
    plus mu W1 -> W2 = W1 - (dL/dW + 0.5 W1), loss -ln sigmoid(1).
    """
    solver = fedprox_solver()
    model = linear([[0.0, 0.0], [0.0, 0.0]])
    data = TrainData(x=torch.tensor([[1.0, 0.0]]), y=torch.tensor([0]))
    gen = torch.Generator().manual_seed(0)
    result = solver.fit(model, data, train_config_record(1, 1.0, 2, {"proximal-mu": 0.5}),
                        RecordDict(), gen)

    w1 = np.array([[0.5, 0.0], [-0.5, 0.0]])
    p0 = 1.0 / (1.0 + math.exp(-1.0))
    grad2 = np.array([[p0 - 1.0, 0.0], [1.0 - p0, 0.0]]) + 0.5 * w1
    w2 = w1 - 1.0 * grad2
    np.testing.assert_allclose(result.arrays["weight"].numpy(), w2, rtol=1e-6, atol=1e-7)
    assert result.metrics["local-steps"] == 2
    assert result.metrics["num-examples"] == 1
    expected_loss = (math.log(2.0) - math.log(p0)) / 2
    assert result.metrics["train-loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert result.extra == {}


# --------------------------------------------------------------------------- #
# the strategy's training messages
# --------------------------------------------------------------------------- #
def test_fedprox_messages_carry_configured_mu():
    strategy = build("fedprox", **{"fedprox.mu": 0.5})
    for m in configure(strategy, 1, arrays(w=[0.0])):
        assert m.content["config"]["proximal-mu"] == 0.5


def test_auto_straggler_policy_keeps_stragglers_partial_work():
    """FedProx (Li et al. 2020) aggregates the partial work of stragglers
    where FedAvg drops it: 'auto' means 'partial' for fedprox,
    'drop' still for fedavg; an explicit 'drop' is kept."""
    from fedaccel.local_run import default_run_config
    from fedaccel.run_config import parse_run_config

    def policy(algo, value):
        cfg = default_run_config()
        cfg.update({"algo": algo, "straggler-policy": value, "straggler-fraction": 0.5})
        return parse_run_config(cfg).straggler_policy

    assert policy("fedprox", "auto") == "partial"
    assert policy("fedavg", "auto") == "drop"
    assert policy("fedprox", "drop") == "drop"
