"""End-to-end runs of every algorithm through the fast local runner.

The runner calls the project's real ServerApp and ClientApp objects, so these
tests exercise the whole path: config, client discovery, data, models, local
solvers, Flower's strategies and the results files.
"""

from __future__ import annotations

import json

import pytest
import torch

from fedaccel.local_run import default_run_config, fuse, main, run_local
from fedaccel.registry import algorithm_names

SMALL = {
    "num-server-rounds": 4,
    "clients-per-round": 3,
    "local-epochs": 1,
    "accl-every": 2,
    "target-accuracy": 0.3,
    "synthetic.max-samples": 120,
}
METRIC_KEYS = {"round", "accg", "loss", "accl", "bytes_up", "bytes_down", "seconds"}
SUMMARY_KEYS = {"final_accg", "best_accg", "mean_last_20_accg", "ema_accg", "rounds_to_target"}


def small_config(tmp_path, **overrides):
    cfg = fuse(default_run_config(), {**SMALL, "results-dir": str(tmp_path), **overrides})
    cfg.setdefault("run-name", "")
    return cfg


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo", algorithm_names())
def test_every_algorithm_runs_and_writes_results(tmp_path, algo):
    run_dir = run_local(small_config(tmp_path, algo=algo, **{"run-name": algo}),
                        num_clients=6, quiet=True)
    assert run_dir == (tmp_path / algo).resolve()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == algo and config["resolved"]["num-clients"] == 6
    # where it ran: what the same seed needs to give the same bits (docs/measurements.md)
    assert config["resolved"]["environment"]["torch-threads"] == config["resolved"]["torch-threads"]
    assert config["resolved"]["environment"]["cpu-capability"]
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # The model keeps its dtype: every round moves the same number of bytes.
    assert len({(r["bytes_up"], r["bytes_down"]) for r in rows}) == 1
    for row in rows:
        assert METRIC_KEYS <= set(row)
        assert 0.0 <= row["accg"] <= 1.0
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
    # ACCL only on rounds 2 and 4 (accl-every=2; the last round always).
    assert [r["accl"] is not None for r in rows] == [False, True, False, True]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["final_accg"] == rows[-1]["accg"]
    assert (run_dir / "curves.png").stat().st_size > 1000


def test_learning_happens(tmp_path):
    """FedAvg on Synthetic-(1,1) clearly beats the initial model within a few rounds."""
    run_dir = run_local(small_config(tmp_path, **{"num-server-rounds": 8, "local-epochs": 2}),
                        num_clients=6, quiet=True)
    rows = read_metrics(run_dir)
    assert rows[-1]["accg"] > 0.5
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_run_local_leaves_the_callers_flower_log_level_alone(tmp_path):
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    before = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.DEBUG)
    try:
        run_local(small_config(tmp_path, **{"num-server-rounds": 1}), num_clients=4, quiet=True)
        assert FLOWER_LOGGER.level == logging.DEBUG
    finally:
        FLOWER_LOGGER.setLevel(before)


def test_same_seed_same_results_different_seed_different(tmp_path):
    def run(seed, name):
        run_dir = run_local(small_config(tmp_path, seed=seed, **{"run-name": name}),
                            num_clients=6, quiet=True)
        return [{k: v for k, v in row.items() if k != "seconds"} for row in read_metrics(run_dir)]

    first, again, other = run(1, "a"), run(1, "b"), run(2, "c")
    assert first == again  # bit-identical, including losses
    assert first != other


def test_bytes_match_model_size_and_cohort(tmp_path):
    run_dir = run_local(small_config(tmp_path, **{"run-name": "bytes"}), num_clients=6, quiet=True)
    rows = read_metrics(run_dir)
    # MLP 60-32-10 float32: 2282 parameters, 4 tensors each with an .npy header.
    per_model = rows[0]["bytes_down"] / 3
    assert 2282 * 4 < per_model < 2282 * 4 + 4 * 200
    assert all(r["bytes_up"] == r["bytes_down"] for r in rows)


def test_fraction_of_clients_per_round(tmp_path):
    run_dir = run_local(small_config(tmp_path, **{"clients-per-round": 0.5, "run-name": "frac"}),
                        num_clients=6, quiet=True)
    assert all(r["clients"] == 3 for r in read_metrics(run_dir))


def test_user_errors_are_one_line(tmp_path, capsys):
    code = main([f"results-dir='{tmp_path}'", "algo='nope'", "--num-clients", "4", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "algo='nope'" in err and "fedavg" in err


@pytest.mark.parametrize("tokens,wanted", [
    (["algo='fedadam'", "fedadam.variant='adamw'"], "fedadam.variant='adamw': allowed: paper"),
    (["algo='fedcdr'", "gc.mode='global'"], "gc.mode='global': is refused with algo='fedcdr'"),
    (["gc.mode='local'", "gc.vectors='median'"], "gc.vectors='median'"),
    (["gc.mode='local'", "gc.weight-decay='both'"], "gc.weight-decay='both'"),
    (["algo='gcfed'", "gc.global-scope='every'"], "gc.global-scope='every': allowed: split, all"),
    (["gc.global-scope='all'"], "gc.global-scope='all': 'all' widens the Global GC of gc.mode='hybrid'"),
    (["algo='fedrkmgc'", "fedrkmgc.rho=0"], "fedrkmgc.rho=0"),
    (["algo='fedcdr'", "fedcdr.alpha=2.5"], "fedcdr.alpha=2.5"),
    (["clip-norm=-1.0"], "clip-norm=-1.0"),
    (["algo='fedpm'", "model='logreg'", "fedpm.mode='exact'", "clip-norm=1.0", "clients-per-round=2"],
     "clip-norm=1.0"),
])
def test_new_options_refuse_bad_values_in_one_line(tmp_path, capsys, tokens, wanted):
    """The options added for trustworthy results, through the real command."""
    code = main([f"results-dir='{tmp_path}'", *tokens, "--num-clients", "4", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert wanted in err


def test_more_clients_per_round_than_clients(tmp_path, capsys):
    code = main([f"results-dir='{tmp_path}'", "clients-per-round=10", "--num-clients", "4", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "clients-per-round" in err and "4 clients" in err


def test_more_clients_than_samples(tmp_path, capsys):
    code = main([f"results-dir='{tmp_path}'", "dataset='digits'", "clients-per-round=2",
                 "--num-clients", "2000", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and len(err.splitlines()) == 1  # 3: the data cannot serve the run
    assert "2000" in err


def test_unknown_key_rejected(tmp_path, capsys):
    code = main([f"results-dir='{tmp_path}'", "fedprox.muu=0.1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "fedprox.muu (did you mean 'fedprox.mu'?)" in err


@pytest.mark.parametrize("batching", ["off", "auto"])
def test_client_failure_is_reported_not_hidden(tmp_path, monkeypatch, batching):
    """A client that raises gives an error reply; a round where all fail stops
    the run (training one client after another, or the round as one batch)."""
    import fedaccel.clients.base
    import fedaccel.clients.cohort

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    if batching == "off":
        monkeypatch.setattr(fedaccel.clients.base.LocalSolver, "run_epochs", broken)
    else:
        monkeypatch.setattr(fedaccel.clients.cohort, "train_stacked", broken)
    from fedaccel.errors import RoundFailedError

    with pytest.raises(RoundFailedError, match="all 3 sampled clients failed.*disk on fire"):
        run_local(small_config(tmp_path, **{"cohort-batching": batching}), num_clients=6, quiet=True)


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_devices_with_their_own_data_files(tmp_path, precision):
    """node config data-path: each client trains on its own .npz (here
    exported from the rehearsal partitions) and the run completes; with
    precision='float64' the devices read their files as float64 and the
    global model stays float64."""
    import numpy as np
    from flwr.app import Context, RecordDict

    from fedaccel.apps.client_app import app as client_app
    from fedaccel.apps.server_app import app as server_app
    from fedaccel.data import DataConfig
    from fedaccel.data.device_file import export_partition
    from fedaccel.local_grid import LocalGrid

    cfg = small_config(tmp_path, **{"run-name": "files", "accl-every": 0, "precision": precision})
    data_cfg = DataConfig(dataset="synthetic", num_clients=4, synthetic_max_samples=120, precision=precision)
    grid = LocalGrid(client_app, cfg, num_clients=4)
    for ctx in grid.contexts.values():
        pid = ctx.node_config["partition-id"]
        ctx.node_config["data-path"] = str(export_partition(data_cfg, pid, tmp_path / f"d{pid}.npz"))
    grid.serve(server_app, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                             run_config=cfg))
    from_files = read_metrics(tmp_path / "files")
    assert len(from_files) == 4 and all(0 <= r["accg"] <= 1 for r in from_files)
    final = np.load(tmp_path / "files" / "final_model.npz")
    assert {str(final[k].dtype) for k in final.files} == {precision}


def test_bad_device_file_is_a_clear_client_error(tmp_path):
    import numpy as np

    from fedaccel.data import DataError
    from fedaccel.data.device_file import load_device_file

    np.savez(tmp_path / "bad.npz", x=np.zeros((5, 3), np.float32), y=np.zeros(5, np.int64))
    with pytest.raises(DataError, match=r"x has shape \(5, 3\); dataset='synthetic' needs \(N, 60\)"):
        load_device_file(str(tmp_path / "bad.npz"), "synthetic", 0.2, 0)
    with pytest.raises(DataError, match="no such file"):
        load_device_file(str(tmp_path / "missing.npz"), "synthetic", 0.2, 0)
    np.savez(tmp_path / "labels.npz", x=np.zeros((5, 60), np.float32), y=np.full(5, 12))
    with pytest.raises(DataError, match=r"labels in \[0, 10\)"):
        load_device_file(str(tmp_path / "labels.npz"), "synthetic", 0.2, 0)


def test_fast_runner_prepares_every_clients_data_before_round_one(tmp_path, monkeypatch):
    """Client tensors are built before the ServerApp starts (as the bare loop of
    bench/overhead.py does), so no round pays for a client's first data prep."""
    import fedaccel.apps.client_app as client_app
    import fedaccel.apps.server_app as server_app

    built_before_start = []

    def server_main(grid, context):
        built_before_start.append(client_app._runtime.cache_info().currsize)
        return original(grid, context)

    original = server_app.app
    monkeypatch.setattr(server_app, "app", server_main)
    client_app._runtime.cache_clear()
    run_local(small_config(tmp_path), num_clients=5, quiet=True)
    assert built_before_start == [5]


def fresh_clients(tmp_path, num_clients: int, **overrides):
    """The fast runner's clients of a small run in this process, with the
    client app's caches emptied first: ``(contexts, shared)``, ``shared``
    the run's :class:`fedaccel.apps.client_app._Shared` (dataset, pool)."""
    import fedaccel.apps.client_app as client_app
    from fedaccel.local_grid import LocalGrid

    client_app._runtime.cache_clear()
    client_app._shared.cache_clear()
    grid = LocalGrid(client_app.app, small_config(tmp_path, **overrides), num_clients=num_clients)
    contexts = list(grid.contexts.values())
    return contexts, client_app._shared(client_app._freeze(contexts[0].run_config), num_clients, "")


def test_the_fast_runners_clients_train_on_rows_of_one_pool_with_their_own_values(tmp_path):
    """prepare_clients puts every client's training data into one
    SamplePool (the cohort trainer gathers from it without concatenating):
    each client's tensors are its rows, with the values the dataset gives
    that client, and its local test split is its own."""
    import fedaccel.apps.client_app as client_app

    contexts, shared = fresh_clients(tmp_path, 5)
    client_app.prepare_clients(contexts)
    runtimes = [client_app.client_runtime(context) for context in contexts]
    pool = runtimes[0].train.pool
    assert pool is not None and all(rt.train.pool is pool for rt in runtimes)
    dataset = shared.dataset
    covered = 0
    for rt in runtimes:
        own = dataset.client(rt.partition_id)
        start, n = rt.train.pool_start, rt.train.num_examples
        assert torch.equal(pool.x[start:start + n], torch.from_numpy(own.x_train))
        assert torch.equal(rt.train.x, torch.from_numpy(own.x_train)) and torch.equal(rt.train.y, torch.from_numpy(own.y_train))
        assert rt.train.x.data_ptr() == pool.x[start].data_ptr()  # a view, not a copy
        assert torch.equal(rt.test_x, torch.from_numpy(own.x_test))
        covered += n
    assert covered == len(pool.y)
    assert all(x_test is None and y_test is None for _, x_test, y_test in shared.pooled.values())  # the runtimes hold them
    client_app._runtime.cache_clear()  # dropped: a runtime built again is still the pool's rows, with its test split
    again = client_app.client_runtime(contexts[2])
    own = dataset.client(again.partition_id)
    assert again.train.pool is pool and torch.equal(again.test_x, torch.from_numpy(own.x_test))


def test_a_pool_that_fails_part_way_is_dropped_and_the_clients_are_prepared_without_it(tmp_path, monkeypatch):
    """Pooling is an optimisation: when a client's data fails while the pool
    fills (here once, as a flaky read would), no client keeps rows of the
    half-filled pool (its unfilled rows would stay allocated), and
    prepare_clients still builds every client's runtime, with its own
    tensors and its own values."""
    import fedaccel.apps.client_app as client_app

    contexts, shared = fresh_clients(tmp_path, 6)
    real_client, failed = shared.dataset.client, []

    def client_failing_once(i):
        if i == 3 and not failed:
            failed.append(i)
            raise OSError("a flaky read")
        return real_client(i)

    monkeypatch.setattr(shared.dataset, "client", client_failing_once)
    client_app.prepare_clients(contexts)
    assert failed and not shared.pooled
    assert client_app._runtime.cache_info().currsize == 6  # every client prepared all the same
    for context in contexts:
        rt = client_app.client_runtime(context)
        own = real_client(rt.partition_id)
        assert rt.train.pool is None and torch.equal(rt.train.x, torch.from_numpy(own.x_train))


def test_the_pool_is_filled_one_client_at_a_time(tmp_path):
    """Building the pool holds about one client's arrays at a time beside it
    (NumPy's allocations, traced; the pool itself is torch's): concatenated,
    every client's arrays and a NumPy copy of them all lived at once."""
    import tracemalloc

    import fedaccel.apps.client_app as client_app

    contexts, shared = fresh_clients(tmp_path, 20, **{"synthetic.max-samples": 4000})  # the dataset, before tracing
    tracemalloc.start()
    try:
        client_app.pool_training_data(contexts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    pool = shared.pooled[0][0].pool
    pool_bytes = pool.x.numel() * pool.x.element_size() + pool.y.numel() * pool.y.element_size()
    largest = max(sum(a.nbytes for a in vars(shared.dataset.client(i)).values()) for i in range(20))
    # measured: 1.25 times the largest client (46 % of the pool here, a power-law federation), 0.58 times the
    # pool; concatenated, 4.9 and 2.3 times
    assert peak < 2 * largest and peak < pool_bytes, (peak, largest, pool_bytes)
