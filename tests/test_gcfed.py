"""Gradient centralization (GC-Fed): the pure functions on hand-computed
tensors, the lambda split on a known model, the config keys, and GC composed
with another algorithm (FedProx) through fedaccel.clients.composition."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.clients.base import TrainData
from fedaccel.clients.fedprox import FedProxSolver
from fedaccel.clients.gradient_centralization import (
    centralize, gc_partition, global_gc_transform, global_gc_update, in_layers, local_gc_split,
)
from fedaccel.clients.composition import client_gradient_transforms, server_update_transforms
from fedaccel.contract import train_config_record
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config
from fedaccel.registry import get_algorithm
from fedaccel.models import build_model
from fedaccel.membership import Federation

from fakes import StubGrid, train_config

pytestmark = pytest.mark.usefixtures("server_identity")

NODES = {0: 101, 1: 102, 2: 103}
MLP_NAMES = ["fc1.weight", "fc1.bias", "fc.weight", "fc.bias"]



def run_cfg(algo: str, **changes):
    cfg = default_run_config()
    cfg.update({"algo": algo, "clients-per-round": 3, "momentum": 0.0, "weight-decay": 0.0})
    cfg.update(changes)
    return parse_run_config(cfg)


# --------------------------------------------------------------------------- #
# centralize
# --------------------------------------------------------------------------- #
def test_centralize_by_hand():
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 7.0]])
    torch.testing.assert_close(centralize(g), torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]]))
    assert torch.equal(g, torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 7.0]]))  # input untouched


def test_centralize_conv_zero_mean_per_output_channel_and_idempotent():
    g = torch.randn(5, 3, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    c = centralize(g)
    torch.testing.assert_close(c.mean(dim=(1, 2, 3)), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(centralize(c), c, rtol=0, atol=1e-15)
    # P is a projection: the removed part is constant over each output row
    removed = g - c
    torch.testing.assert_close(removed, removed[:, :1, :1, :1].expand_as(removed))


def test_centralize_vectors():
    b = torch.tensor([1.0, 2.0, 6.0])
    torch.testing.assert_close(centralize(b), b)  # default: 1-D tensors unchanged
    torch.testing.assert_close(centralize(b, vectors="mean"), torch.tensor([-2.0, -1.0, 3.0]))
    torch.testing.assert_close(centralize(torch.tensor(3.0)), torch.tensor(3.0))


# --------------------------------------------------------------------------- #
# lambda split
# --------------------------------------------------------------------------- #
def test_split_on_the_mlp():
    model = build_model("mlp", (60,), 10)
    named = list(model.named_parameters())
    assert [n for n, _ in named] == MLP_NAMES
    assert local_gc_split(named, 0.5) == (MLP_NAMES[:2], MLP_NAMES[2:])
    assert local_gc_split(named, 0.9) == (MLP_NAMES[:3], MLP_NAMES[3:])  # floor(3.6) = 3
    assert local_gc_split(named, 1.0) == (MLP_NAMES, [])
    assert local_gc_split(named, 0.0) == ([], MLP_NAMES)
    # the classifier named explicitly goes global whatever lambda says
    assert local_gc_split(named, 1.0, "fc") == (MLP_NAMES[:2], MLP_NAMES[2:])
    assert local_gc_split(named, 0.25, "fc") == (MLP_NAMES[:1], MLP_NAMES[1:])


def test_split_floor_tolerance_and_layer_matching():
    names = [f"t{i}" for i in range(100)]
    assert len(local_gc_split(names, 0.29)[0]) == 29  # 0.29 * 100 = 28.999999999999996
    assert in_layers("fc.weight", ["fc"]) and not in_layers("fc1.weight", ["fc"])
    assert in_layers("layer4.1.conv2.weight", ["layer4"])


def test_partition_modes():
    assert gc_partition("none", MLP_NAMES) == ([], [])
    assert gc_partition("local", MLP_NAMES, 0.0, "fc") == (MLP_NAMES, [])  # LocalGC: lambda 1
    assert gc_partition("global", MLP_NAMES, 1.0, "fc") == ([], MLP_NAMES)  # GlobalGC: lambda 0
    assert gc_partition("hybrid", MLP_NAMES, 1.0, "fc") == (MLP_NAMES[:2], MLP_NAMES[2:])


# --------------------------------------------------------------------------- #
# config
# --------------------------------------------------------------------------- #
def test_gc_defaults_per_algorithm():
    assert run_cfg("fedavg").gc.mode == "none"
    assert run_cfg("fedprox").gc.mode == "none"
    gc = run_cfg("gcfed").gc
    assert (gc.mode, gc.lam, gc.global_layers) == ("hybrid", 1.0, "fc")
    assert run_cfg("gcfed", **{"gc.mode": "local"}).gc.mode == "local"
    assert run_cfg("fedprox", **{"gc.mode": "hybrid"}).gc.mode == "hybrid"
    assert run_cfg("gcfed").algo_params.weighting == "uniform"


@pytest.mark.parametrize("key,value", [("gc.mode", "both"), ("gc.lambda", 1.5), ("gc.lambda", "0.5"),
                                       ("gc.global-layers", 3), ("gcfed.weighting", "x")])
def test_gc_bad_values(key, value):
    with pytest.raises(ConfigError) as info:
        run_cfg("gcfed", **{key: value})
    assert key in str(info.value) and "\n" not in str(info.value)


def solver_optimizer(cfg, model):
    """The optimizer the run's local solver would step ``model`` with."""
    return get_algorithm(cfg.algo).solver(cfg).make_optimizer(model, 1.0)


def local_transforms(cfg, model):
    return client_gradient_transforms(cfg, model, solver_optimizer(cfg, model))


def test_composition_lists():
    model = build_model("mlp", (6,), 3)
    assert local_transforms(run_cfg("fedprox"), model) == []
    assert server_update_transforms(run_cfg("fedprox")) == []
    assert len(local_transforms(run_cfg("fedprox", **{"gc.mode": "local"}), model)) == 1
    assert server_update_transforms(run_cfg("fedprox", **{"gc.mode": "local"})) == []
    assert local_transforms(run_cfg("fedprox", **{"gc.mode": "global"}), model) == []
    assert len(server_update_transforms(run_cfg("fedprox", **{"gc.mode": "global"}))) == 1


# --------------------------------------------------------------------------- #
# GC composed with FedProx: client side
# --------------------------------------------------------------------------- #
def fedprox_one_step(**gc):
    """One full-batch SGD step of the real FedProx solver on a tiny MLP."""
    cfg = run_cfg("fedprox", **{"fedprox.mu": 0.5, "batch-size": 8, "local-epochs": 1, "lr": 0.1, **gc})
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 3)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    data = TrainData(x=torch.randn(8, 6, generator=gen), y=torch.randint(0, 3, (8,), generator=gen))
    result = FedProxSolver(cfg).fit(model, data, train_config_record(1, 0.1, 1, {"proximal-mu": 0.5}), RecordDict(),
                                    torch.Generator().manual_seed(2))
    return {k: torch.from_numpy(result.arrays[k].numpy()) - before[k] for k in before}


def test_local_gc_with_fedprox_changes_only_local_tensors():
    plain = fedprox_one_step()
    hybrid = fedprox_one_step(**{"gc.mode": "hybrid", "gc.lambda": 0.5, "gc.global-layers": ""})
    # fc1.* local: the weight's update is the centralized gradient step (one step:
    # update = -lr * grad, and P is linear); the 1-D bias is left as it is
    torch.testing.assert_close(hybrid["fc1.weight"], centralize(plain["fc1.weight"]), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(hybrid["fc1.weight"], plain["fc1.weight"])
    rows = hybrid["fc1.weight"].shape[0]
    torch.testing.assert_close(hybrid["fc1.weight"].mean(dim=1), torch.zeros(rows), rtol=0, atol=1e-7)
    for name in ("fc1.bias", "fc.weight", "fc.bias"):  # outside the local set: identical
        assert torch.equal(hybrid[name], plain[name]), name
    local = fedprox_one_step(**{"gc.mode": "local"})  # LocalGC: every tensor
    torch.testing.assert_close(local["fc.weight"], centralize(plain["fc.weight"]), rtol=1e-5, atol=1e-7)
    assert torch.equal(local["fc.bias"], plain["fc.bias"])


def test_local_gc_runs_after_the_proximal_term():
    """The composed transform centralizes g + mu (w - w0), FedProx's full gradient."""
    cfg = run_cfg("fedprox", **{"gc.mode": "local"})
    solver = FedProxSolver(cfg)
    model = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    solver.begin_round(model, train_config(**{"proximal-mu": 0.5}), RecordDict())
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, 0.0, 4.0], [0.0, 0.0, 6.0]]))
    model.weight.grad = torch.tensor([[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]])
    solver.transform_gradients(model)  # g + 0.5 w = [[2, 1, 3], [0, 3, 3]]
    for transform in local_transforms(cfg, model):
        transform(model)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.0, -1.0, 1.0], [-2.0, 1.0, 1.0]]))


# --------------------------------------------------------------------------- #
# GC composed with FedProx: server side
# --------------------------------------------------------------------------- #
def one_round(strategy, x: ArrayRecord, client_models, counts):
    msgs = list(strategy.configure_train(1, x, ConfigRecord(), StubGrid(NODES.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    by_node = {m.metadata.dst_node_id: m for m in msgs}
    replies = [Message(RecordDict({"arrays": cm, "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0})}),
                       reply_to=by_node[NODES[pid]])
               for pid, (cm, n) in enumerate(zip(client_models, counts))]
    out, _ = strategy.aggregate_train(1, replies)
    return {k: a.numpy() for k, a in out.items()}


def rec(**named) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float64)) for k, v in named.items()})


X0 = dict(fc1__weight=[[0.0, 0.0], [1.0, 1.0]], fc1__bias=[0.0, 0.0],
          fc__weight=[[0.0, 0.0, 0.0]], fc__bias=[1.0])
CLIENTS = [  # weights (1, 1, 2)
    dict(fc1__weight=[[1.0, 3.0], [1.0, 1.0]], fc1__bias=[1.0, 2.0], fc__weight=[[3.0, 0.0, 0.0]], fc__bias=[2.0]),
    dict(fc1__weight=[[1.0, 3.0], [3.0, 1.0]], fc1__bias=[1.0, 0.0], fc__weight=[[0.0, 3.0, 0.0]], fc__bias=[0.0]),
    dict(fc1__weight=[[2.0, 0.0], [1.0, 2.0]], fc1__bias=[0.0, 2.0], fc__weight=[[0.0, 0.0, 6.0]], fc__bias=[3.0]),
]


def named(d):
    return {k.replace("__", "."): v for k, v in d.items()}


def test_global_gc_with_fedprox_changes_only_global_tensors():
    """Weighted mean (1, 1, 2)/4: fc1.weight [[1.5, 1.5], [1.5, 1.5]], fc1.bias [0.5, 1.5],
    fc.weight [[0.75, 0.75, 3]], fc.bias [2]. Global GC on fc.*: the update
    fc.weight - 0 = [[0.75, 0.75, 3]] has row mean 1.5 -> [[-0.75, -0.75, 1.5]];
    fc.bias (1-D) keeps its update."""
    counts = [1, 1, 2]
    plain = one_round(get_algorithm("fedprox").build_strategy(run_cfg("fedprox"), Federation(dict(NODES))),
                      rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], counts)
    cfg = run_cfg("fedprox", **{"gc.mode": "hybrid"})  # lambda 1, global-layers 'fc'
    gc = one_round(get_algorithm("fedprox").build_strategy(cfg, Federation(dict(NODES))),
                   rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], counts)
    np.testing.assert_allclose(plain["fc.weight"], [[0.75, 0.75, 3.0]])
    np.testing.assert_allclose(gc["fc.weight"], [[-0.75, -0.75, 1.5]], rtol=1e-15)
    for name in ("fc1.weight", "fc1.bias", "fc.bias"):
        np.testing.assert_array_equal(gc[name], plain[name])
    np.testing.assert_allclose(plain["fc1.weight"], [[1.5, 1.5], [1.5, 1.5]])


def test_global_gc_update_is_old_plus_centralized_delta():
    old = rec(w=[[1.0, 2.0], [0.0, 0.0]], b=[0.0])
    new = rec(w=[[2.0, 5.0], [1.0, 1.0]], b=[3.0])
    out = global_gc_update(old, new, ["w", "b"])
    np.testing.assert_allclose(out["w"].numpy(), [[0.0, 3.0], [0.0, 0.0]])  # delta [[1,3],[1,1]]
    np.testing.assert_array_equal(out["b"].numpy(), [3.0])
    assert list(out.keys()) == ["w", "b"]


# --------------------------------------------------------------------------- #
# gcfed aggregation
# --------------------------------------------------------------------------- #
def test_gcfed_examples_weighting_is_fedavg_plus_hybrid_exactly():
    counts = [1, 1, 2]
    a = one_round(get_algorithm("gcfed").build_strategy(run_cfg("gcfed", **{"gcfed.weighting": "examples"}),
                                                        Federation(dict(NODES))),
                  rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], counts)
    b = one_round(get_algorithm("fedavg").build_strategy(run_cfg("fedavg", **{"gc.mode": "hybrid"}),
                                                         Federation(dict(NODES))),
                  rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], counts)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_gcfed_default_is_unweighted_mean_then_global_gc():
    """Algorithm 1 line 13: 1/|K| sum. fc.weight mean [[1, 1, 2]] -> centralized
    update [[-1/3, -1/3, 2/3]]; fc1.* (local tensors) are the plain mean."""
    out = one_round(get_algorithm("gcfed").build_strategy(run_cfg("gcfed"), Federation(dict(NODES))),
                    rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], [1, 1, 2])
    np.testing.assert_allclose(out["fc.weight"], [[-1 / 3, -1 / 3, 2 / 3]], rtol=1e-14)
    np.testing.assert_allclose(out["fc1.weight"], [[4 / 3, 2.0], [5 / 3, 4 / 3]], rtol=1e-14)
    np.testing.assert_allclose(out["fc.bias"], [5 / 3], rtol=1e-14)


def test_global_scope_all_centralizes_every_tensor_of_the_update_by_hand():
    """gc.global-scope='all': Algorithm 1 line 14's "P Delta" on the whole
    update (the authors' code). The local fc1.weight's mean update
    [[4/3, 2], [2/3, 1/3]] (row means 5/3, 1/2) is centralized too:
    X0 + [[-1/3, 1/3], [1/6, -1/6]] = [[-1/3, 1/3], [7/6, 5/6]]; fc.weight as
    with the default 'split'; 1-D tensors keep their update (gc.vectors 'keep')."""
    cfg = run_cfg("gcfed", **{"gc.global-scope": "all"})
    assert cfg.gc.global_scope == "all" and run_cfg("gcfed").gc.global_scope == "split"
    out = one_round(get_algorithm("gcfed").build_strategy(cfg, Federation(dict(NODES))),
                    rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], [1, 1, 2])
    np.testing.assert_allclose(out["fc1.weight"], [[-1 / 3, 1 / 3], [7 / 6, 5 / 6]], rtol=1e-14)
    np.testing.assert_allclose(out["fc.weight"], [[-1 / 3, -1 / 3, 2 / 3]], rtol=1e-14)
    np.testing.assert_allclose(out["fc1.bias"], [2 / 3, 4 / 3], rtol=1e-14)
    np.testing.assert_allclose(out["fc.bias"], [5 / 3], rtol=1e-14)


@pytest.mark.parametrize("mode", ["none", "local", "local-only"])
def test_global_scope_all_without_global_gc_is_refused(mode):
    with pytest.raises(ConfigError, match="gc.global-scope"):
        run_cfg("gcfed", **{"gc.mode": mode, "gc.global-scope": "all"})


def test_global_scope_values_and_auto_modes():
    """An unknown value is refused; 'all' goes with 'global'; gc.mode='auto'
    resolves first, so FedAvg (auto = none) refuses 'all' and GC-Fed (auto =
    hybrid) takes it."""
    with pytest.raises(ConfigError, match="gc.global-scope"):
        run_cfg("gcfed", **{"gc.global-scope": "every"})
    assert run_cfg("fedavg", **{"gc.mode": "global", "gc.global-scope": "all"}).gc.global_scope == "all"
    with pytest.raises(ConfigError, match="gc.mode='none' has none"):
        run_cfg("fedavg", **{"gc.global-scope": "all"})
    assert run_cfg("gcfed", **{"gc.global-scope": "all"}).gc.mode == "hybrid"


def test_global_scope_all_is_the_split_when_local_updates_are_centralized():
    """With the decay centralized, every local step of a local tensor is
    centralized, so is the mean update: 'all' and 'split' agree (section 3.3:
    the locally projected layers "remain unaffected"); with 'raw' decay the
    local tensors' update is not, and only 'all' centralizes it."""
    update = fedprox_one_step(**{"gc.mode": "local", "weight-decay": 0.1, "momentum": 0.9,
                                 "local-epochs": 2, "batch-size": 4})["fc1.weight"]
    old = rec(w=np.zeros(tuple(update.shape)))
    new = rec(w=update.double().numpy())
    split = global_gc_transform("hybrid", 1.0, "")(old, new)  # 'w' is a local tensor: left as it is
    every = global_gc_transform("hybrid", 1.0, "", scope="all")(old, new)
    np.testing.assert_array_equal(split["w"].numpy(), update.double().numpy())
    np.testing.assert_allclose(every["w"].numpy(), split["w"].numpy(), atol=1e-7)
    raw = fedprox_one_step(**{"gc.mode": "local", "gc.weight-decay": "raw", "weight-decay": 0.1,
                              "momentum": 0.9, "local-epochs": 2, "batch-size": 4})["fc1.weight"]
    kept = global_gc_transform("hybrid", 1.0, "")(old, rec(w=raw.double().numpy()))  # 'w' local: untouched
    np.testing.assert_array_equal(kept["w"].numpy(), raw.double().numpy())
    centered = global_gc_transform("hybrid", 1.0, "", scope="all")(old, rec(w=raw.double().numpy()))
    np.testing.assert_allclose(centered["w"].numpy().mean(axis=1), 0.0, atol=1e-12)
    assert float(np.abs(raw.double().numpy().mean(axis=1)).max()) > 1e-4


# --------------------------------------------------------------------------- #
# gc.mode='local-only': Figure 9's "Local GC only" (no GC past the borderline)
# --------------------------------------------------------------------------- #
def test_local_only_partition():
    # hybrid's local part, nothing global
    assert gc_partition("local-only", MLP_NAMES, 1.0, "fc") == (MLP_NAMES[:2], [])
    assert gc_partition("local-only", MLP_NAMES, 0.75, "") == (MLP_NAMES[:3], [])  # floor(3)
    assert gc_partition("local-only", MLP_NAMES, 1.0, "") == (MLP_NAMES, [])  # = LocalGC
    assert gc_partition("local-only", MLP_NAMES, 0.0, "") == ([], [])  # = FedAvg
    assert gc_partition("hybrid", MLP_NAMES, 0.75, "") == (MLP_NAMES[:3], MLP_NAMES[3:])


def test_local_only_config_and_composition():
    cfg = run_cfg("gcfed", **{"gc.mode": "local-only"})
    assert (cfg.gc.mode, cfg.gc.lam, cfg.gc.global_layers) == ("local-only", 1.0, "fc")
    model = build_model("mlp", (6,), 3)
    assert len(local_transforms(cfg, model)) == 1
    assert server_update_transforms(cfg) == []
    # client-side only, so allowed where global GC is refused
    assert run_cfg("fedcdr", **{"gc.mode": "local-only"}).gc.mode == "local-only"
    with pytest.raises(ConfigError, match="local-only"):
        run_cfg("fedcdr", **{"gc.mode": "hybrid"})


def test_local_only_client_step_centralizes_only_the_local_tensors():
    plain = fedprox_one_step()
    only = fedprox_one_step(**{"gc.mode": "local-only", "gc.lambda": 0.5, "gc.global-layers": ""})
    torch.testing.assert_close(only["fc1.weight"], centralize(plain["fc1.weight"]), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(only["fc1.weight"], plain["fc1.weight"])
    for name in ("fc1.bias", "fc.weight", "fc.bias"):
        assert torch.equal(only[name], plain[name]), name


def test_local_only_server_is_the_plain_mean():
    """Same replies as test_gcfed_default_is_unweighted_mean_then_global_gc:
    hybrid centralizes the classifier's update [[1, 1, 2]] into
    [[-1/3, -1/3, 2/3]]; local-only leaves it (no global GC), so the model is
    the unweighted mean of the replies."""
    out = one_round(get_algorithm("gcfed").build_strategy(run_cfg("gcfed", **{"gc.mode": "local-only"}),
                                                          Federation(dict(NODES))),
                    rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], [1, 1, 2])
    np.testing.assert_allclose(out["fc.weight"], [[1.0, 1.0, 2.0]], rtol=1e-14)
    np.testing.assert_allclose(out["fc.bias"], [5 / 3], rtol=1e-14)
    np.testing.assert_allclose(out["fc1.weight"], [[4 / 3, 2.0], [5 / 3, 4 / 3]], rtol=1e-14)
    np.testing.assert_allclose(out["fc1.bias"], [2 / 3, 4 / 3], rtol=1e-14)


# --------------------------------------------------------------------------- #
# gc.vectors: what GC does to 1-D tensors (keep | mean, the authors' code)
# --------------------------------------------------------------------------- #
def linear_with_grads(weight, bias, grad_w, grad_b):
    model = torch.nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    model.weight.grad = torch.tensor(grad_w)
    model.bias.grad = torch.tensor(grad_b)
    return model


def test_vectors_config():
    assert run_cfg("gcfed").gc.vectors == "keep"
    assert run_cfg("gcfed", **{"gc.vectors": "mean"}).gc.vectors == "mean"
    with pytest.raises(ConfigError, match="gc.vectors"):
        run_cfg("gcfed", **{"gc.vectors": "zero"})


@pytest.mark.parametrize("vectors,bias_grad", [("keep", [1.0, 2.0, 6.0]), ("mean", [-2.0, -1.0, 3.0])])
def test_vectors_local_gc_on_a_bias(vectors, bias_grad):
    """Bias gradient [1, 2, 6]: kept, or minus its scalar mean 3 -> [-2, -1, 3].
    The weight rows [[1, 3], [2, 2], [0, 4]] lose their means 2, 2, 2 either way."""
    cfg = run_cfg("fedavg", **{"gc.mode": "local", "gc.vectors": vectors})
    model = linear_with_grads([[0.0, 0.0]] * 3, [0.0] * 3, [[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]], [1.0, 2.0, 6.0])
    for transform in local_transforms(cfg, model):
        transform(model)
    torch.testing.assert_close(model.bias.grad, torch.tensor(bias_grad))
    torch.testing.assert_close(model.weight.grad, torch.tensor([[-1.0, 1.0], [0.0, 0.0], [-2.0, 2.0]]))


def test_vectors_mean_global_gc_by_hand():
    """GlobalGC, unweighted mean of CLIENTS: fc1.bias update [2/3, 4/3] (mean 1)
    -> [-1/3, 1/3]; fc.bias update 5/3 - 1 = 2/3, a 1-element vector, loses all
    of it -> 1; with 'keep' both biases are the plain mean."""
    def run(vectors):
        cfg = run_cfg("gcfed", **{"gc.mode": "global", "gc.vectors": vectors})
        return one_round(get_algorithm("gcfed").build_strategy(cfg, Federation(dict(NODES))),
                         rec(**named(X0)), [rec(**named(c)) for c in CLIENTS], [1, 1, 2])

    mean, keep = run("mean"), run("keep")
    np.testing.assert_allclose(mean["fc1.bias"], [-1 / 3, 1 / 3], rtol=1e-14)
    np.testing.assert_allclose(mean["fc.bias"], [1.0], rtol=1e-14)
    np.testing.assert_allclose(keep["fc1.bias"], [2 / 3, 4 / 3], rtol=1e-14)
    np.testing.assert_allclose(keep["fc.bias"], [5 / 3], rtol=1e-14)
    for name in ("fc1.weight", "fc.weight"):  # 2-D tensors: the same either way
        np.testing.assert_array_equal(mean[name], keep[name])


def test_vectors_mean_in_a_real_solver_step():
    """One full-batch SGD step (no momentum, no decay): the hidden bias update is
    the centralized plain update, so its entries sum to zero. (The classifier
    bias's cross-entropy gradient, softmax - onehot, sums to zero already.)"""
    plain = fedprox_one_step()
    vec = fedprox_one_step(**{"gc.mode": "local", "gc.vectors": "mean"})
    torch.testing.assert_close(vec["fc1.bias"], centralize(plain["fc1.bias"], "mean"), rtol=1e-5, atol=1e-7)
    assert abs(float(vec["fc1.bias"].sum())) < 1e-6 < 1e-4 < abs(float(plain["fc1.bias"].sum()))


# --------------------------------------------------------------------------- #
# gc.weight-decay: is the optimizer's decay term centralized with the gradient?
# --------------------------------------------------------------------------- #
W = [[1.0, 2.0, 6.0]]
G = [[1.0, 0.0, 2.0]]


def one_sgd_step(mode: str, algo: str = "fedavg", momentum: float = 0.0, steps: int = 1, **extra):
    """Real solver optimizer (torch SGD, weight-decay 0.1, lr 1) on a 1x3 weight
    with the gradient G at every step, local GC on."""
    cfg = run_cfg(algo, **{"gc.mode": "local", "gc.weight-decay": mode, "weight-decay": 0.1,
                           "momentum": momentum, **extra})
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(W))
    optimizer = get_algorithm(algo).solver(cfg).make_optimizer(model, 1.0)
    transforms = client_gradient_transforms(cfg, model, optimizer)
    for _ in range(steps):
        model.weight.grad = torch.tensor(G)
        for transform in transforms:
            transform(model)
        optimizer.step()
    return model.weight.detach()


def test_weight_decay_config():
    assert run_cfg("gcfed").gc.weight_decay == "centralized"
    assert run_cfg("gcfed", **{"gc.weight-decay": "raw"}).gc.weight_decay == "raw"
    with pytest.raises(ConfigError, match="gc.weight-decay"):
        run_cfg("gcfed", **{"gc.weight-decay": "both"})


def test_weight_decay_centralized_by_hand():
    """centralized: step = P(g + wd w) = P([1.1, 0.2, 2.6]) = [-0.2, -1.1, 1.3]
    -> w = [1.2, 3.1, 4.7], row mean 3 kept (GC's e^T w = e^T w0);
    raw (torch SGD adds wd w after GC): P g + wd w = [0, -1, 1] + [0.1, 0.2, 0.6]
    -> w = [0.9, 2.8, 4.4], row mean 2.7."""
    torch.testing.assert_close(one_sgd_step("centralized"), torch.tensor([[1.2, 3.1, 4.7]]))
    torch.testing.assert_close(one_sgd_step("raw"), torch.tensor([[0.9, 2.8, 4.4]]))


def test_weight_decay_centralized_with_momentum_by_hand():
    """Momentum 0.5, two steps, as Yong et al.'s SGD_GC (decay, GC, momentum):
    step 1: d1 = [-0.2, -1.1, 1.3], w1 = [1.2, 3.1, 4.7];
    step 2: P(g + 0.1 w1) = P([1.12, 0.31, 2.47]) = [-0.18, -0.99, 1.17],
    buf = 0.5 d1 + that = [-0.28, -1.54, 1.82], w2 = [1.48, 4.64, 2.88]."""
    torch.testing.assert_close(one_sgd_step("centralized", momentum=0.5, steps=2),
                               torch.tensor([[1.48, 4.64, 2.88]]))


def test_weight_decay_added_by_the_solver_itself_is_not_corrected():
    """FedPM builds its optimizer without decay and adds wd w to p.grad in its
    own transform_gradients (before GC), so the GC transform must not subtract
    anything: on a bare gradient it is P g for both settings."""
    from fedaccel.clients.composition import optimizer_weight_decay

    model = torch.nn.Linear(3, 1, bias=False)
    assert optimizer_weight_decay(solver_optimizer(run_cfg("fedpm", **{"weight-decay": 0.1}), model), model) == {}
    assert optimizer_weight_decay(solver_optimizer(run_cfg("fedavg", **{"weight-decay": 0.1}), model), model) == {"weight": 0.1}
    assert optimizer_weight_decay(solver_optimizer(run_cfg("fedavg", **{"weight-decay": 0.0}), model), model) == {}
    for algo, expected in (("fedpm", [[0.0, -1.0, 1.0]]), ("fedavg", [[-0.3, -1.3, 0.7]])):
        cfg = run_cfg(algo, **{"gc.mode": "local", "weight-decay": 0.1})
        with torch.no_grad():
            model.weight.copy_(torch.tensor(W))
        model.weight.grad = torch.tensor(G)
        for transform in local_transforms(cfg, model):
            transform(model)
        # fedavg: P g - wd (w - P w) = [0, -1, 1] - 0.1 * [3, 3, 3]
        torch.testing.assert_close(model.weight.grad, torch.tensor(expected))


def test_hybrid_with_weight_decay_leaves_local_updates_to_global_gc_unchanged():
    """Section 3.3: Global GC leaves the locally centralized tensors unaffected.
    With the decay centralized, a real client's update of a local tensor
    (momentum 0.9, weight decay 0.1, 2 epochs) has zero row means, so P is a
    no-op on it; with 'raw' it is not."""
    def update(mode):
        return fedprox_one_step(**{"gc.mode": "local", "gc.weight-decay": mode, "weight-decay": 0.1,
                                   "momentum": 0.9, "local-epochs": 2, "batch-size": 4})["fc1.weight"]

    centralized, raw = update("centralized"), update("raw")
    torch.testing.assert_close(centralized.mean(dim=1), torch.zeros(centralized.shape[0]), rtol=0, atol=1e-7)
    assert float(raw.mean(dim=1).abs().max()) > 1e-4


# --------------------------------------------------------------------------- #
# the new keys end to end through the fast runner
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("keys", [
    {"gc.mode": "local-only", "gc.lambda": 0.5, "gc.global-layers": ""},
    {"gc.mode": "hybrid", "gc.vectors": "mean", "weight-decay": 0.001, "momentum": 0.5},
])
def test_new_gc_keys_run_end_to_end(tmp_path, keys):
    import json

    from fedaccel.local_run import fuse, run_local

    cfg = fuse(default_run_config(), {"algo": "gcfed", "num-server-rounds": 3, "clients-per-round": 3,
                                      "local-epochs": 1, "accl-every": 0, "synthetic.max-samples": 120,
                                      "results-dir": str(tmp_path), "run-name": "gc", **keys})
    run_dir = run_local(cfg, num_clients=4, quiet=True)
    resolved = json.loads((run_dir / "config.json").read_text())
    for key, value in keys.items():
        assert resolved[key] == value
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)
