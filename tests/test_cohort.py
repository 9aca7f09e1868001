"""The cohort trainer (fedaccel/clients/cohort.py) against the per-client loop.

Same seed, same clients, ragged sizes: every batchable algorithm's round,
batched, equals the per-client round to float32 rounding (weights to
``ATOL``/``RTOL``, train loss to 1e-5 relative, step counts exactly), and the
per-client state it leaves (FedDyn's grad_prev, FedRKMGC's corrections) carries
into the next round the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from flwr.app import Array, RecordDict

from fakes import run_cfg
from fedaccel.arrays import DeferredArray, all_finite, from_numpy, mean_of_records, to_numpy
from fedaccel.clients.base import LocalSolver, SamplePool, TrainData
from fedaccel.clients.scaffold import C_RECORD, control_variate_record
from fedaccel.clients import cohort as cohort_module
from fedaccel.clients.cohort import (CohortJob, CohortMember, batched_forward, fallback_reason, fit_cohort, label_gradients,
                                     losses_from_label_log_probs, sgd_step, train_cohort)
from fedaccel.clients.state import ContextState
from fedaccel.contract import train_config_record
from fedaccel.models import build_model
from fedaccel.registry import get_algorithm
from fedaccel.torch_utils import seeded_generator, state_to_arrays

ATOL, RTOL = 2e-6, 1e-5  # float32: the batched kernels sum in another order
SIZES = [37, 5, 16, 90, 17, 1, 33]  # ragged: 1..6 steps per epoch at batch 16, one client of 1 sample
EXTRA = {"fedprox": {"proximal-mu": 0.1}}
# (case id, algo, run-config changes): every algorithm the cohort trainer
# batches, and the layers that compose with them (clipping, local GC)
BATCHABLE = [
    ("fedavg", "fedavg", {"momentum": 0.9, "weight-decay": 1e-3}),
    ("fedprox", "fedprox", {"momentum": 0.5}),
    ("fedacg", "fedacg", {"fedacg.beta": 0.2}),
    ("feddyn", "feddyn", {"feddyn.alpha": 0.1, "weight-decay": 1e-3}),
    ("fedrkmgc", "fedrkmgc", {"momentum": 0.9}),
    ("scaffold", "scaffold", {"momentum": 0.9, "weight-decay": 1e-3}),
    ("scaffold-option-ii", "scaffold", {"momentum": 0.0, "scaffold.cv-update": "option-ii"}),
    # FedDC: SCAFFOLD's correction plus the drift pull, both state groups read again in round 2
    ("feddc", "feddc", {"momentum": 0.9, "weight-decay": 1e-3, "feddc.alpha": 0.5}),
    ("feddc-option-ii", "feddc", {"momentum": 0.0, "feddc.cv-update": "option-ii", "feddc.alpha": 0.5}),
    ("fednova", "fednova", {"momentum": 0.9}),
    ("fedcdr", "fedcdr", {"momentum": 0.9, "weight-decay": 5e-4, "fedcdr.eta": 0.5}),
    ("feddr-local-start", "feddr", {"feddr.prox-start": "local", "feddr.init": "zeros", "feddr.eta": 0.5}),
    ("clip", "fedprox", {"momentum": 0.9, "clip-norm": 0.3}),
    ("local-gc", "fedavg", {"momentum": 0.9, "weight-decay": 1e-2, "gc.mode": "local"}),
    ("gcfed-vectors-mean", "gcfed", {"weight-decay": 1e-2, "gc.vectors": "mean", "gc.weight-decay": "raw"}),
    ("local-gc-and-clip", "scaffold", {"momentum": 0.9, "weight-decay": 1e-2, "gc.mode": "local",
                                       "clip-norm": 0.3}),
    # clipping after each algorithm's own correction (the clip acts on the step's gradient)
    ("clip-feddyn", "feddyn", {"feddyn.alpha": 0.1, "momentum": 0.9, "clip-norm": 0.3}),
    ("clip-fedrkmgc", "fedrkmgc", {"clip-norm": 0.3}),
    ("clip-fedcdr", "fedcdr", {"fedcdr.eta": 0.5, "clip-norm": 0.3}),
    ("clip-fednova", "fednova", {"momentum": 0.9, "clip-norm": 0.3}),
    # GC on part of the tensors: GC-Fed's hybrid split and local GC alone on the first half
    ("gcfed-hybrid-half", "gcfed", {"gc.mode": "hybrid", "gc.lambda": 0.5, "momentum": 0.9}),
    ("local-only-gc-half", "fedavg", {"gc.mode": "local-only", "gc.lambda": 0.5, "weight-decay": 1e-2}),
    # FOOF: each client's own preconditioner, solved batched (clip-norm 'auto' = 1.0)
    ("fedpm", "fedpm", {"momentum": 0.5, "weight-decay": 1e-3}),
    ("fedpm-upload-end-foof-samples", "fedpm", {"fedpm.upload": "end", "fedpm.foof-samples": 20}),
    ("localnewton", "localnewton", {"weight-decay": 1e-3, "localnewton.damping": 0.1}),
]
STATE_GROUP = {"fedcdr": "dr", "feddr": "dr"}  # the name a solver keeps its state under


def received_for(algo: str, model: torch.nn.Module, seed: int = 5) -> dict:
    """The records a server sends beside the model (SCAFFOLD's ``c``)."""
    if algo not in ("scaffold", "feddc"):
        return {}
    gen = torch.Generator().manual_seed(seed)
    return {C_RECORD: control_variate_record({k: 0.1 * torch.randn(p.shape, generator=gen).numpy()
                                              for k, p in model.named_parameters()})}


def new_solver(cfg, model: torch.nn.Module) -> LocalSolver:
    solver = get_algorithm(cfg.algo).solver(cfg)
    solver.initial_model = copy.deepcopy(model.state_dict())  # x0, as the ClientApp sets it
    return solver


def clients(sizes=SIZES, shape=(6,), classes: int = 3, seed: int = 0) -> list[TrainData]:
    gen = torch.Generator().manual_seed(seed)
    return [TrainData(x=torch.randn(n, *shape, generator=gen) * (1 + c),
                      y=torch.randint(0, classes, (n,), generator=gen)) for c, n in enumerate(sizes)]


def make_model(seed: int = 0, name: str = "mlp", shape=(6,)) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, shape, 3)


def config_for(algo: str, server_round: int, lr: float = 0.1) -> dict:
    values = train_config_record(server_round, lr, 2, EXTRA.get(algo))
    values["accepted-round"] = server_round - 1  # the server applied every reply so far
    return values


def per_client_round(cfg, model, datas, states, server_round):
    weights, metrics, extras = [], [], []
    for c, data in enumerate(datas):
        local = copy.deepcopy(model)
        result = new_solver(cfg, model).fit(local, data, config_for(cfg.algo, server_round), states[c],
                                            seeded_generator(cfg.seed, server_round, c, "train"),
                                            received_for(cfg.algo, model))
        weights.append([torch.from_numpy(a.numpy()) for a in result.arrays.values()])
        metrics.append(result.metrics)
        extras.append(result.extra)
    return weights, metrics, extras


def cohort_round(cfg, model, datas, states, server_round):
    scratch = copy.deepcopy(model)
    start = state_to_arrays(model)
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=start,
                      config=config_for(cfg.algo, server_round), state=states[c],
                      generator=seeded_generator(cfg.seed, server_round, c, "train"),
                      received=received_for(cfg.algo, model))
            for c, data in enumerate(datas)]
    results = fit_cohort(scratch, jobs, cfg.batch_size)
    weights = []
    for result in results:
        assert not isinstance(result, BaseException), result
        weights.append([torch.from_numpy(a.numpy()) for a in result.arrays.values()])
    return weights, [r.metrics for r in results], [r.extra for r in results]


def assert_same_arrays(got, want) -> None:
    """A batched client's uploaded weights equal its reply alone, key by key,
    to the float32 tolerance."""
    for k in want.arrays.keys():
        torch.testing.assert_close(torch.from_numpy(got.arrays[k].numpy()),
                                   torch.from_numpy(want.arrays[k].numpy()), atol=ATOL, rtol=RTOL)


def assert_same_round(a, b, scaled_extras: bool = False) -> None:
    """Two rounds' weights, metrics and extra records alike to the float32
    tolerance; ``scaled_extras``: the extras' absolute tolerance scaled by
    each array's largest entry (FOOF matrices of 192-pixel images: sums of
    192 products, whose small entries carry the rounding of the large)."""
    (wa, ma, ea), (wb, mb, eb) = a, b
    for c, (x, y) in enumerate(zip(wa, wb)):
        for p, q in zip(x, y):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=f"client {c}")
    for x, y in zip(ma, mb):
        assert x["local-steps"] == y["local-steps"] and x["num-examples"] == y["num-examples"]
        assert x["train-loss"] == pytest.approx(y["train-loss"], rel=1e-5)
    for c, (x, y) in enumerate(zip(ea, eb)):  # SCAFFOLD's dc, FedNova's ||a||_1
        assert list(x) == list(y)
        for name in x:
            for key in x[name]:
                got, want = torch.from_numpy(x[name][key].numpy()), torch.from_numpy(y[name][key].numpy())
                scale = max(1.0, float(want.abs().max())) if scaled_extras and want.numel() else 1.0
                torch.testing.assert_close(got, want, atol=ATOL * scale, rtol=RTOL, msg=f"client {c} {name}.{key}")


def test_every_local_solver_the_trainer_batches_has_an_equivalence_case() -> None:
    """A new algorithm whose client solver batches gets a case in BATCHABLE
    (its own rule, checked against the per-client round below), not a pass
    by default; algorithms that share a solver class (FedAdam and FedAvgM
    train as FedAvg does) share its case."""
    from fedaccel.registry import algorithm_names

    covered = {get_algorithm(algo).solver for _, algo, _ in BATCHABLE}
    model = make_model()
    missing = []
    for name in algorithm_names():
        cfg = run_cfg(name)
        solver = get_algorithm(name).solver
        if fallback_reason(solver(cfg), cfg, model) is None and solver not in covered:
            missing.append(f"{name} ({solver.__name__})")
    assert not missing, f"batched, with no case in BATCHABLE: {missing}"


@pytest.mark.parametrize("algo, changes", [case[1:] for case in BATCHABLE], ids=[case[0] for case in BATCHABLE])
def test_a_batched_round_equals_the_per_client_round(algo: str, changes: dict) -> None:
    """Two rounds, so state written in round 1 is read in round 2."""
    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model, datas = make_model(), clients()
    assert fallback_reason(get_algorithm(algo).solver(cfg), cfg, model) is None
    states_a = [ContextState(RecordDict()) for _ in datas]
    states_b = [ContextState(RecordDict()) for _ in datas]
    for server_round in (1, 2):
        expected = per_client_round(cfg, model, datas, states_a, server_round)
        got = cohort_round(cfg, model, datas, states_b, server_round)
        assert_same_round(expected, got)
        # the next round starts from the mean of the replies (weights, or for
        # Douglas-Rachford model differences), as a server's would
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                mean = torch.stack([w[i] for w in expected[0]]).mean(0)
                p.add_(mean) if algo in STATE_GROUP else p.copy_(mean)
    stateful = get_algorithm(algo).solver.state_copies > 0
    for a, b in zip(states_a, states_b):
        assert a.versions() == b.versions()
        group = STATE_GROUP.get(algo, algo)
        kept_a, kept_b = a.get(group, torch.device("cpu")), b.get(group, torch.device("cpu"))
        assert (kept_a is not None) == (kept_b is not None) == stateful
        for key in kept_a or {}:
            torch.testing.assert_close(kept_a[key], kept_b[key], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("algo, changes", [("fedavg", {"momentum": 0.9, "weight-decay": 1e-3}),
                                           ("scaffold", {"momentum": 0.9}), ("fedpm", {})])
def test_a_float64_cohort_is_batched_in_float64(algo: str, changes: dict) -> None:
    """precision='float64': a batched round keeps the model's and the data's
    float64 (replies, SCAFFOLD's dc) and equals the per-client round to
    float64 rounding, 1e6 tighter than the float32 tolerance."""
    cfg = run_cfg(algo, **{"batch-size": 16, "precision": "float64", **changes})
    model = make_model().double()
    datas = [TrainData(x=d.x.double(), y=d.y) for d in clients()]
    expected = per_client_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    got = cohort_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    for x, y in zip(expected[0], got[0]):
        for p, q in zip(x, y):
            assert p.dtype == q.dtype == torch.float64
            torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-12)
    for x, y in zip(expected[1], got[1]):  # the reported loss too, not rounded to float32 on the way
        assert x["train-loss"] == pytest.approx(y["train-loss"], rel=1e-12)
    for extra in got[2]:
        for record in extra.values():
            assert all(a.dtype == "float64" for a in record.values()), record


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cohort-batching='auto' batches there too)")
@pytest.mark.parametrize("algo, changes", [("fedavg", {"momentum": 0.9, "weight-decay": 1e-3}),
                                           ("scaffold", {"momentum": 0.9}),
                                           ("feddc", {"momentum": 0.9, "feddc.alpha": 0.5}),
                                           ("fedcdr", {"momentum": 0.9, "fedcdr.eta": 0.5}),
                                           ("fedpm", {})])
def test_a_batched_round_on_a_gpu_equals_the_per_client_round(algo: str, changes: dict) -> None:
    """device='cuda': the model, the data and every client's tensors on the
    GPU; two batched rounds equal the per-client rounds there (the MLP's
    matmuls: no TF32 unless the user turns it on)."""
    cfg = run_cfg(algo, **{"batch-size": 16, "device": "cuda", **changes})
    model = make_model().cuda()
    datas = [TrainData(x=d.x.cuda(), y=d.y.cuda()) for d in clients()]
    states_a = [ContextState(RecordDict()) for _ in datas]
    states_b = [ContextState(RecordDict()) for _ in datas]
    for server_round in (1, 2):
        expected = per_client_round(cfg, model, datas, states_a, server_round)
        assert_same_round(expected, cohort_round(cfg, model, datas, states_b, server_round))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                mean = torch.stack([w[i] for w in expected[0]]).mean(0).cuda()
                p.add_(mean) if algo in STATE_GROUP else p.copy_(mean)


class _OwnBegin:
    """Mixed into a solver class: a ``begin_round`` of its own (the cohort
    trainer then begins each client on its own received model)."""

    def begin_round(self, model, config, state):
        super().begin_round(model, config, state)


@pytest.mark.parametrize("algo, changes, own_begin", [
    ("fedavg", {}, False), ("fedprox", {}, False),  # without and with its own begin_round
    # Douglas-Rachford: begun together (relaxed against each client's own x), and client by client
    ("feddr", {"feddr.prox-start": "local", "feddr.alpha": 0.7}, False),
    ("feddr", {"feddr.prox-start": "local", "feddr.alpha": 0.7}, True),
    ("fedcdr", {}, False)], ids=["fedavg", "fedprox", "feddr-local", "feddr-local-own-begin", "fedcdr"])
def test_clients_that_received_different_models_each_start_from_their_own(algo: str, changes: dict,
                                                                          own_begin: bool) -> None:
    """Messages of one round need not share the model record (a server that
    sends some clients another model): interleaved records A, B, A, B, each
    client's batched round equals its per-client round from the model it
    received, whether or not its solver reads the model before its steps,
    and whether it begins with the others or on its own. Every client has
    the run's x0 (a Douglas-Rachford client's initial state)."""
    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    models = [make_model(0), make_model(1)]
    datas = clients()
    records = [state_to_arrays(m) for m in models]
    solver_class = get_algorithm(algo).solver
    if own_begin:
        solver_class = type("OwnBegin", (_OwnBegin, solver_class), {})

    def solver_for():
        solver = solver_class(cfg)
        solver.initial_model = copy.deepcopy(models[0].state_dict())  # the run's x0, the same for all
        return solver
    jobs, expected = [], []
    for c, data in enumerate(datas):
        model = models[c % 2]
        jobs.append(CohortJob(solver=solver_for(), data=data, arrays=records[c % 2],
                              config=config_for(algo, 1), state=ContextState(RecordDict()),
                              generator=seeded_generator(cfg.seed, 1, c, "train"),
                              received=received_for(algo, model)))
        result = solver_for().fit(copy.deepcopy(model), data, config_for(algo, 1),
                                            ContextState(RecordDict()), seeded_generator(cfg.seed, 1, c, "train"),
                                            received_for(algo, model))
        expected.append([torch.from_numpy(a.numpy()) for a in result.arrays.values()])
    results = fit_cohort(copy.deepcopy(models[0]), jobs, cfg.batch_size)
    for c, (result, want) in enumerate(zip(results, expected)):
        got = [torch.from_numpy(a.numpy()) for a in result.arrays.values()]
        for p, q in zip(want, got):
            torch.testing.assert_close(q, p, atol=ATOL, rtol=RTOL, msg=f"client {c}")
    # and the two models really differ, so a client started from the wrong one would fail
    assert not torch.allclose(expected[0][0], expected[1][0], atol=1e-3)


def test_step_by_step_gathering_gives_the_same_bits_as_gathering_once(monkeypatch) -> None:
    """A round whose batches would take too much memory to gather at once
    (``GATHER_ONCE_BYTES``) gathers them step by step, and each step forms
    its own ``nll_loss`` backward instead of taking its rows of the round's:
    the same rows and values, so the same weights and metrics to the bit (two
    epochs: ragged clients leave)."""
    cfg = run_cfg("fedprox", **{"batch-size": 16, "local-epochs": 2})
    model, datas = make_model(), clients()

    def run():
        members = [CohortMember(new_solver(cfg, model), data, seeded_generator(0, 1, c, "train"),
                                [p.detach().clone() for p in model.parameters()])
                   for c, data in enumerate(datas)]
        for m in members:
            m.solver.open_round(copy.deepcopy(model), config_for("fedprox", 1), ContextState(RecordDict()),
                                received_for("fedprox", model))
        return train_cohort(model, members, 0.1, 2, 16)

    once = run()
    monkeypatch.setattr(cohort_module, "GATHER_ONCE_BYTES", 0)
    by_step = run()
    assert once[1] == by_step[1]
    for a, b in zip(once[0], by_step[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def pooled(datas: list[TrainData], lead: int = 3) -> list[TrainData]:
    """The same clients' data as rows of one :class:`SamplePool`, as the fast
    runner holds them: ``lead`` rows of no client first and the clients in
    reverse order, so a client's rows start neither at 0 nor where the
    cohort's own concatenation would put them."""
    junk_x = torch.full((lead, *datas[0].x.shape[1:]), 1e3)
    order = list(reversed(range(len(datas))))
    pool = SamplePool(x=torch.cat([junk_x, *(datas[c].x for c in order)]),
                      y=torch.cat([torch.zeros(lead, dtype=torch.long), *(datas[c].y for c in order)]))
    starts, at = {}, lead
    for c in order:
        starts[c], at = at, at + datas[c].num_examples
    return [TrainData(x=pool.x[starts[c]:starts[c] + d.num_examples], y=pool.y[starts[c]:starts[c] + d.num_examples],
                      pool=pool, pool_start=starts[c]) for c, d in enumerate(datas)]


@pytest.mark.parametrize("gather_once", [True, False], ids=["gathered-once", "step-by-step"])
@pytest.mark.parametrize("algo, changes", [("fedavg", {"momentum": 0.9}), ("scaffold", {"weight-decay": 1e-3}),
                                           ("fedpm", {})])
def test_a_cohort_whose_data_are_rows_of_one_pool_trains_to_the_same_bits(algo, changes, gather_once,
                                                                          monkeypatch) -> None:
    """The fast runner's clients' data are rows of one pool, from which the
    trainer gathers a round's mini-batches directly (no concatenation of the
    cohort's data): the same samples, so the same weights, metrics and
    uploads to the bit as from the clients' own tensors; two epochs, ragged
    clients, a cohort of some of the pool's clients."""
    if not gather_once:
        monkeypatch.setattr(cohort_module, "GATHER_ONCE_BYTES", 0)
    cfg = run_cfg(algo, **{"batch-size": 16, "local-epochs": 2, **changes})
    model, datas = make_model(), clients()
    rows_of_pool = pooled(datas)
    some = [1, 3, 4, 6]  # not the whole pool, not in its order
    own = cohort_round(cfg, model, [datas[c] for c in some], [ContextState(RecordDict()) for _ in some], 1)
    from_pool = cohort_round(cfg, model, [rows_of_pool[c] for c in some],
                             [ContextState(RecordDict()) for _ in some], 1)
    assert own[1] == from_pool[1]
    for a, b in zip(own[0], from_pool[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(own[2], from_pool[2]):  # SCAFFOLD's dc
        assert all(torch.equal(torch.from_numpy(a[n][k].numpy()), torch.from_numpy(b[n][k].numpy()))
                   for n in a for k in a[n])


@pytest.mark.parametrize("mix", ["one-client-unpooled", "two-pools"])
def test_a_cohort_of_rows_of_more_than_one_pool_trains_each_client_on_its_own_samples(mix) -> None:
    """A cohort whose members are not all rows of one pool (one client with
    tensors of its own, or rows of two pools) is trained on each member's own
    samples: the same bits as from the clients' own tensors. The largest
    client, the trainer's first, is a pool's, so a trainer that took the
    first member's pool for everyone would train the others on its rows."""
    cfg = run_cfg("fedavg", **{"batch-size": 16, "local-epochs": 2})
    model, datas = make_model(), clients()
    some = sorted([1, 3, 4, 6], key=lambda c: -datas[c].num_examples)
    first, second = pooled(datas), pooled(datas, lead=5)
    if mix == "one-client-unpooled":
        members = [first[c] for c in some[:-1]] + [datas[some[-1]]]
    else:
        members = [first[c] for c in some[:2]] + [second[c] for c in some[2:]]
    own = cohort_round(cfg, model, [datas[c] for c in some], [ContextState(RecordDict()) for _ in some], 1)
    mixed = cohort_round(cfg, model, members, [ContextState(RecordDict()) for _ in some], 1)
    assert own[1] == mixed[1]
    for a, b in zip(own[0], mixed[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_rows_of_a_pool_must_be_the_rows_their_start_names() -> None:
    """``TrainData`` refuses ``pool_start`` that is not where its tensors'
    rows are in the pool (the trainer gathers by ``pool_start``), or tensors
    that are not rows of the pool at all."""
    datas = clients()
    rows = pooled(datas)
    d = rows[2]
    TrainData(x=d.x, y=d.y, pool=d.pool, pool_start=d.pool_start)  # as built: accepted
    with pytest.raises(ValueError, match="pool_start"):
        TrainData(x=d.x, y=d.y, pool=d.pool, pool_start=d.pool_start + 1)
    with pytest.raises(ValueError, match="pool_start"):
        TrainData(x=d.x.clone(), y=d.y, pool=d.pool, pool_start=d.pool_start)
    with pytest.raises(ValueError, match="pool_start"):
        TrainData(x=d.x, y=d.y.clone(), pool=d.pool, pool_start=d.pool_start)
    empty = TrainData(x=d.pool.x[len(d.pool.x):], y=d.pool.y[len(d.pool.y):], pool=d.pool,
                      pool_start=len(d.pool.x))  # a client without samples: the pool's end
    assert empty.num_examples == 0


def test_a_rounds_nll_gradients_are_each_steps_scatter_of_the_label_gradients(monkeypatch) -> None:
    """``round_nll_gradients``: ``label_grad`` at each label, zeros elsewhere,
    ``[K, classes, B]`` (by hand on 2 mini-batches of 3 classes); None past
    ``GATHER_ONCE_BYTES`` and for a model without its own backward."""
    model = make_model()
    params = {n: p.detach().unsqueeze(0) for n, p in model.named_parameters()}
    target = torch.tensor([[[2, 0]], [[1, 1]]])
    label_grad = torch.tensor([[[-0.5, -0.5]], [[-1.0, 0.0]]])
    dense = cohort_module.round_nll_gradients(model, params, target, label_grad)
    assert torch.equal(dense, torch.tensor([[[0.0, -0.5], [0.0, 0.0], [-0.5, 0.0]],
                                            [[0.0, 0.0], [-1.0, 0.0], [0.0, 0.0]]]))
    monkeypatch.setattr(cohort_module, "GATHER_ONCE_BYTES", dense.numel() * 4 - 1)
    assert cohort_module.round_nll_gradients(model, params, target, label_grad) is None
    conv = make_model(name="cnn", shape=(1, 28, 28))
    assert cohort_module.round_nll_gradients(conv, {n: p.detach().unsqueeze(0) for n, p in conv.named_parameters()},
                                             target, label_grad) is None


def test_a_round_without_steps_returns_the_start_weights() -> None:
    """``local-epochs=0`` (no step for anyone): every client's start weights
    and the per-client loop's metrics (no loss, no steps), not an error."""
    cfg = run_cfg("fedavg", **{"batch-size": 16})
    model, datas = make_model(), clients()
    members = [CohortMember(new_solver(cfg, model), data, seeded_generator(0, 1, c, "train"),
                            [p.detach().clone() for p in model.parameters()]) for c, data in enumerate(datas)]
    weights, metrics = train_cohort(model, members, 0.1, 0, 16)
    expected = new_solver(cfg, model).run_epochs(copy.deepcopy(model), datas[0], seeded_generator(0, 1, 0, "train"),
                                                 0.1, 0)
    assert metrics == [expected] * len(datas) == [{"train-loss": 0.0, "local-steps": 0}] * len(datas)
    for w, m in zip(weights, members):
        assert all(torch.equal(x, y) for x, y in zip(w, m.start))


def test_the_clip_and_local_gc_cases_really_clip_and_centralize() -> None:
    """The clip and GC cases above would pass vacuously if the clip never
    acted or GC had nothing to do: check that they change the round."""
    datas = clients()
    for changes, without in (({"clip-norm": 0.3}, {"clip-norm": 0.0}),
                             ({"gc.mode": "local"}, {"gc.mode": "none"})):
        rounds = []
        for c in (changes, without):
            cfg = run_cfg("fedavg", **{"batch-size": 16, "momentum": 0.9, **c})
            rounds.append(cohort_round(cfg, make_model(), datas, [None] * len(datas), 1)[0])
        assert max(float((p - q).abs().max()) for x, y in zip(*rounds) for p, q in zip(x, y)) > 1e-3


def test_steps_and_losses_follow_each_clients_own_size() -> None:
    cfg = run_cfg("fedavg", **{"batch-size": 16})
    _, metrics, _ = cohort_round(cfg, make_model(), clients(), [None] * len(SIZES), 1)
    assert [m["local-steps"] for m in metrics] == [2 * -(-n // 16) for n in SIZES]


@pytest.mark.parametrize("algo, changes, words", [
    ("fedpm", {"fedpm.refresh-every": 2}, "fedpm.refresh-every=2 recomputes each client's FOOF"),
    ("localnewton", {"localnewton.mode": "exact", "model": "logreg", "weight-decay": 0.01},
     "localnewton.mode='exact' takes full-batch Newton steps per client"),
])
def test_what_cannot_be_batched_says_why(algo, changes, words) -> None:
    cfg = run_cfg(algo, **changes)
    reason = fallback_reason(get_algorithm(algo).solver(cfg), cfg, make_model())
    assert reason and words in reason


def test_dropout_falls_back() -> None:
    cfg = run_cfg("fedavg")
    solver = LocalSolver(cfg)
    dropout = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Dropout(0.5))
    assert "dropout" in fallback_reason(solver, cfg, dropout)


@pytest.mark.parametrize("algo, changes", [("fedprox", {}), ("fedpm", {"fedpm.upload": "end"})])
def test_a_model_without_its_own_batched_forward_goes_through_vmap(algo: str, changes: dict) -> None:
    """The McMahan CNN (no ``batched_forward``): a FedProx round, batched by
    ``vmap(functional_call)``, equals the per-client round; so does FedPM's,
    whose FOOF passes (before the steps, and after them at each client's
    trained weights) stay per client on a model without batched layer inputs."""
    cfg = run_cfg(algo, **{"batch-size": 8, "momentum": 0.5, **changes})
    model = make_model(name="cnn-small", shape=(1, 8, 8))
    assert not hasattr(model, "batched_forward")
    datas = clients([11, 3, 20], shape=(1, 8, 8))
    states = [ContextState(RecordDict()) for _ in datas]
    assert_same_round(per_client_round(cfg, model, datas, states, 1),
                      cohort_round(cfg, model, datas, states, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algo, changes", [("fedavg", {}), ("fedprox", {})])
def test_the_vmapped_cnn_on_a_gpu_equals_the_per_client_round_without_tf32(algo: str, changes: dict,
                                                                          monkeypatch) -> None:
    """The CNN through ``vmap`` on a GPU (its convolutions become one grouped
    convolution over the clients) equals the per-client round to float32
    rounding with TF32 off; with cuDNN's default TF32 the two differ at TF32's
    precision (measured by ``bench/gpu_check.py``'s equivalence step, not
    asserted here)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cfg = run_cfg(algo, **{"batch-size": 8, "momentum": 0.5, "device": "cuda", **changes})
    model = make_model(name="cnn-small", shape=(1, 8, 8)).cuda()
    datas = [TrainData(x=d.x.cuda(), y=d.y.cuda()) for d in clients([11, 3, 20], shape=(1, 8, 8))]
    states = [ContextState(RecordDict()) for _ in datas]
    assert_same_round(per_client_round(cfg, model, datas, states, 1),
                      cohort_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1))


@pytest.mark.parametrize("name", ["logreg", "mlp", "mlp200"])
def test_each_models_batched_forward_is_its_forward(name: str) -> None:
    copies = [make_model(seed, name, (1, 5, 4)) for seed in range(3)]
    assert hasattr(copies[0], "batched_forward")
    params = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in copies])
              for k, _ in copies[0].named_parameters()}
    x = torch.randn(3, 7, 1, 5, 4)
    expected = torch.stack([m(x[c]) for c, m in enumerate(copies)])
    torch.testing.assert_close(batched_forward(copies[0])(params, x), expected, atol=ATOL, rtol=RTOL)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["logreg", "mlp", "mlp200"])
@pytest.mark.parametrize("copies, dtype", [(1, torch.float32), (4, torch.float32), (3, torch.float64)])
def test_each_models_written_out_backward_is_autograds_bit_for_bit(name: str, copies: int, dtype, device) -> None:
    """``batched_loss_and_grads`` (the backward written out) equals
    ``torch.autograd.grad`` through ``batched_forward`` exactly, padding
    included (the mask is float32 in a float64 run, as the trainer builds it);
    on a GPU too, where both call the same cuBLAS products."""
    models = [make_model(seed, name, (1, 5, 4)).to(device=device, dtype=dtype) for seed in range(copies)]
    names = [k for k, _ in models[0].named_parameters()]
    params = [torch.stack([dict(m.named_parameters())[k].detach() for m in models]).requires_grad_()
              for k in names]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(copies, 9, 1, 5, 4, generator=gen, dtype=dtype).to(device)
    y = torch.randint(0, 3, (copies, 9), generator=gen).to(device)
    real = torch.ones(copies, 9, device=device)
    real[-1, 4:] = 0  # the last client's mini-batch is padded (its epoch's last batch)
    count = real.sum(dim=1)
    out = models[0].batched_forward(dict(zip(names, params)), x)
    losses = (torch.nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none") * real).sum(1) / count
    expected = torch.autograd.grad(losses.sum(), params)
    grads, label_log_probs = models[0].batched_loss_and_grads(dict(zip(names, params)), x, y.unsqueeze(1),
                                                              label_gradients(real, count, dtype))
    assert list(grads) != [] and set(grads) == set(names)
    for k, e in zip(names, expected):
        assert torch.equal(grads[k], e), k
        assert e.abs().sum() > 0, k  # a real gradient, not two zeros
    assert torch.equal(losses_from_label_log_probs(label_log_probs, real, count), losses.detach())
    # and the trainer's one reduction per round: all steps' losses at once equal each step's
    stacked = losses_from_label_log_probs(torch.cat([label_log_probs, label_log_probs.flip(0)]),
                                          torch.cat([real, real.flip(0)]), torch.cat([count, count.flip(0)]))
    assert torch.equal(stacked, torch.cat([losses.detach(), losses.detach().flip(0)]))


def step_both(optimizer: torch.optim.Optimizer, step, a: list, b: list, grads: list[torch.Tensor]) -> None:
    """Give ``a`` and ``b`` copies of the same gradients, then step ``a`` with
    ``optimizer.step()`` and ``b`` with the functional ``step``."""
    for p, q, g in zip(a, b, grads):
        p.grad, q.grad = g.clone(), g.clone()
    optimizer.step()
    step()


@pytest.mark.parametrize("settings", [{"momentum": 0.0}, {"momentum": 0.9, "weight_decay": 1e-2},
                                      {"momentum": 0.9, "dampening": 0.3},
                                      {"momentum": 0.5, "nesterov": True, "weight_decay": 1e-3},
                                      {"momentum": 0.9, "maximize": True}])
def test_sgd_step_is_the_optimizers_step_bit_for_bit(settings: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    start = [torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, generator=gen)]
    grads = [[torch.randn_like(w) for w in start] for _ in range(4)]
    a = [torch.nn.Parameter(w.clone()) for w in start]
    b = [torch.nn.Parameter(w.clone()) for w in start]
    optimizer, fast = torch.optim.SGD(a, lr=0.05, **settings), torch.optim.SGD(b, lr=0.05, **settings)
    step = sgd_step(fast)
    for g in grads:
        step_both(optimizer, step, a, b, g)
        for p, q in zip(a, b):
            assert torch.equal(p, q)
            assert set(optimizer.state[p]) == set(fast.state[q])  # the momentum buffer, where step() keeps one
            if "momentum_buffer" in optimizer.state[p]:
                assert torch.equal(optimizer.state[p]["momentum_buffer"], fast.state[q]["momentum_buffer"])
    assert not torch.equal(a[0], start[0])


def test_sgd_step_steps_only_the_optimizers_parameters_that_have_a_gradient() -> None:
    """As ``step()``: a parameter without a gradient keeps its value and its
    (missing) momentum buffer; the others step."""
    a = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    b = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    optimizer, fast = torch.optim.SGD(a, lr=0.1, momentum=0.9), torch.optim.SGD(b, lr=0.1, momentum=0.9)
    step = sgd_step(fast)
    a[0].grad, b[0].grad = torch.ones(2), torch.ones(2)
    optimizer.step()
    step()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(b[1], torch.ones(2))
    assert "momentum_buffer" in fast.state[b[0]] and "momentum_buffer" not in fast.state[b[1]]


def test_sgd_step_leaves_other_optimizers_to_their_own_step() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert sgd_step(torch.optim.Adam(p, lr=0.1)) is None
    assert sgd_step(torch.optim.SGD([{"params": p}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)) is None


@pytest.mark.parametrize("algo, changes", [case[1:] for case in BATCHABLE], ids=[case[0] for case in BATCHABLE])
def test_the_fast_step_is_the_autograd_and_optimizer_step_bit_for_bit(algo: str, changes: dict, monkeypatch) -> None:
    """A batched round through the written-out backward and SGD's functional
    form gives the same weights, losses and state bit for bit as the same
    round through autograd and ``optimizer.step()``: published batched runs
    do not move."""
    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model, datas = make_model(), clients()
    fast = cohort_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    monkeypatch.setattr(type(model), "batched_loss_and_grads", None)
    monkeypatch.setattr(cohort_module, "sgd_step", lambda optimizer: None)
    slow = cohort_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    for wf, ws in zip(fast[0], slow[0]):
        assert all(torch.equal(p, q) for p, q in zip(wf, ws))
    assert [m["train-loss"] for m in fast[1]] == [m["train-loss"] for m in slow[1]]
    for xf, xs in zip(fast[2], slow[2]):
        for name in xf:
            for key in xf[name]:
                assert torch.equal(torch.from_numpy(xf[name][key].numpy()), torch.from_numpy(xs[name][key].numpy()))


@pytest.mark.parametrize("epochs", [0, 1, 3])
def test_the_batch_plan_is_each_clients_own_batches_step_by_step(epochs: int) -> None:
    """``_batch_plan``: step ``t``'s rows are the batches of the clients still
    training, in cohort order, each the next ``batch_size`` samples of that
    client's own ``randperm`` of the epoch (drawn from its generator as the
    per-client loop draws them), offset to where its data starts in the
    concatenated data; the last batch of an epoch padded (with its own first
    sample, not real)."""
    sizes, batch = [37, 33, 17, 16, 5, 1], 16  # sorted by step count, as the trainer sorts them
    datas = clients(sizes)
    solver = get_algorithm("fedavg").solver(run_cfg("fedavg"))
    members = [CohortMember(solver, d, torch.Generator().manual_seed(10 + c), []) for c, d in enumerate(datas)]
    rows, real, active, steps, crops = cohort_module._batch_plan(members, epochs, batch, torch.device("cpu"))
    assert crops is None  # no member's data is augmented
    assert steps == [epochs * -(-n // batch) for n in sizes]
    assert active == [sum(s > t for s in steps) for t in range(max(steps))]
    expected_rows, expected_real = [], []
    batches = []
    for c, n in enumerate(sizes):
        gen, offset = torch.Generator().manual_seed(10 + c), sum(sizes[:c])
        own = []
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen).tolist()
            own += [order[i:i + batch] for i in range(0, n, batch)]
        # padding: the batch's own first sample, not real
        batches.append([([offset + i for i in b] + [offset + b[0]] * (batch - len(b)),
                         [1.0] * len(b) + [0.0] * (batch - len(b))) for b in own])
    for t in range(max(steps, default=0)):
        for c in range(active[t]):
            expected_rows.append(batches[c][t][0])
            expected_real.append(batches[c][t][1])
    assert rows.tolist() == expected_rows and real.tolist() == expected_real
    assert rows.shape == (sum(steps), batch) and real.shape == (sum(steps), batch)


def test_a_batch_size_above_every_clients_samples_pads_no_wider_than_the_largest(monkeypatch) -> None:
    """batch-size 1,000,000 on clients of at most 90 samples: each client
    takes one full-data step per epoch, batched as alone (two rounds of
    SCAFFOLD), and the batch plan is no wider than the largest client (its
    width was batch-size: gigabytes of padding)."""
    widths = []
    real_plan = cohort_module._batch_plan

    def plan(members, epochs, batch_size, *a, **k):
        widths.append(batch_size)
        return real_plan(members, epochs, batch_size, *a, **k)

    monkeypatch.setattr(cohort_module, "_batch_plan", plan)
    cfg = run_cfg("scaffold", **{"batch-size": 10**6})
    model, datas = make_model(), clients()
    states = [[ContextState(RecordDict()) for _ in datas] for _ in range(2)]
    for server_round in (1, 2):
        alone = per_client_round(cfg, model, datas, states[0], server_round)
        batched = cohort_round(cfg, model, datas, states[1], server_round)
        assert_same_round(batched, alone)
        assert [m["local-steps"] for m in batched[1]] == [2] * len(SIZES)  # local-epochs=2, one step each
    assert widths == [max(SIZES)] * 2


def image_clients(sizes=SIZES, augment=True, shape=(3, 8, 8)) -> list[TrainData]:
    """``clients`` of CIFAR-like images (C, H, W), augmented as CIFAR's are."""
    return [TrainData(x=d.x, y=d.y, augment=augment) for d in clients(sizes, shape=shape)]


def test_the_batch_plan_draws_each_clients_crops_in_its_own_loops_order() -> None:
    """With augmented data, ``_batch_plan`` also draws every sample's crop
    and flip from its client's generator, in the per-client loop's order
    (an epoch's ``randperm``, then one ``crop_flip_draws`` per batch of it),
    laid out as the rows; a client without augmentation, and every padded
    slot, gets the crop that leaves the image as it is; each generator is
    left where the per-client loop leaves it."""
    from fedaccel.data.augment import PAD, crop_flip_draws

    sizes, batch, epochs = [37, 33, 17, 5, 1], 16, 2
    datas = image_clients(sizes)
    datas[2] = TrainData(x=datas[2].x, y=datas[2].y, augment=False)  # one client's data is not augmented
    solver = get_algorithm("fedavg").solver(run_cfg("fedavg"))
    members = [CohortMember(solver, d, torch.Generator().manual_seed(10 + c), []) for c, d in enumerate(datas)]
    rows, real, active, steps, (dy, dx, flip) = cohort_module._batch_plan(members, epochs, batch,
                                                                          torch.device("cpu"))
    expected = []
    for c, (n, data) in enumerate(zip(sizes, datas)):
        gen, own = torch.Generator().manual_seed(10 + c), []
        for _ in range(epochs):
            torch.randperm(n, generator=gen)
            for begin in range(0, n, batch):
                b = min(batch, n - begin)
                if data.augment:
                    y, x, f = crop_flip_draws(b, gen)
                    y, x, f = y.tolist(), x.tolist(), f.tolist()
                else:
                    y, x, f = [PAD] * b, [PAD] * b, [False] * b
                pad = batch - b
                own.append((y + [PAD] * pad, x + [PAD] * pad, f + [False] * pad))
        expected.append(own)
        # the member's generator goes on as this one does
        assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=members[c].generator))
    for t in range(max(steps)):
        for c in range(active[t]):
            row = sum(active[:t]) + c
            assert (dy[row].tolist(), dx[row].tolist(), flip[row].tolist()) == expected[c][t], (t, c)
    assert dy.shape == dx.shape == flip.shape == rows.shape and flip.dtype == torch.bool


@pytest.mark.parametrize("algo, name, changes", [
    ("fedavg", "mlp", {"momentum": 0.9}), ("scaffold", "mlp", {}), ("fedcdr", "mlp", {}),
    ("fedpm", "mlp", {"fedpm.upload": "end", "fedpm.foof-samples": 3}), ("fedprox", "cnn-small", {})])
def test_an_augmented_round_equals_the_per_client_round(algo: str, name: str, changes: dict) -> None:
    """CIFAR's augmentation batched: each client's random crops and flips
    drawn as its own loop draws them, so two batched rounds (state read in
    the second) equal the per-client rounds to float32 rounding, ragged
    sizes, the MLP's written-out pass and a CNN through ``vmap`` included
    (FedPM draws its FOOF rows from the same generator first); and the
    crops are applied (the same rounds without augmentation differ)."""
    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model = make_model(name=name, shape=(3, 8, 8))
    datas, plain = image_clients(), image_clients(augment=False)
    assert fallback_reason(get_algorithm(algo).solver(cfg), cfg, model) is None
    states = [[ContextState(RecordDict()) for _ in datas] for _ in range(3)]
    for server_round in (1, 2):
        alone = per_client_round(cfg, model, datas, states[0], server_round)
        batched = cohort_round(cfg, model, datas, states[1], server_round)
        assert_same_round(batched, alone, scaled_extras=True)
        unaugmented = cohort_round(cfg, model, plain, states[2], server_round)
        assert not torch.allclose(unaugmented[0][0][0], alone[0][0][0], atol=1e-4)


@pytest.mark.slow  # two runs of 2 rounds on CIFAR-10 files: 5 s
def test_a_cifar_run_batched_equals_it_run_one_client_after_another(tmp_path, capsys) -> None:
    """The fast runner on CIFAR-10 (its real file format, written here) with
    augmentation: ``cohort-batching='auto'`` batches the MLP's clients (and
    says so), and its final model equals the run with
    ``cohort-batching='off'`` to float32 rounding."""
    import numpy as np

    from fedaccel.local_run import default_run_config, fuse, run_local
    from test_data import make_cifar10

    make_cifar10(tmp_path / "data", per_batch=40)
    base = {"algo": "scaffold", "dataset": "cifar10", "model": "mlp", "data-dir": str(tmp_path / "data"),
            "num-server-rounds": 2, "clients-per-round": 4, "local-epochs": 2, "batch-size": 8,
            "results-dir": str(tmp_path / "runs"), "device": "cpu"}
    models = {}
    for batching in ("auto", "off"):
        folder = run_local(fuse(default_run_config(), {**base, "cohort-batching": batching,
                                                       "run-name": batching}), num_clients=6)
        models[batching] = dict(np.load(folder / "final_model.npz"))
    assert "each round's clients train as one batched model (cohort-batching)" in capsys.readouterr().err
    for key, value in models["off"].items():
        np.testing.assert_allclose(models["auto"][key], value, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("settings", [{"momentum": 0.0}, {"momentum": 0.9, "weight_decay": 1e-2},
                                      {"momentum": 0.5, "nesterov": True}])
def test_a_narrowed_step_is_a_new_optimizer_on_the_first_rows(settings: dict) -> None:
    """``FunctionalSGD.narrowed(keep)``, what a retire does without building
    an optimizer, steps exactly as ``_retire``'s new optimizer over views of
    the first ``keep`` rows with their momentum buffers: the same weights and
    buffers bit for bit, and the rows after ``keep`` left as they were."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(5, 4, 3, generator=gen), torch.randn(5, 4, generator=gen)]
    a, b = [w.clone() for w in start], [w.clone() for w in start]
    pa, pb = [torch.nn.Parameter(w) for w in a], [torch.nn.Parameter(w) for w in b]
    optimizer = torch.optim.SGD(pa, lr=0.05, **settings)
    step = sgd_step(torch.optim.SGD(pb, lr=0.05, **settings))
    template = get_algorithm("fedavg").solver(run_cfg("fedavg", momentum=settings["momentum"],
                                                      **{"weight-decay": settings.get("weight_decay", 0.0)}))
    if settings.get("nesterov"):  # the solver's optimizer has no nesterov: retire into a plain one by hand
        template.make_optimizer = lambda model, lr: torch.optim.SGD(model.parameters(), lr=lr, **settings)
    for keep in (5, 3, 3, 1):
        if keep < len(pa[0]):
            pa, optimizer = cohort_module._retire(pa, optimizer, template, 0.05, keep)
            pb, step = step.narrowed(keep)
        step_both(optimizer, step, pa, pb, [torch.randn_like(p) for p in pa])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0][:1], start[0][:1]) and not torch.equal(a[0][3:], start[0][3:])
    if settings["momentum"]:
        for p, q in zip(pa, pb):
            assert torch.equal(optimizer.state[p]["momentum_buffer"], step.state[q]["momentum_buffer"])


def same_array(a: Array, b: Array) -> bool:
    """The same Flower Array: fields and bytes (a DeferredArray's written when read)."""
    return (a.dtype, a.shape, a.stype, a.data, a.is_dirty) == (b.dtype, b.shape, b.stype, b.data, b.is_dirty)


@pytest.mark.parametrize("algo, changes", [("fedavg", {}), ("fedprox", {}), ("fedpm", {}),
                                           ("fedpm", {"fedpm.upload": "end"})])
def test_uploads_built_from_the_stacked_weights_are_the_loaded_models_byte_for_byte(algo: str, changes: dict,
                                                                                   monkeypatch) -> None:
    """For a solver that uploads its trained weights as they are and reads no
    model after the steps (FedAvg, FedProx; FedPM's FOOF mode, whose matrices
    the trainer forms batched), the cohort trainer builds each reply's
    ``arrays`` from the stacked weights instead of loading them into the
    model and calling ``upload``: the same Arrays (keys, dtype, shape,
    bytes), and the same extra records."""
    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9, **changes})
    model, datas = make_model(), clients()

    def arrays_of_round() -> list:
        start = state_to_arrays(model)
        jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=start,
                          config=config_for(cfg.algo, 1), state=ContextState(RecordDict()),
                          generator=seeded_generator(cfg.seed, 1, c, "train"), received=received_for(algo, model))
                for c, data in enumerate(datas)]
        loads = []
        real = cohort_module._load_weights
        monkeypatch.setattr(cohort_module, "_load_weights", lambda *a: loads.append(1) or real(*a))
        results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
        return [(r.arrays, r.extra) for r in results], len(loads)

    built, loads_built = arrays_of_round()
    monkeypatch.setattr(type(get_algorithm(algo).solver(cfg)), "reads_trained_model", lambda self: True)
    loaded, loads_loaded = arrays_of_round()
    assert (loads_built, loads_loaded) == (0, len(datas))  # no client loaded into the model, or every one
    for (x, ex), (y, ey) in zip(built, loaded):
        assert list(x.keys()) == list(y.keys())
        # the built upload writes its bytes only when read (a DeferredArray); read, they are the loaded model's
        assert all(type(x[k]) is DeferredArray and type(y[k]) is Array for k in x.keys())
        assert all(same_array(x[k], y[k]) for k in x.keys())
        assert list(ex) == list(ey)
        for name in ex:
            assert list(ex[name].keys()) == list(ey[name].keys())
            assert all(same_array(ex[name][k], ey[name][k]) for k in ex[name].keys())


@pytest.mark.parametrize("algo", ["fedavg", "feddyn", "fedrkmgc"])
def test_a_model_whose_upload_cannot_be_built_from_the_stack_is_loaded_for_the_default_upload(algo,
                                                                                            monkeypatch) -> None:
    """When the stacked weights cannot give the upload (``_weight_records``
    says None for a model whose state is more than its parameters, in
    another order or not contiguous), a solver whose upload is the default
    ``state_to_arrays(model)`` gets its weights loaded, even when nothing
    else after the steps reads the model (FedAvg; FedDyn and FedRKMGC once
    their state is formed): the same replies as when the upload is built."""
    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9})
    model, datas = make_model(), clients()

    def arrays_of_round() -> list:
        jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                          config=config_for(algo, 1), state=ContextState(RecordDict()),
                          generator=seeded_generator(cfg.seed, 1, c, "train"))
                for c, data in enumerate(datas)]
        return [r.arrays for r in fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)]

    built = arrays_of_round()
    monkeypatch.setattr(cohort_module, "_weight_records",
                        lambda model_state, slots, weights, rows, part, *rest: [None] * len(part))
    loaded = arrays_of_round()
    for x, y in zip(built, loaded):
        assert list(x.keys()) == list(y.keys()) and all(same_array(x[k], y[k]) for k in x.keys())


def test_uploads_stay_on_the_device_when_the_cohort_is_one_chunk_or_they_fit_their_room() -> None:
    keeps = cohort_module.keeps_uploads_on_device
    assert keeps(chunk=7, clients=7, model_bytes=10**9, upload_room=None)  # one chunk: there anyway
    assert not keeps(chunk=3, clients=7, model_bytes=100, upload_room=None)  # no room known
    assert keeps(chunk=3, clients=7, model_bytes=100, upload_room=700)
    assert not keeps(chunk=3, clients=7, model_bytes=100, upload_room=699)


@pytest.mark.parametrize("chunk, room, on_device", [(None, None, True), (3, None, False), (3, 1 << 40, True),
                                                    (3, 1000, False)],
                         ids=["one-chunk", "chunks", "chunks-with-room", "chunks-without-room"])
def test_uploads_stay_where_they_trained_only_when_one_chunk_or_room(chunk, room, on_device) -> None:
    """The built uploads are rows of the stacked weights (one stack per
    parameter, shared by the clients of a chunk): kept where they trained
    when the whole cohort is one chunk or all its uploads fit the room
    given, copied to the host chunk by chunk otherwise (so that several
    chunks' weights never pile up on a GPU beyond it). On a CPU all are the
    host. Their values are the trained weights either way."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = run_cfg("fedavg", **{"batch-size": 16, "device": device})
    model = make_model().to(device)
    datas = [TrainData(x=d.x.to(device), y=d.y.to(device)) for d in clients()]
    start = state_to_arrays(model)
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=start, config=config_for("fedavg", 1),
                      state=ContextState(RecordDict()), generator=seeded_generator(cfg.seed, 1, c, "train"))
            for c, data in enumerate(datas)]
    results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size, max_clients=chunk, upload_room=room)
    uploads = [r.arrays for r in results]
    stacks = {id(a.__dict__["_rows"]): a.__dict__["_rows"] for record in uploads for a in record.values()}
    assert len(stacks) == len(list(model.parameters())) * (1 if chunk is None else -(-len(datas) // chunk))
    assert all(rows.tensor.device.type == (device if on_device else "cpu") for rows in stacks.values())
    plain = [{k: from_numpy(to_numpy(a).copy()) for k, a in record.items()} for record in uploads]
    weights = [float(len(d.y)) for d in datas]
    got, expected = mean_of_records(uploads, weights), mean_of_records(plain, weights)
    assert all(got[k].tobytes() == expected[k].tobytes() for k in expected)
    assert all(all_finite(a) for record in uploads for a in record.values())


def test_solvers_that_read_the_trained_model_upload_it_themselves() -> None:
    """SCAFFOLD, FedDyn, FedRKMGC, FedPM (``end_round``) and FedCDR
    (``upload``) read the model after the steps: the trainer loads their
    weights, and ``close_round`` refuses an upload built for them."""
    for algo in ("scaffold", "feddyn", "fedrkmgc", "fedpm", "fedcdr"):
        assert not get_algorithm(algo).solver.uploads_trained_weights(), algo
    model = make_model()
    solver = new_solver(run_cfg("scaffold"), model)
    with pytest.raises(TypeError, match="builds its own upload"):
        solver.close_round(model, clients()[0], ContextState(RecordDict()), {"local-steps": 1},
                           arrays=state_to_arrays(model))


def test_no_upload_is_built_for_a_model_with_buffers() -> None:
    """A model whose state holds more than its parameters: its upload is the
    model's own state dict, so every member goes the loading way."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()
    slots = [list(state).index(name) for name, _ in model.named_parameters()]
    weights = [torch.stack([p.detach()] * 2) for p in model.parameters()]
    member = CohortMember(get_algorithm("fedavg").solver(run_cfg("fedavg")), clients()[0], torch.Generator(), [])
    assert cohort_module._weight_records(state, slots, weights, [0, 1], [(0, member), (1, member)]) == [None, None]
    # nor for a parameter that is not C-contiguous (Flower writes its upload in Fortran order)
    transposed = torch.nn.Linear(3, 2)
    transposed.weight = torch.nn.Parameter(torch.randn(3, 2).t())
    state = transposed.state_dict()
    weights = [torch.stack([p.detach()] * 2) for p in transposed.parameters()]
    assert cohort_module._weight_records(state, [0, 1], weights, [0, 1], [(0, member), (1, member)]) == [None, None]


def test_a_models_own_backward_without_nll_gradients_is_called_as_before() -> None:
    """A model whose own ``batched_loss_and_grads`` takes no ``nll_grad``
    (and has no ``nll_gradients``) is called with its four arguments."""
    from fedaccel.clients.cohort import batched_loss_and_grads

    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

        @staticmethod
        def batched_loss_and_grads(p, x, target, label_grad):
            return {"w": p["w"] * 0 + 1}, label_grad

    model = Own()
    assert cohort_module.round_nll_gradients(model, {"w": torch.zeros(1, 2)}, torch.zeros(1, 1, 2, dtype=torch.long),
                                             torch.zeros(1, 1, 2)) is None
    grads, out = batched_loss_and_grads(model)([torch.zeros(1, 2)], torch.zeros(1, 2, 2),
                                               torch.zeros(1, 1, 2, dtype=torch.long), torch.ones(1, 1, 2))
    assert torch.equal(grads[0], torch.ones(1, 2)) and torch.equal(out, torch.ones(1, 1, 2))


def test_a_subclass_that_changes_forward_is_not_batched_as_its_parent() -> None:
    """An MLP subclass with its own ``forward``: the chain's batched methods
    would compute the parent's network, so the trainer takes ``vmap`` and
    autograd, and the batched round still equals the per-client round."""
    from fedaccel.clients.cohort import batched_loss_and_grads, own_batched
    from fedaccel.models.nets import MLP

    class Doubled(MLP):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = Doubled(6, 3)
    assert not model.chain_is_forward() and MLP(6, 3).chain_is_forward()
    assert own_batched(model, "batched_forward") is None
    assert batched_loss_and_grads(model).__name__ == "through_autograd"
    cfg = run_cfg("fedavg", **{"batch-size": 16, "momentum": 0.9})
    datas = clients([11, 3, 20])
    states = [ContextState(RecordDict()) for _ in datas]
    assert_same_round(per_client_round(cfg, model, datas, states, 1), cohort_round(cfg, model, datas, states, 1))


def test_on_refuses_a_run_that_cannot_be_batched_and_auto_says_why(tmp_path, capsys) -> None:
    from fedaccel.config import ConfigError
    from fedaccel.local_run import default_run_config, fuse, run_local

    base = {"algo": "fedpm", "fedpm.refresh-every": 2, "num-server-rounds": 1, "clients-per-round": 2,
            "synthetic.max-samples": 60, "results-dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"cohort-batching='on' but .*fedpm.refresh-every=2 recomputes"):
        run_local(fuse(default_run_config(), {**base, "cohort-batching": "on"}), num_clients=4)
    # the same line up front for 8 logical clients on 4 cohort nodes (asked of the first logical client)
    with pytest.raises(ConfigError, match=r"cohort-batching='on' but .*fedpm.refresh-every=2 recomputes"):
        run_local(fuse(default_run_config(), {**base, "cohort-batching": "on", "logical-clients": 8}), num_clients=4)
    assert not list(tmp_path.iterdir())  # refused before any run folder
    run_local(fuse(default_run_config(), {**base, "cohort-batching": "auto"}), num_clients=4)
    assert "clients train one after another (fedpm.refresh-every=2 recomputes" in capsys.readouterr().err
    del base["fedpm.refresh-every"]
    run_local(fuse(default_run_config(), {**base, "algo": "fedprox", "cohort-batching": "auto"}), num_clients=4)
    assert "each round's clients train as one batched model" in capsys.readouterr().err
    run_local(fuse(default_run_config(), {**base, "algo": "fedprox"}), num_clients=4)  # the default: 'auto'
    assert "each round's clients train as one batched model" in capsys.readouterr().err
    run_local(fuse(default_run_config(), {**base, "algo": "fedprox", "cohort-batching": "off"}), num_clients=4)
    assert "clients train one after another (cohort-batching='off')" in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["fedprox", "fedpm", "fedcdr"])
def test_chunks_train_the_same_clients_to_the_same_weights(algo) -> None:
    """A cohort split into chunks of 2 ends where the whole cohort does:
    each client's gradient is its own, whoever shares its batch (FedPM: each
    chunk's clients make their FOOF pass when their chunk trains; FedCDR:
    each chunk's clients begin together, their state stacked per chunk)."""
    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9})
    model, datas = make_model(), clients()
    start = state_to_arrays(model)

    def round_with(max_clients):
        jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=start,
                          config=config_for(algo, 1), state=ContextState(RecordDict()),
                          generator=seeded_generator(cfg.seed, 1, c, "train"))
                for c, data in enumerate(datas)]
        begun = []
        real = type(jobs[0].solver).cohort_begin_round
        for job in jobs:  # each call's chunk size, seen from the first solver's class
            job.solver.cohort_begin_round = lambda model, openings: begun.append(len(openings)) or real(
                jobs[0].solver, model, openings)
        results = fit_cohort(copy.deepcopy(model), jobs, 16, max_clients=max_clients)
        if jobs[0].solver.overrides("cohort_begin_round"):
            assert begun == ([len(jobs)] if max_clients is None else [2, 2, 2, 1])
        if algo == "fedpm":  # a finished client keeps no FOOF matrices in memory
            assert all(not job.solver.inverses and not job.solver.factors and not job.solver.used for job in jobs)
        return [[torch.from_numpy(a.numpy()) for a in r.arrays.values()] for r in results]
    for whole, chunked in zip(round_with(None), round_with(2)):
        for p, q in zip(whole, chunked):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


def test_fedpm_counts_its_foof_matrices_in_the_chunk_estimate() -> None:
    from fedaccel.clients.cohort import bytes_per_client

    model = make_model()
    solver = get_algorithm("fedpm").solver(run_cfg("fedpm"))
    d = [7, 33]  # the 6-32-3 MLP's layers: inputs + bias
    # each layer's float64 matrix and two inverses (or factors); the batched pass's float64 temporaries
    assert solver.cohort_bytes(model) == sum(k * k * (8 + 2 * 4) for k in d) + 3 * 8 * 33 * 33
    assert LocalSolver(run_cfg("fedavg")).cohort_bytes(model) == 0
    plain = bytes_per_client(model, torch.zeros(6), 16)
    assert bytes_per_client(model, torch.zeros(6), 16, solver.cohort_bytes(model)) == plain + solver.cohort_bytes(model)


def test_memory_per_client_counts_activations_and_model_copies() -> None:
    from fedaccel.clients.cohort import MODEL_COPIES, bytes_per_client, chunk_size

    mlp = make_model()
    params = sum(p.numel() for p in mlp.parameters()) * 4
    small, large = (bytes_per_client(mlp, torch.zeros(6), b) for b in (1, 64))
    assert small > MODEL_COPIES * params and large > small  # activations grow with the batch
    cnn = make_model(name="cnn-small", shape=(1, 8, 8))
    assert bytes_per_client(cnn, torch.zeros(1, 8, 8), 16) > large
    per_client = bytes_per_client(mlp, torch.zeros(6), 16)
    assert chunk_size(mlp, torch.zeros(6), 16, available=32 * per_client) == 8  # a quarter of it
    # rounded down to a power of two: the same chunks while 8 to 15 clients fit
    assert {chunk_size(mlp, torch.zeros(6), 16, available=k * 4 * per_client) for k in range(8, 16)} == {8}
    assert chunk_size(mlp, torch.zeros(6), 16, available=4 * 16 * per_client) == 16
    assert chunk_size(mlp, torch.zeros(6), 16, available=1) == 1
    assert chunk_size(mlp, torch.zeros(6), 16, available=None) >= 10**6


@pytest.mark.slow  # two runs of a CNN: 5 s
def test_auto_does_not_batch_a_cnn_on_a_cpu_but_on_does(tmp_path, capsys) -> None:
    from fedaccel.clients.cohort import slower_reason
    from fedaccel.local_run import default_run_config, fuse, run_local

    assert slower_reason(make_model()) is None  # the MLPs batch their own forward
    base = {"algo": "fedavg", "dataset": "digits", "model": "cnn-small", "num-server-rounds": 1,
            "clients-per-round": 2, "results-dir": str(tmp_path), "device": "cpu"}  # on a GPU machine too
    run_local(fuse(default_run_config(), {**base, "cohort-batching": "auto"}), num_clients=4)
    assert "one after another (on a CPU this model's batched convolutions" in capsys.readouterr().err
    run_local(fuse(default_run_config(), {**base, "cohort-batching": "on"}), num_clients=4)
    err = capsys.readouterr().err
    assert "each round's clients train as one batched model (cohort-batching)\n" in err
    # FedPM batched on a CNN: the steps batched, its FOOF matrices client by client, and the line says so
    run_local(fuse(default_run_config(), {**base, "algo": "fedpm", "cohort-batching": "on"}), num_clients=4)
    assert ("each round's clients train as one batched model (cohort-batching); fedpm's FOOF matrices are "
            "formed one client at a time") in capsys.readouterr().err


@pytest.mark.parametrize("algo, changes", [("fedcdr", {"momentum": 0.9}),
                                           ("feddr", {"feddr.prox-start": "local", "feddr.init": "zeros"})])
def test_a_douglas_rachford_upload_formed_from_the_stacked_weights_is_the_loaded_ones(algo, changes,
                                                                                       monkeypatch) -> None:
    """The cohort trainer forms every Douglas-Rachford client's reflect,
    ``g_i`` and new state from the stacked weights at once
    (``cohort_after_steps``), loading no client into the model: the same
    reply Arrays and the same stored state records, byte for byte, as
    loading each client and calling its ``upload``."""
    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model, datas = make_model(), clients()

    def round_of(states):
        start = state_to_arrays(model)
        jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=start, config=config_for(algo, r),
                          state=states[c], generator=seeded_generator(cfg.seed, r, c, "train"))
                for r in (1,) for c, data in enumerate(datas)]
        loads = []
        real = cohort_module._load_weights
        monkeypatch.setattr(cohort_module, "_load_weights", lambda *a: loads.append(1) or real(*a))
        results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
        return [r.arrays for r in results], len(loads)

    formed_states = [ContextState(RecordDict()) for _ in datas]
    formed, loads_formed = round_of(formed_states)
    from fedaccel.clients.douglas_rachford import DouglasRachfordSolver
    monkeypatch.setattr(DouglasRachfordSolver, "cohort_after_steps", lambda self, *a, **k: None)
    loaded_states = [ContextState(RecordDict()) for _ in datas]
    loaded, loads_loaded = round_of(loaded_states)
    assert (loads_formed, loads_loaded) == (0, len(datas))
    for x, y in zip(formed, loaded):
        assert list(x.keys()) == list(y.keys()) and all(same_array(x[k], y[k]) for k in x.keys())
        assert all(type(x[k]) is DeferredArray for k in x.keys())  # rows of one stack per key, bytes written when read
    for a, b in zip(formed_states, loaded_states):
        assert list(a.record.keys()) == list(b.record.keys())
        assert all(a.record[k] == b.record[k] for k in a.record.keys())


@pytest.mark.parametrize("hook", ["upload", "begin_round"])
def test_a_douglas_rachford_subclass_with_its_own_hook_has_it_called_client_by_client(hook) -> None:
    """A subclass's own ``upload`` is called with each client's trained model
    loaded (no upload formed for the batch); its own ``begin_round`` on each
    client's received model (no batched begin)."""
    from fedaccel.clients.douglas_rachford import DouglasRachfordSolver

    calls = []

    def logged(self, *args):
        calls.append(1)
        return getattr(DouglasRachfordSolver, hook)(self, *args)

    logged_class = type("Logged", (DouglasRachfordSolver,), {hook: logged})
    cfg = run_cfg("fedcdr", **{"batch-size": 16})
    model, datas = make_model(), clients()[:3]
    jobs = [CohortJob(solver=logged_class(cfg), data=data, arrays=state_to_arrays(model),
                      config=config_for("fedcdr", 1), state=ContextState(RecordDict()),
                      generator=seeded_generator(cfg.seed, 1, c, "train"))
            for c, data in enumerate(datas)]
    for job in jobs:
        job.solver.initial_model = copy.deepcopy(model.state_dict())
    if hook == "begin_round":
        assert jobs[0].solver.cohort_begin_round(model, []) is None
    results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    assert calls == [1, 1, 1] and all(not isinstance(r, BaseException) for r in results)
    if hook == "upload":
        assert all(job.solver.reads_trained_model() for job in jobs)

def _dr_round_one(cfg, model, datas, states) -> None:
    """Round 1 of the clients with ``states`` (a batched round: its state is what round 2 reads)."""
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                      config=config_for(cfg.algo, 1), state=state,
                      generator=seeded_generator(cfg.seed, 1, c, "train"))
            for c, (data, state) in enumerate(zip(datas, states))]
    assert not any(isinstance(r, BaseException) for r in fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size))


@pytest.mark.parametrize("store, everyone_saved", [("context", False), ("stacked", False), ("stacked", True)])
@pytest.mark.parametrize("algo, changes", [("fedcdr", {"momentum": 0.9, "fedcdr.alpha": 0.7}),
                                           ("feddr", {"feddr.prox-start": "local", "feddr.init": "zeros"})])
def test_douglas_rachford_rounds_begun_together_are_each_clients_begin_round_bit_for_bit(algo, changes, store,
                                                                                       everyone_saved) -> None:
    """``cohort_begin_round`` sets on every solver what its own ``begin_round``
    sets, to the bit (relaxed ``y_i``, ``xhat_i``, the anchors), and starts each
    client where ``begin_round`` leaves the model (the received model, or its
    own ``x_i`` with ``prox-start='local'``): clients with saved state, one
    whose last reply was not applied (rolled back to the initial state) and
    clients new to training. With the fast runner's stacked store
    (``store='stacked'``) the cohort's states are read in one gather, the
    same rows each client's own read gives; when every client has saved
    state (``everyone_saved``), the stacks are the gathered rows themselves."""
    from fedaccel.clients.cohort import Opening
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model, datas = make_model(), clients()
    stacked = StackedClientStates(len(datas) + 2)
    rows = [5, 0, 7, 2, 1, 3, 6]  # the clients' partitions: rows in another order than the cohort's
    states = [ContextState(RecordDict()) if store == "context" else StackedRowState(stacked, rows[c])
              for c in range(len(datas))]
    trained = len(datas) if everyone_saved else 4  # else clients 4..6 have never trained
    _dr_round_one(cfg, model, datas[:trained], states[:trained])
    with torch.no_grad():  # the server moved
        for p in model.parameters():
            p.add_(0.01 * torch.ones_like(p))
    rolled_back = () if everyone_saved else (3,)
    configs = [dict(config_for(algo, 2), **({"accepted-round": 0} if c in rolled_back else {}))
               for c in range(len(datas))]
    per_client_states = [ContextState(copy.deepcopy(s.record)) if store == "context"
                         else ContextState(stacked.record_dict(rows[c])) for c, s in enumerate(states)]
    gathers = []
    stacked.gather_latest = lambda *args, real=stacked.gather_latest: gathers.append(args) or real(*args)
    expected = []
    for c, (config, state) in enumerate(zip(configs, per_client_states)):
        solver, scratch = new_solver(cfg, model), copy.deepcopy(model)
        solver.open_round(scratch, config, state)
        expected.append((solver, [p.detach().clone() for p in scratch.parameters()]))
    scratch = copy.deepcopy(model)
    received = [t.detach().clone() for t in model.state_dict().values()]
    solvers = [new_solver(cfg, model) for _ in datas]
    openings = [Opening(solver, state, solver.open_round(scratch, config, state, begin=False), received, received)
                for solver, config, state in zip(solvers, configs, states)]  # the MLP's state: its parameters
    begun = solvers[0].cohort_begin_round(scratch, openings)
    assert begun is not None
    assert len(gathers) == (store == "stacked")
    outcomes = [s.versions() for s in states]
    assert outcomes == [s.versions() for s in per_client_states]  # the same commit / roll-back
    for c, ((want, start), got, got_start) in enumerate(zip(expected, solvers, begun)):
        assert torch.equal(got._y_flat, want._y_flat) and torch.equal(got._xhat_flat, want._xhat_flat), c
        assert list(got.y) == list(want.y) and all(torch.equal(got.y[k], want.y[k]) for k in want.y)
        assert all(torch.equal(a, b) for a, b in zip(got.step_tensors()["y"], want.step_tensors()["y"]))
        assert got.inv_eta == want.inv_eta and got._layout == want._layout
        assert all(torch.equal(a, b) for a, b in zip(got_start, start)), c
    # the trainer's stacked anchors, in any order of the members: each member's own, stacked
    members = [CohortMember(solvers[c], datas[c], None, begun[c]) for c in (4, 0, 6, 3, 1, 5, 2)]
    stacked = solvers[4].cohort_step_tensors(members)["y"]
    for i, got in enumerate(stacked):
        assert torch.equal(got, torch.stack([m.solver.step_tensors()["y"][i] for m in members]))
    if everyone_saved:  # each its own state, not one client's for all
        assert len({got._y_flat.sum().item() for got in solvers}) == len(datas)
        return
    # and the cases differ: a client with saved state, a rolled-back one and a new one
    assert not torch.equal(solvers[0]._xhat_flat, solvers[3]._xhat_flat)
    assert torch.equal(solvers[3]._xhat_flat, solvers[5]._xhat_flat)


def _dr_stacked_round(cfg, model, datas, store, server_round, received_models, chunk):
    """A batched Douglas-Rachford round of ``datas`` on the stacked ``store``
    (partitions ``DR_PIDS``), client ``c`` sent ``received_models[c % n]``."""
    from fedaccel.clients.stacked_state import StackedRowState

    x0 = copy.deepcopy(model.state_dict())
    records = [state_to_arrays(m) for m in received_models]
    jobs = []
    for c, data in enumerate(datas):
        solver = new_solver(cfg, model)
        solver.initial_model = x0
        jobs.append(CohortJob(solver=solver, data=data, arrays=records[c % len(records)],
                              config=config_for(cfg.algo, server_round), state=StackedRowState(store, DR_PIDS[c]),
                              generator=seeded_generator(cfg.seed, server_round, c, "train")))
    results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size, max_clients=chunk)
    assert not any(isinstance(r, BaseException) for r in results)
    return results


def _dr_round_bits(results, store) -> tuple:
    """The replies' bytes and metrics, and every written row and tag of ``store``."""
    replies = [([(k, a.numpy().tobytes()) for k, a in r.arrays.items()], dict(r.metrics)) for r in results]
    rows = {name: [[(pid, slot[pid].numpy().tobytes()) for pid, version in enumerate(held) if version != -1]
                   for slot, held in zip(slots.slots, slots.version)] for name, slots in store.names.items()}
    return replies, rows, store.tags.tolist()


DR_PIDS = [5, 0, 7, 2, 1, 3, 6]  # the clients' partitions: rows in another order than the cohort's


@pytest.mark.parametrize("algo, changes", [
    ("fedcdr", {"momentum": 0.9, "fedcdr.alpha": 0.7}),
    ("fedcdr", {"fedcdr.prox-start": "local", "fedcdr.alpha": 0.7}),
    ("feddr", {"feddr.prox-start": "local", "feddr.init": "zeros"}),
])
@pytest.mark.parametrize("received, chunk", [(1, None), (3, None), (3, 3)])
def test_a_douglas_rachford_cohort_that_all_saved_state_begins_from_the_gathered_stack_as_row_by_row(
        algo, changes, received, chunk, monkeypatch) -> None:
    """Rounds 2 and 3 of a cohort in which every client has saved state on
    the stacked store begin from the column blocks of the one gathered stack
    (``_begin_gathered``, once per chunk), and give the bits of the same
    rounds begun from each client's own read: every reply, metric, stored
    row and tag; with one received model or three (clients sent different
    models relax against their own), whole and in chunks of 3."""
    from fedaccel.clients import douglas_rachford as dr
    from fedaccel.clients.stacked_state import StackedClientStates

    cfg = run_cfg(algo, **{"batch-size": 16, **changes})
    model, datas = make_model(), clients()
    store = StackedClientStates(len(datas) + 2)
    _dr_stacked_round(cfg, model, datas, store, 1, [model], chunk)
    moved = []  # the server moved; with several models, client c got moved[c % received]
    for i in range(1, received + 1):
        moved.append(copy.deepcopy(model))
        with torch.no_grad():
            for p in moved[-1].parameters():
                p.add_(0.01 * i)
    row_by_row = copy.deepcopy(store)
    calls = []
    real = dr.DouglasRachfordSolver._begin_gathered

    def begin_gathered(self, openings, saved, *args):
        begun = real(self, openings, saved, *args)
        kept = [o.solver._y_flat for o in openings] + [o.solver._xhat_flat for o in openings] + [
            t for start in begun if start is not None for t in start]
        # nothing kept through the round holds the gathered stack (3 D values a client)
        assert saved.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in kept}
        calls.append(1)
        return begun
    monkeypatch.setattr(dr.DouglasRachfordSolver, "_begin_gathered", begin_gathered)
    gathered = [_dr_round_bits(_dr_stacked_round(cfg, model, datas, store, r, moved, chunk), store) for r in (2, 3)]
    assert len(calls) == 2 * (1 if chunk is None else -(-len(datas) // chunk))
    monkeypatch.setattr(dr, "gathered_rows", lambda *args: None)  # each client's own read
    alone = [_dr_round_bits(_dr_stacked_round(cfg, model, datas, row_by_row, r, moved, chunk), row_by_row)
             for r in (2, 3)]
    assert gathered == alone


@pytest.mark.parametrize("cv_update", ["mean-gradient", "option-ii"])
@pytest.mark.parametrize("damage", ["missing", "broadcastable"])
@pytest.mark.parametrize("store, bad_clients", [("context", (2,)), ("stacked", (2,)), ("stacked", "all")])
def test_a_scaffold_client_sent_a_control_variate_of_another_model_fails_alone(cv_update, damage, store,
                                                                              bad_clients) -> None:
    """A ``scaffold.c`` record without one of the model's parameters, or
    with another shape (even one that would broadcast), is that client's
    own error, in its per-client round and in a batched one, where the
    others train and reply as they would alone (on the stacked store: the
    others' rows of the cohort's stacks, without the failed client's)."""
    import numpy as np

    from fedaccel.arrays import arrays_to_record, from_numpy
    from fedaccel.clients.scaffold import C_RECORD
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
    from fedaccel.contract import ContractError

    cfg = run_cfg("scaffold", **{"batch-size": 16, "momentum": 0.0, "scaffold.cv-update": cv_update})
    model, datas = make_model(), clients()
    good = received_for("scaffold", model)[C_RECORD]
    first = next(iter(good.keys()))
    bad = [(k, a) for k, a in good.items() if damage == "broadcastable" or k != first]
    if damage == "broadcastable":
        bad = [(k, from_numpy(np.zeros(1, np.float32)) if k == first else a) for k, a in bad]
    bad_clients = range(len(datas)) if bad_clients == "all" else bad_clients  # all: no client begins
    received = [{C_RECORD: arrays_to_record(bad) if c in bad_clients else good} for c in range(len(datas))]
    with pytest.raises(ContractError, match="another model|different models"):
        new_solver(cfg, model).fit(copy.deepcopy(model), datas[2], config_for("scaffold", 1),
                                   ContextState(RecordDict()), seeded_generator(cfg.seed, 1, 2, "train"), received[2])

    rows = StackedClientStates(len(datas))
    states = [ContextState(RecordDict()) if store == "context" else StackedRowState(rows, c) for c in range(len(datas))]

    def jobs(server_round, sent):
        return [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                          config=config_for("scaffold", server_round), state=states[c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"), received=sent[c])
                for c, data in enumerate(datas)]
    # a first round with the right c gives every client a c_i of its own, then client 2 gets a damaged c
    fit_cohort(copy.deepcopy(model), jobs(1, [{C_RECORD: good}] * len(datas)), cfg.batch_size)
    saved = [copy.deepcopy(s.record) if store == "context" else rows.record_dict(c) for c, s in enumerate(states)]
    results = fit_cohort(copy.deepcopy(model), jobs(2, received), cfg.batch_size)
    assert [c for c, r in enumerate(results) if isinstance(r, ContractError)] == list(bad_clients)
    good_clients = [c for c in (0, 3, 4) if c not in bad_clients]
    alone = [new_solver(cfg, model).fit(copy.deepcopy(model), datas[c], config_for("scaffold", 2),
                                        ContextState(saved[c]), seeded_generator(cfg.seed, 2, c, "train"),
                                        received[c]) for c in good_clients]
    for c, want in zip(good_clients, alone):
        assert list(results[c].extra) == list(want.extra) == ["scaffold.dc"]
        assert_same_arrays(results[c], want)
        for k in want.extra["scaffold.dc"].keys():
            torch.testing.assert_close(torch.from_numpy(results[c].extra["scaffold.dc"][k].numpy()),
                                       torch.from_numpy(want.extra["scaffold.dc"][k].numpy()), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("algo, changes", [("scaffold", {}), ("feddc", {"feddc.alpha": 0.3})])
@pytest.mark.parametrize("cv_update", ["mean-gradient", "option-ii"])
@pytest.mark.parametrize("max_clients", [None, 3])
def test_scaffold_clients_of_one_stacked_chunk_with_other_learning_rates_train_as_alone(algo, changes, cv_update,
                                                                                       max_clients,
                                                                                       monkeypatch) -> None:
    """Clients begun together in one chunk (their ``c_i`` rows of one
    stack; FedDC's ``h_i`` too) but trained as two groups (another learning
    rate each): every group's ``c_i``, ``c - c_i``, ``grad_sum`` (and
    ``h_i``, with the anchor) are its members' rows, so each client replies
    what it replies alone, round after round, and stores the same records.
    Clients 1 and 3 received another model than the others (one record
    each, shared as the fast runner shares it): the anchor of the group
    they are in is stacked, the other group's is the one received model
    expanded over its members. In chunks of 3 a group's chunk mixes
    clients begun in different chunks (rows of different stacks): each
    client's own rows. The stacks are used, and not kept past the round."""
    from fedaccel.clients.scaffold import C_RECORD
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    solver_class = get_algorithm(algo).solver
    handed = []
    real = solver_class.cohort_step_tensors
    monkeypatch.setattr(solver_class, "cohort_step_tensors",
                        lambda self, members: handed.append(real(self, members)) or handed[-1])

    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.0, f"{algo}.cv-update": cv_update, **changes})
    model, datas = make_model(), clients()
    moved = copy.deepcopy(model)  # what clients 1 and 3 received
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01)
    models = [moved if c in (1, 3) else model for c in range(len(datas))]
    sent = {C_RECORD: received_for(algo, model)[C_RECORD]}
    lrs = [0.1 if c % 2 == 0 else 0.05 for c in range(len(datas))]
    store = StackedClientStates(len(datas))
    stacked, own = [StackedRowState(store, c) for c in range(len(datas))], [ContextState(RecordDict()) for _ in datas]
    for server_round in (1, 2, 3):
        alone = [new_solver(cfg, model).fit(copy.deepcopy(models[c]), d, config_for(algo, server_round, lrs[c]),
                                            own[c], seeded_generator(cfg.seed, server_round, c, "train"), sent)
                 for c, d in enumerate(datas)]
        records = {id(model): state_to_arrays(model), id(moved): state_to_arrays(moved)}  # one record for many
        jobs = [CohortJob(solver=new_solver(cfg, model), data=d, arrays=records[id(models[c])],
                          config=config_for(algo, server_round, lrs[c]), state=stacked[c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"), received=sent)
                for c, d in enumerate(datas)]
        results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size, max_clients=max_clients)
        assert all(j.solver._rows_of is None and j.solver._grad_sum_at is None for j in jobs)  # released
        for want, got in zip(alone, results):
            for record, other in [(want.arrays, got.arrays), (want.extra["scaffold.dc"], got.extra["scaffold.dc"])]:
                for k in record.keys():
                    torch.testing.assert_close(torch.from_numpy(other[k].numpy()), torch.from_numpy(record[k].numpy()),
                                               atol=ATOL, rtol=RTOL)
        for c in range(len(datas)):  # the saved state: the same groups, the same values
            kept, alone_kept = stacked[c].get(algo, torch.device("cpu")), own[c].get(algo, torch.device("cpu"))
            assert list(kept) == list(alone_kept) and {k.split(".")[0] for k in kept} == set(solver_class.saved_groups)
            for k in kept:
                torch.testing.assert_close(kept[k], alone_kept[k], atol=ATOL, rtol=RTOL)
    assert any(h is not None for h in handed)  # the stacks were handed to the trainer
    assert (None in handed) == (max_clients == 3)  # a mixed chunk: its clients' own tensors
    if algo == "feddc" and max_clients is None:  # the one received model expanded (stride 0), two stacked
        anchors = [h["anchor"][0] for h in handed if h is not None]
        assert any(a.stride(0) == 0 for a in anchors) and any(a.stride(0) != 0 for a in anchors)


@pytest.mark.parametrize("algo, changes", [("feddyn", {"feddyn.alpha": 0.3}), ("fedrkmgc", {"fedrkmgc.variant": "full"})])
@pytest.mark.parametrize("max_clients", [None, 3])
def test_feddyn_and_fedrkmgc_stacked_state_trains_each_client_as_alone(algo, changes, max_clients,
                                                                       monkeypatch) -> None:
    """FedDyn's ``grad_prev`` and FedRKMGC's ``delta``, ``raw_prev`` kept as
    the cohort's stacks on the stacked store: clients in two learning-rate
    groups, in chunks of 3 (a group's chunk then mixes clients begun in
    other chunks), one received model shared by most clients (FedDyn's
    anchor expanded over them, then narrowed as clients finish) and
    another for two of the other group, and one client whose begin fails in round 2, reply
    and store what they do alone, round after round; the stacks are used
    and not kept past the round."""
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
    from fedaccel.contract import ContractError

    solver_class = type(get_algorithm(algo).solver(run_cfg(algo, **changes)))
    handed = []
    real_tensors = solver_class.cohort_step_tensors
    monkeypatch.setattr(solver_class, "cohort_step_tensors",
                        lambda self, members: handed.append(real_tensors(self, members)) or handed[-1])
    real_begin = solver_class.begin_at_anchor

    def begin(self, train, state, anchor):  # client 2's begin fails in round 2, after the others' state exists
        if train.server_round == 2 and getattr(self, "failing", False):
            raise ContractError("a client of its own error")
        return real_begin(self, train, state, anchor)
    monkeypatch.setattr(solver_class, "begin_at_anchor", begin)

    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9, **changes})
    model, datas = make_model(), clients()
    other = copy.deepcopy(model)  # clients 1 and 3 received another model (their group's anchor stacked)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    models = [other if c in (1, 3) else model for c in range(len(datas))]
    lrs = [0.1 if c % 2 == 0 else 0.05 for c in range(len(datas))]
    store = StackedClientStates(len(datas))
    stacked, own = [StackedRowState(store, c) for c in range(len(datas))], [ContextState(RecordDict()) for _ in datas]
    for server_round in (1, 2, 3):
        sent = {id(model): state_to_arrays(model), id(other): state_to_arrays(other)}  # one record for many clients
        jobs = [CohortJob(solver=new_solver(cfg, model), data=d, arrays=sent[id(models[c])],
                          config=config_for(algo, server_round, lrs[c]), state=stacked[c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"), received={})
                for c, d in enumerate(datas)]
        jobs[2].solver.failing = True
        results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size,
                             max_clients=max_clients)
        assert all(getattr(j.solver, "_rows_of", None) is None for j in jobs)  # released
        for c, got in enumerate(results):
            if server_round == 2 and c == 2:
                assert isinstance(got, ContractError)
                continue
            want = new_solver(cfg, model).fit(copy.deepcopy(models[c]), datas[c],
                                              config_for(algo, server_round, lrs[c]), own[c],
                                              seeded_generator(cfg.seed, server_round, c, "train"), {})
            assert_same_arrays(got, want)
        for c in range(len(datas)):  # the saved state: the same records (client 2 opened round 2 alone)
            if server_round == 1 or c != 2:
                assert set(store.record_dict(c).keys()) == set(own[c].record.keys()), (server_round, c)
    assert any(h is not None for h in handed)  # the stacks were handed to the trainer
    assert (None in handed) == (max_clients == 3)  # a mixed chunk: its clients' own tensors


def alone_and_batched(solver_class, cfg, model, datas, states, received, rounds=(1, 2)):
    """Per round: every client's round alone (through ``fit``, on a
    ``ContextState`` of its own kept across rounds) and the batched round of
    fresh ``solver_class`` solvers on ``states``, as (alone, batched) lists."""
    def solver():
        s = solver_class(cfg)
        s.initial_model = copy.deepcopy(model.state_dict())
        return s
    own = [ContextState(RecordDict()) for _ in datas]
    for server_round in rounds:
        alone = [solver().fit(copy.deepcopy(model), d, config_for(cfg.algo, server_round), own[c],
                              seeded_generator(cfg.seed, server_round, c, "train"), received)
                 for c, d in enumerate(datas)]
        jobs = [CohortJob(solver=solver(), data=d, arrays=state_to_arrays(model),
                          config=config_for(cfg.algo, server_round), state=states[c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"), received=received)
                for c, d in enumerate(datas)]
        yield alone, fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size), jobs


@pytest.mark.parametrize("declares_state_name", [False, True])
@pytest.mark.parametrize("algo", ["feddyn", "fedrkmgc"])
def test_a_feddyn_or_fedrkmgc_subclass_reading_its_state_before_end_round_keeps_its_own_tensors(
        algo, declares_state_name) -> None:
    """A subclass whose ``end_round`` reads the client's state tensors
    before its own work is given tensors of its own on the stacked store
    too (never rows of stacks it does not know of), and replies as alone;
    also one that declares ``state_name`` again, a record name of its own
    (its state is written and read back under that name)."""
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    base = type(get_algorithm(algo).solver(run_cfg(algo)))
    field = "grad_prev" if algo == "feddyn" else "delta"

    class Reads(base):
        if declares_state_name:
            state_name = f"own-{algo}"

        def end_round(self, model, state):
            self.norm = float(sum(v.abs().sum() for v in getattr(self, field).values()))
            return super().end_round(model, state)

    cfg = run_cfg(algo, **{"batch-size": 16})
    model, datas = make_model(), clients()
    store = StackedClientStates(len(datas))
    for alone, batched, jobs in alone_and_batched(Reads, cfg, model, datas,
                                                  [StackedRowState(store, c) for c in range(len(datas))], {}):
        assert not any(isinstance(b, BaseException) for b in batched)
        for want, got in zip(alone, batched):
            assert_same_arrays(got, want)
        assert all(j.solver.norm >= 0 for j in jobs)
    name = f"own-{algo}" if declares_state_name else algo  # the state is kept under the class's own name
    assert {key.split(".")[2] for key in store.record_dict(0).keys() if key.count(".") >= 2} == {name}


def test_a_new_solver_with_saved_state_is_batched_on_the_stacked_store_by_declaring_it() -> None:
    """Adding an algorithm whose clients keep model-shaped state: a
    ``StackedStateSolver`` that declares ``state_name``, ``saved_groups`` and
    ``state_attributes`` and writes ``begin_solver``, its rule and its
    ``end_round``, with no cohort hook of its own but ``cohort_step_tensors``
    (``member_rows``): on the stacked store its cohort's state is read in one
    gather and handed to the trainer as stacks, and every client's reply and
    saved state are what its own round alone gives, over three rounds."""
    from fedaccel.clients.stacked_solver import StackedStateSolver
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState, member_rows
    from fedaccel.clients.state import flat_groups

    handed, gathers = [], []

    class DriftPull(StackedStateSolver):
        """A toy rule: step with ``g + 0.5 v``; then ``v <- v + (w - anchor)``."""
        state_copies = 1
        state_name = "drift-pull"
        saved_groups, state_attributes = ("v",), ("drift",)

        def begin_solver(self, train, anchor) -> None:
            self.weight = 0.5

        def step_tensors(self):
            self._own_tensors()
            return {"drift": list(self.drift.values())}

        def cohort_step_tensors(self, members):
            handed.append(member_rows(members, ("drift",)))
            return handed[-1]

        def gradient_rule(self, w, g, tensors):
            return g + self.weight * tensors["drift"]

        def end_round(self, model, state):
            self._own_tensors()
            new = {k: self.drift[k] + (p.detach() - self.anchor[k]) for k, p in model.named_parameters()}
            state.put(self.state_name, flat_groups({"v": new}))
            return {}

    cfg = run_cfg("fedavg", **{"batch-size": 16})
    model, datas = make_model(), clients()
    store = StackedClientStates(len(datas))
    store.gather_latest = lambda *args, real=store.gather_latest: gathers.append(args[0]) or real(*args)
    for alone, batched, jobs in alone_and_batched(DriftPull, cfg, model, datas,
                                                  [StackedRowState(store, c) for c in range(len(datas))], {},
                                                  rounds=(1, 2, 3)):
        assert not any(isinstance(b, BaseException) for b in batched)
        for want, got in zip(alone, batched):
            assert_same_arrays(got, want)
        assert all(j.solver._rows_of is None for j in jobs)  # released
    assert gathers == ["drift-pull"] * 3 and handed and all(h is not None for h in handed)
    # the replies of rounds 2 and 3 depend on the saved drift (each client's own, not zero), so their
    # equality above checks the state saved and read back on the stacked store
    last = handed[-1]["drift"][0]
    assert all(row.abs().sum() > 0 for row in last) and len({row.sum().item() for row in last}) == len(datas)


def test_a_scaffold_solver_whose_batched_begin_failed_keeps_nothing_of_the_cohorts_stacks() -> None:
    """Client 2's ``scaffold.c`` is malformed in a batched round on the
    stacked store: its begin fails, and nothing the cohort handed over
    (``_given_state``, ``_given_c``) is left on its solver (taken before
    anything can raise), so the same solver's next round, client by client,
    reads its own state: the bits of a fresh solver's round."""
    import numpy as np
    from fedaccel.arrays import arrays_to_record
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
    from fedaccel.contract import ContractError

    def arrays_bytes(result):
        return ([(k, result.arrays[k].numpy().tobytes()) for k in result.arrays.keys()],
                [(name, [(k, rec[k].numpy().tobytes()) for k in rec.keys()]) for name, rec in result.extra.items()])

    cfg = run_cfg("scaffold", **{"batch-size": 16})
    model, datas = make_model(), clients()
    good = received_for("scaffold", model)[C_RECORD]
    first = next(iter(good.keys()))
    bad = arrays_to_record([(k, from_numpy(np.zeros(1, np.float32)) if k == first else a) for k, a in good.items()])
    store = StackedClientStates(len(datas))
    states = [StackedRowState(store, c) for c in range(len(datas))]
    for server_round in (1, 2):
        jobs = [CohortJob(solver=new_solver(cfg, model), data=d, arrays=state_to_arrays(model),
                          config=config_for("scaffold", server_round), state=states[c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"),
                          received={C_RECORD: bad if (server_round == 2 and c == 2) else good})
                for c, d in enumerate(datas)]
        results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    assert isinstance(results[2], ContractError)
    assert not any(isinstance(r, BaseException) for c, r in enumerate(results) if c != 2)
    failed = jobs[2].solver
    assert "_given_state" not in failed.__dict__ and "_given_c" not in failed.__dict__
    saved = store.record_dict(2)
    reused, fresh = (solver.fit(copy.deepcopy(model), datas[2], config_for("scaffold", 2),
                                ContextState(copy.deepcopy(saved)), seeded_generator(cfg.seed, 2, 2, "train"),
                                {C_RECORD: good})
                     for solver in (failed, new_solver(cfg, model)))
    assert arrays_bytes(reused) == arrays_bytes(fresh)


@pytest.mark.parametrize("store", ["context", "stacked"])
@pytest.mark.parametrize("own", ["new_control_variate", "step_tensors", "end_round"])
def test_a_scaffold_subclass_with_its_own_control_variate_rule_is_not_batched_past_it(store, own, monkeypatch) -> None:
    """A subclass with its own ``new_control_variate``, ``step_tensors`` or
    ``end_round`` keeps it in a batched round, on both stores: the batch
    forms no c_i of its own for it, and its code reads the client's own
    ``c_i``, ``grad_sum`` and ``c - c_i`` (never rows of the cohort's stacks
    it does not know of)."""
    from collections import OrderedDict

    from fedaccel.clients.scaffold import ScaffoldSolver
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    class Doubled(ScaffoldSolver):  # c_i+ twice the rule's
        def new_control_variate(self, model):
            return OrderedDict((k, 2 * v) for k, v in super().new_control_variate(model).items())

    class HalfCorrection(ScaffoldSolver):  # half the correction in the steps
        def step_tensors(self):
            return {"correction": [0.5 * v for v in self.correction], "grad_sum": list(self.grad_sum.values())}

    class Logged(ScaffoldSolver):  # reads c_i before its end_round
        def end_round(self, model, state):
            self.c_i_norm = float(sum(v.abs().sum() for v in self.c_i.values()))
            return super().end_round(model, state)

    subclass = {"new_control_variate": Doubled, "step_tensors": HalfCorrection, "end_round": Logged}[own]
    cfg = run_cfg("scaffold", **{"batch-size": 16})
    model, datas = make_model(), clients()
    rows = StackedClientStates(len(datas))
    states = [ContextState(RecordDict()) if store == "context" else StackedRowState(rows, c) for c in range(len(datas))]
    # the second round from c_i of the clients' own (the dc subtracts them)
    for alone, batched, _ in alone_and_batched(subclass, cfg, model, datas, states, received_for("scaffold", model)):
        for want, got in zip(alone, batched):
            for k in want.extra["scaffold.dc"].keys():
                torch.testing.assert_close(torch.from_numpy(got.extra["scaffold.dc"][k].numpy()),
                                           torch.from_numpy(want.extra["scaffold.dc"][k].numpy()),
                                           atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("store", ["context", "stacked"])
@pytest.mark.parametrize("variant", ["double-drift", "extra-group", "other-order"])
def test_a_feddc_subclass_with_its_own_saved_state_ends_client_by_client(variant, store) -> None:
    """A FedDC subclass whose ``saved_after_round`` stores another drift
    (twice FedDC's step), also a group it never reads back, or its groups
    in another order than ``saved_groups``: the batched end forms no state
    for it (FedDC's batched twin would store FedDC's), so its clients end
    one at a time and store and reply what they do alone, round after
    round; reading the state back checks what the solver reads, so the
    extra group or the order is its own business, not "another model's
    state" (rounds 2 and 3 read round 1's and 2's state)."""
    from collections import OrderedDict

    from fedaccel.clients.scaffold import FedDCSolver
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    class OwnSavedState(FedDCSolver):
        def saved_after_round(self, model, new_c):
            saved = super().saved_after_round(model, new_c)
            if variant == "double-drift":
                return {"c": saved["c"], "h": OrderedDict((k, 2 * v - self.h_i[k]) for k, v in saved["h"].items())}
            if variant == "extra-group":  # a diagnostic never read back
                return {**saved, "last": OrderedDict((k, p.detach().clone()) for k, p in model.named_parameters())}
            return {"h": saved["h"], "c": saved["c"]}

    cfg = run_cfg("feddc", **{"batch-size": 16, "feddc.alpha": 0.3})
    model, datas = make_model(), clients()
    rows = StackedClientStates(len(datas))
    states = [ContextState(RecordDict()) if store == "context" else StackedRowState(rows, c) for c in range(len(datas))]
    # rounds 2 and 3 train from the stored drift: a drift stored the wrong way changes their replies
    for alone, batched, _ in alone_and_batched(OwnSavedState, cfg, model, datas, states,
                                               received_for("feddc", model), rounds=(1, 2, 3)):
        for want, got in zip(alone, batched):
            assert not isinstance(want, BaseException) and not isinstance(got, BaseException), (want, got)
            for k in want.extra["scaffold.dc"].keys():
                torch.testing.assert_close(torch.from_numpy(got.extra["scaffold.dc"][k].numpy()),
                                           torch.from_numpy(want.extra["scaffold.dc"][k].numpy()),
                                           atol=ATOL, rtol=RTOL)
            assert_same_arrays(got, want)


@pytest.mark.parametrize("store", ["context", "stacked"])
def test_a_client_whose_douglas_rachford_state_is_damaged_fails_alone_in_a_batched_round(store) -> None:
    """A client whose saved state cannot be read gets its own error reply, as
    in its per-client round; the others of the cohort train and reply. In a
    ``context.state``: a record of the wrong size; in the fast runner's
    stacked store: a state of another layout than the name's (kept as its
    own tensors), so the cohort's states are read one by one."""
    import numpy as np

    from fedaccel.arrays import arrays_to_record, from_numpy
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
    from fedaccel.config import ConfigError

    cfg = run_cfg("fedcdr", **{"batch-size": 16})
    model, datas = make_model(), clients()
    stacked = StackedClientStates(len(datas))
    states = [ContextState(RecordDict()) if store == "context" else StackedRowState(stacked, c)
              for c in range(len(datas))]
    _dr_round_one(cfg, model, datas, states)
    if store == "context":
        states[2].record["fedaccel.v1.dr"] = arrays_to_record([("float32", from_numpy(np.zeros(3, np.float32)))])
        own, wanted = ContextState(copy.deepcopy(states[2].record)), "damaged"
    else:
        stacked.write(2, 1, "dr", {"w": torch.zeros(3)})
        own, wanted = states[2], "not this model's"
    with pytest.raises(ConfigError, match=wanted):
        new_solver(cfg, model).fit(copy.deepcopy(model), datas[2], config_for("fedcdr", 2), own,
                                   seeded_generator(cfg.seed, 2, 2, "train"))
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                      config=config_for("fedcdr", 2), state=state,
                      generator=seeded_generator(cfg.seed, 2, c, "train"))
            for c, (data, state) in enumerate(zip(datas, states))]
    results = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    assert isinstance(results[2], ConfigError) and wanted in str(results[2])
    assert all(not isinstance(r, BaseException) for c, r in enumerate(results) if c != 2)



@pytest.mark.parametrize("algo", ["fedpm", "localnewton"])
def test_second_order_rounds_begun_together_are_each_clients_begin_round(algo) -> None:
    """FedPM's and LocalNewton's ``cohort_begin_round`` sets on every solver
    what its own ``begin_round`` sets (the preconditioned layers, their
    parameters' positions, a fresh step count) and starts each client from
    the weights it received, the model loaded for none of them."""
    from fedaccel.clients.cohort import Opening

    cfg = run_cfg(algo, **{"batch-size": 16})
    model = make_model()
    received = [[t.detach().clone() + c for t in model.state_dict().values()] for c in range(3)]
    scratch = copy.deepcopy(model)
    solvers = [new_solver(cfg, model) for _ in received]
    slots = [list(scratch.state_dict()).index(n) for n, _ in scratch.named_parameters()]
    openings = [Opening(s, ContextState(RecordDict()), s.open_round(scratch, config_for(algo, 1),
                                                                     ContextState(RecordDict()), begin=False),
                        r, [r[i] for i in slots])
                for s, r in zip(solvers, received)]
    for s in solvers:  # left from an earlier round: begin must reset them
        s.step, s._end_matrices = 7, {"stale": torch.zeros(1)}
    before = [p.detach().clone() for p in scratch.parameters()]
    begun = solvers[0].cohort_begin_round(scratch, openings)
    assert all(torch.equal(p, q) for p, q in zip(scratch.parameters(), before))  # no model loaded
    want = new_solver(cfg, model)
    want.open_round(copy.deepcopy(model), config_for(algo, 1), ContextState(RecordDict()))
    names = [n for n, _ in scratch.named_parameters()]
    for s, start, r in zip(solvers, begun, received):
        assert list(s.layers) == list(want.layers) and s._layer_params == want._layer_params
        assert s.step == 0 and s._end_matrices is None and s._newton_preconditioner is None
        assert all(torch.equal(a, b) for a, b in zip(start, [r[list(scratch.state_dict()).index(n)] for n in names]))
        assert all(s.layers[k] is dict(scratch.named_modules())[k] for k in s.layers)


def test_a_batched_fedpm_run_does_not_depend_on_the_order_its_messages_come_in(tmp_path, monkeypatch) -> None:
    """Flower's sampling orders a round's messages at random, and a batched
    kernel may round a client's rows by their place in the batch (FedPM's
    batched Cholesky solves do, with two threads): the cohort trainer takes
    the clients in partition order, so a run is the same to the bit whether
    its messages come in one order or the reverse."""

    import numpy as np

    from fedaccel.local_grid import LocalGrid
    from fedaccel.local_run import default_run_config, fuse, run_local

    def run(name):
        config = fuse(default_run_config(), {
            "algo": "fedpm", "cohort-batching": "on", "num-server-rounds": 2, "clients-per-round": 20,
            "results-dir": str(tmp_path), "run-name": name})
        folder = run_local(config, 30, quiet=True)
        return dict(np.load(folder / "final_model.npz")), (folder / "metrics.jsonl").read_text()

    model, _ = run("as-sent")
    real = LocalGrid._deliver_cohort
    monkeypatch.setattr(LocalGrid, "_deliver_cohort", lambda self, ids: real(self, list(reversed(ids))))
    reversed_model, _ = run("reversed")
    assert all(np.array_equal(model[k], reversed_model[k]) for k in model)


@pytest.mark.parametrize("algo, changes", [("fedrkmgc", {"fedrkmgc.variant": "full"}),
                                           ("fedrkmgc", {"fedrkmgc.variant": "km"}),
                                           ("fedrkmgc", {"fedrkmgc.variant": "re"}),
                                           ("feddyn", {"feddyn.alpha": 0.3}),
                                           ("scaffold", {"weight-decay": 1e-3}),
                                           ("scaffold", {"momentum": 0.0, "scaffold.cv-update": "option-ii"}),
                                           ("scaffold", {"momentum": 0.0, "scaffold.cv-update": "option-ii",
                                                         "precision": "float64"})])
def test_state_formed_for_the_batch_is_each_clients_end_round_byte_for_byte(algo, changes, monkeypatch) -> None:
    """FedRKMGC's, FedDyn's and SCAFFOLD's batched begin (the received
    weights as anchor, no model loaded) and their new state formed from the
    stacked trained weights (``cohort_after_steps``: FedRKMGC's corrections,
    FedDyn's ``grad_prev``, SCAFFOLD's ``c_i`` and its reply's ``dc``) store,
    round after round, the state records their per-client ``begin_round``
    and ``end_round`` store, byte for byte, and reply the same weights and
    records; no client is loaded into the model."""
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState

    solver_class = type(get_algorithm(algo).solver(run_cfg(algo, **changes)))
    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9, **changes})
    model, datas = make_model(), clients()
    if cfg.precision == "float64":
        model = model.double()
        datas = [TrainData(x=d.x.double(), y=d.y) for d in datas]

    def rounds(states, batched, max_clients=None):
        loads = []
        real = cohort_module._load_weights
        monkeypatch.setattr(cohort_module, "_load_weights", lambda *a: loads.append(1) or real(*a))
        if not batched:
            monkeypatch.setattr(solver_class, "cohort_after_steps", lambda self, *a, **k: None)
            monkeypatch.setattr(solver_class, "cohort_begin_round", lambda self, *a, **k: None)
        replies = []
        for r in (1, 2, 3):
            jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                              config=config_for(algo, r), state=states[c],
                              generator=seeded_generator(cfg.seed, r, c, "train"),
                              received=received_for(algo, model, seed=c))  # SCAFFOLD: each client its own c
                    for c, data in enumerate(datas) if r > 1 or c < 5]  # clients 5, 6 start in round 2
            replies.append([(res.arrays, res.extra) for res in fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size,
                                                                          max_clients=max_clients)])
        monkeypatch.undo()
        return replies, len(loads)

    formed_states = [ContextState(RecordDict()) for _ in datas]
    loaded_states = [ContextState(RecordDict()) for _ in datas]
    formed, loads_formed = rounds(formed_states, True)
    loaded, loads_loaded = rounds(loaded_states, False)
    # the fast runner's stacked store (a batched begin reads the cohort's rows in one gather; SCAFFOLD
    # keeps c_i, c - c_i and grad_sum as stacks), in chunks of 3 clients (rows of the stacks): the same
    store = StackedClientStates(len(datas) + 1)
    stacked_states = [StackedRowState(store, p) for p in (6, 0, 4, 1, 7, 2, 3)]
    stacked, _ = rounds(stacked_states, True, max_clients=3)
    for x, y in zip(stacked, loaded):
        assert [(list(a.keys()), list(e)) for a, e in x] == [(list(a.keys()), list(e)) for a, e in y]
        assert all(same_array(a[k], b[k]) for (a, _), (b, _) in zip(x, y) for k in a.keys())
        assert all(e[n][k] == f[n][k] for (_, e), (_, f) in zip(x, y) for n in e for k in e[n].keys())
    assert [store.record_dict(s.pid) for s in stacked_states] == [s.record for s in loaded_states]
    assert loads_formed == 0 and loads_loaded == 5 + 2 * len(datas)
    for round_formed, round_loaded in zip(formed, loaded):
        for (x, x_extra), (y, y_extra) in zip(round_formed, round_loaded):
            assert list(x.keys()) == list(y.keys()) and all(same_array(x[k], y[k]) for k in x.keys())
            assert list(x_extra) == list(y_extra) and list(x_extra) == (["scaffold.dc"] if algo == "scaffold" else [])
            for name in x_extra:  # SCAFFOLD's dc: the same Arrays, byte for byte
                assert list(x_extra[name].keys()) == list(y_extra[name].keys())
                assert all(x_extra[name][k] == y_extra[name][k] for k in x_extra[name].keys())
    for a, b in zip(formed_states, loaded_states):
        assert list(a.record.keys()) == list(b.record.keys())
        assert all(a.record[k] == b.record[k] for k in a.record.keys())
    assert any(k.startswith(f"fedaccel.v3.{algo}") for k in formed_states[6].record.keys())


@pytest.mark.parametrize("store", ["context", "disk", "stacked"])
@pytest.mark.parametrize("damage", ["float64", "other-shapes"])
@pytest.mark.parametrize("algo", ["feddyn", "fedrkmgc", "scaffold", "feddc"])
def test_a_client_whose_saved_state_is_another_models_fails_alone_on_both_paths(algo, damage, store,
                                                                                 tmp_path) -> None:
    """A client whose committed state was written by another model (other
    shapes) or by the same model in float64 (a ``precision='float64'`` run's
    state-dir) gets one ConfigError, in its own round and in a batched one;
    the others train as one client at a time trains them (the float64 rows
    used to promote the whole cohort's stacks, failing every client, and
    the per-client round trained on them)."""
    from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
    from fedaccel.clients.state import DiskState, flat_groups
    from fedaccel.config import ConfigError

    cfg = run_cfg(algo, **{"batch-size": 16, "momentum": 0.9})
    model, datas = make_model(), clients([20, 5, 16, 33])
    other = make_model().double() if damage == "float64" else make_model(shape=(7,))
    solver = new_solver(cfg, model)
    saved = flat_groups({g: {k: p.detach() for k, p in other.named_parameters()} for g in solver.saved_groups})

    def states(path: str) -> list:
        stacked = StackedClientStates(len(datas))
        made = [ContextState(RecordDict()) if store == "context" else DiskState(tmp_path / f"{path}-{c}")
                if store == "disk" else StackedRowState(stacked, c) for c in range(len(datas))]
        made[2].begin(1)  # committed as round 1's
        made[2].put(solver.state_name, saved)
        made[2].seal()
        made[2].resolve(1)
        return made

    def config(c: int) -> dict:
        values = config_for(algo, 2)
        values["accepted-round"] = 1 if c == 2 else 0  # client 2 alone trained (and was applied) in round 1
        return values

    alone_states = states("alone")
    alone = []
    for c, data in enumerate(datas):
        try:
            alone.append(new_solver(cfg, model).fit(copy.deepcopy(model), data, config(c), alone_states[c],
                                                    seeded_generator(cfg.seed, 2, c, "train"),
                                                    received_for(algo, model)))
        except ConfigError as err:
            alone.append(err)
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model), config=config(c),
                      state=state, generator=seeded_generator(cfg.seed, 2, c, "train"),
                      received=received_for(algo, model))
            for c, (data, state) in enumerate(zip(datas, states("batched")))]
    batched = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    for results in (alone, batched):
        assert isinstance(results[2], ConfigError) and "not this model's" in str(results[2]), results[2]
    for c in (0, 1, 3):
        assert not isinstance(batched[c], BaseException), batched[c]
        assert_same_arrays(batched[c], alone[c])


@pytest.mark.parametrize("algo", ["fedpm", "localnewton"])
def test_a_second_order_client_with_nan_data_is_told_so_alone(algo) -> None:
    """A NaN in one client's data makes its FOOF matrix non-finite: that
    client fails alone on both paths with a line that says so (not the
    advice to raise the damping, which no damping can mend), and the
    other clients train as they do alone."""
    from fedaccel.config import ConfigError

    cfg = run_cfg(algo, **{"batch-size": 16, f"{algo}.damping": 1e6})
    model, datas = make_model(), clients([20, 17, 16])
    datas[1].x[2, 3] = float("nan")
    for results in (per_client_results(cfg, model, datas), fit_cohort(copy.deepcopy(model), cohort_jobs(cfg, model, datas),
                                                                       cfg.batch_size)):
        assert isinstance(results[1], ConfigError), results[1]
        assert "NaN or inf entries" in str(results[1]) and "increase" not in str(results[1])
        assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)


def per_client_results(cfg, model, datas) -> list:
    """Each client's first-round result alone (its error where it fails)."""
    out = []
    for c, data in enumerate(datas):
        try:
            out.append(new_solver(cfg, model).fit(copy.deepcopy(model), data, config_for(cfg.algo, 1),
                                                  ContextState(RecordDict()), seeded_generator(cfg.seed, 1, c, "train")))
        except ValueError as err:
            out.append(err)
    return out


def cohort_jobs(cfg, model, datas) -> list[CohortJob]:
    return [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                      config=config_for(cfg.algo, 1), state=ContextState(RecordDict()),
                      generator=seeded_generator(cfg.seed, 1, c, "train"))
            for c, data in enumerate(datas)]


@pytest.mark.parametrize("algo", ["fedpm", "localnewton"])
def test_a_second_order_client_without_samples_fails_alone_in_a_batched_round(algo) -> None:
    """A client with no samples has no FOOF rows: its own round fails with
    the FOOF pass's error (a user error: that client's one-line reply, not a
    traceback), and so does its place in a batched round, whose
    other clients train as they train one at a time (the batched pass over
    all of them used to raise for the whole cohort)."""
    from fedaccel.config import ConfigError

    cfg = run_cfg(algo, **{"batch-size": 16})
    model, datas = make_model(), clients([20, 0, 16, 1])
    alone = []
    for c, data in enumerate(datas):
        try:
            alone.append(new_solver(cfg, model).fit(copy.deepcopy(model), data, config_for(algo, 1),
                                                    ContextState(RecordDict()), seeded_generator(cfg.seed, 1, c, "train")))
        except ValueError as err:
            alone.append(err)
    jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                      config=config_for(algo, 1), state=ContextState(RecordDict()),
                      generator=seeded_generator(cfg.seed, 1, c, "train"))
            for c, data in enumerate(datas)]
    batched = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
    for results in (alone, batched):
        assert isinstance(results[1], ConfigError) and "at least one input row" in str(results[1]), results[1]
    for c in (0, 2, 3):
        assert not isinstance(batched[c], BaseException), batched[c]
        assert batched[c].metrics["local-steps"] == alone[c].metrics["local-steps"]
        assert_same_arrays(batched[c], alone[c])


STRAGGLER_LRS, STRAGGLER_EPOCHS = (0.1, 0.05, 0.1), (2, 2, 1)  # client c: lr and epochs of c % 3


@pytest.mark.parametrize("algo, changes", [case[1:] for case in BATCHABLE], ids=[case[0] for case in BATCHABLE])
def test_a_float64_batched_round_with_stragglers_equals_the_per_client_round_tightly(algo: str, changes: dict) -> None:
    """Every batched algorithm in float64, its clients with different
    learning rates and epoch counts (stragglers: the trainer batches each
    (lr, epochs) group apart), two rounds so that round 1's state is read:
    weights, metrics, extra records and saved state equal the per-client
    rounds to float64 rounding (1e-12, a million times tighter than the
    float32 tolerance, which could hide a wrong term of the rule)."""
    cfg = run_cfg(algo, **{"batch-size": 16, "precision": "float64", **changes})
    model = make_model().double()
    datas = [TrainData(x=d.x.double(), y=d.y) for d in clients()]
    states = {path: [ContextState(RecordDict()) for _ in datas] for path in ("alone", "batched")}

    def config(c: int, server_round: int) -> dict:
        values = train_config_record(server_round, STRAGGLER_LRS[c % 3], STRAGGLER_EPOCHS[c % 3], EXTRA.get(algo))
        values["accepted-round"] = server_round - 1
        return values

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        assert a.dtype == b.dtype == torch.float64, what
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)

    for server_round in (1, 2):
        alone = [new_solver(cfg, model).fit(copy.deepcopy(model), data, config(c, server_round), states["alone"][c],
                                            seeded_generator(cfg.seed, server_round, c, "train"),
                                            received_for(algo, model))
                 for c, data in enumerate(datas)]
        jobs = [CohortJob(solver=new_solver(cfg, model), data=data, arrays=state_to_arrays(model),
                          config=config(c, server_round), state=states["batched"][c],
                          generator=seeded_generator(cfg.seed, server_round, c, "train"),
                          received=received_for(algo, model))
                for c, data in enumerate(datas)]
        batched = fit_cohort(copy.deepcopy(model), jobs, cfg.batch_size)
        for c, (a, b) in enumerate(zip(alone, batched)):
            assert not isinstance(b, BaseException), b
            assert a.metrics["local-steps"] == b.metrics["local-steps"] and list(a.arrays) == list(b.arrays)
            assert a.metrics["train-loss"] == pytest.approx(b.metrics["train-loss"], rel=1e-12)
            for k in a.arrays.keys():
                close(torch.from_numpy(a.arrays[k].numpy()), torch.from_numpy(b.arrays[k].numpy()), f"{c} {k}")
            assert list(a.extra) == list(b.extra)
            for name in a.extra:
                for k in a.extra[name].keys():
                    x, y = a.extra[name][k].numpy(), b.extra[name][k].numpy()
                    if x.dtype.kind == "f":
                        close(torch.from_numpy(x), torch.from_numpy(y), f"{c} {name}.{k}")
                    else:
                        assert (x == y).all(), f"{c} {name}.{k}"
        with torch.no_grad():  # the next round starts from the replies' mean, as a server's would
            for i, p in enumerate(model.parameters()):
                mean = torch.stack([torch.from_numpy(list(r.arrays.values())[i].numpy()) for r in alone]).mean(0)
                p.add_(mean) if algo in STATE_GROUP else p.copy_(mean)
    group, stateful = STATE_GROUP.get(algo, algo), get_algorithm(algo).solver.state_copies > 0
    for c, (a, b) in enumerate(zip(states["alone"], states["batched"])):
        assert a.versions() == b.versions()
        kept_a, kept_b = a.get(group, torch.device("cpu")), b.get(group, torch.device("cpu"))
        assert (kept_a is not None) == (kept_b is not None) == stateful
        for key in kept_a or {}:
            close(kept_a[key], kept_b[key], f"state {c} {key}")


@pytest.mark.parametrize("data", ["concatenated", "pooled", "gathered-each-step"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_sample_of_one_client_stays_out_of_the_others_padded_batches(bad: float, data: str,
                                                                                   monkeypatch) -> None:
    """An epoch's last batch is padded to the batch size, its padding
    weighted zero; 0 * NaN is NaN, so a padded slot must read the client's
    own data: client 0's first sample (where padding used to point) holds a
    non-finite value, and client 1, whose last batch is padded, trains and
    reports its loss as it does alone. The same with the clients' rows of
    one sample pool (the fast runner's data, where row 0 belongs to a
    client outside the cohort) and with each step's batch gathered on its
    own."""
    cfg = run_cfg("fedavg", **{"batch-size": 16})
    model = make_model()
    if data == "pooled":  # pool rows 0..2: a client not in the round, its row 0 the bad one
        datas = pooled(clients([40, 20]), lead=3)
        datas[0].pool.x[0, 0] = bad
    else:
        datas = clients([40, 20])
        datas[0].x[0, 0] = bad
    if data == "gathered-each-step":
        monkeypatch.setattr(cohort_module, "GATHER_ONCE_BYTES", 0)
    alone = per_client_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    batched = cohort_round(cfg, model, datas, [ContextState(RecordDict()) for _ in datas], 1)
    assert all(torch.isfinite(w).all() for w in batched[0][1])
    assert batched[1][1]["train-loss"] == pytest.approx(alone[1][1]["train-loss"], rel=1e-5)
    for p, q in zip(alone[0][1], batched[0][1]):
        torch.testing.assert_close(q, p, atol=ATOL, rtol=RTOL)
