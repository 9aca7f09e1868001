"""Per-client state between rounds: the two stores and their use in real runs.

The store unit tests use :class:`fedaccel.clients.state.ContextState` and
:class:`fedaccel.clients.state.DiskState` directly; the run tests drive FedCDR through
the fast runner (``run_local``) or through a :class:`LocalGrid` built here so
the clients' stored tensors can be read after the run.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

import fedaccel.clients.state as state_mod
from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
from fedaccel.clients.state import (
    AUTO_DISK_BYTES,
    ContextState,
    DiskState,
    choose_backend,
    context_client_state,
    open_client_state,
    state_run_dir,
)
from fedaccel.local_run import default_run_config, fuse, run_local

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
CPU = torch.device("cpu")


def tensors() -> OrderedDict[str, torch.Tensor]:
    return OrderedDict([
        ("fc.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7),
        ("fc.bias", torch.tensor([-1.5, 2.25], dtype=torch.float32)),
        ("y.emb", torch.tensor([[1e-30, 3.0]], dtype=torch.float64)),
        ("steps", torch.tensor(5, dtype=torch.int64)),  # a 0-d buffer
    ])


def stores(tmp_path: Path):
    return {"context": ContextState(RecordDict()), "disk": DiskState(tmp_path / "client-0"),
            "stacked": StackedRowState(StackedClientStates(3), 2)}


# --------------------------------------------------------------------------- #
# the stores
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_round_trip_on_requested_device(tmp_path, kind, device):
    store = stores(tmp_path)[kind]
    src = tensors()
    store.put("dr", src)
    got = store.get("dr", device)
    assert list(got) == list(src)  # names and their order
    for name, t in src.items():
        assert got[name].device.type == device.type
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].cpu(), t)


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_missing_name_is_none(tmp_path, kind):
    store = stores(tmp_path)[kind]
    assert store.get("dr", CPU) is None
    store.put("other", tensors())
    assert store.get("dr", CPU) is None
    assert store.get("other", CPU) is not None


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_put_copies_and_get_returns_fresh_tensors(tmp_path, kind):
    store = stores(tmp_path)[kind]
    src = tensors()
    store.put("dr", src)
    for t in src.values():
        t.add_(100)  # later edits of the source must not leak in
    got = store.get("dr", CPU)
    for name, t in tensors().items():
        assert torch.equal(got[name], t)
    got["fc.bias"].zero_()  # nor edits of what get returned
    assert torch.equal(store.get("dr", CPU)["fc.bias"], tensors()["fc.bias"])


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_put_overwrites(tmp_path, kind):
    store = stores(tmp_path)[kind]
    store.put("dr", tensors())
    store.put("dr", {"only": torch.ones(3)})
    got = store.get("dr", CPU)
    assert list(got) == ["only"] and torch.equal(got["only"], torch.ones(3))


def test_put_accepts_tensors_that_require_grad(tmp_path):
    w = torch.nn.Parameter(torch.ones(2))
    for store in stores(tmp_path).values():
        store.put("p", {"w": w})
        assert torch.equal(store.get("p", CPU)["w"], torch.ones(2))


def test_disk_state_one_npz_per_name(tmp_path):
    folder = tmp_path / "run-1" / "client-3"
    store = DiskState(folder)
    assert not folder.exists()  # nothing is created before the first put
    store.put("dr", tensors())
    store.put("scaffold", {"c": torch.zeros(4)})
    store.put("dr", tensors())  # rewriting leaves no temporary file behind
    # outside a round, puts overwrite the latest version (0: nothing committed yet)
    assert sorted(p.name for p in (folder / "v0").iterdir()) == ["dr.npz", "scaffold.npz"]
    with np.load(folder / "v0" / "dr.npz") as data:
        assert sorted(data.files) == sorted(tensors())
        np.testing.assert_array_equal(data["fc.bias"], [-1.5, 2.25])


def test_context_state_lives_in_the_record(tmp_path):
    record = RecordDict()
    ContextState(record).put("dr", tensors())
    assert "fedaccel.v0.dr" in record.array_records
    # packed: one flat Array per dtype, in first-seen order (Flower's cost is per Array)
    packed = record.array_records["fedaccel.v0.dr"]
    assert list(packed.keys()) == ["float32", "float64", "int64"]
    assert [packed[d].shape for d in packed] == [(8,), (2,), (1,)]
    # a second view of the same RecordDict sees it (the Context is what persists)
    assert torch.equal(ContextState(record).get("dr", CPU)["fc.bias"], tensors()["fc.bias"])


def test_open_client_state_paths(tmp_path):
    record = RecordDict()
    disk = open_client_state("disk", str(tmp_path), 42, 7, record)
    assert isinstance(disk, DiskState)
    assert disk.folder == tmp_path / "run-42" / "client-7"
    assert state_run_dir(str(tmp_path), 42) == tmp_path / "run-42"
    ctx = open_client_state("context", str(tmp_path), 42, 7, record)
    assert isinstance(ctx, ContextState) and ctx.record is record


def test_state_dir_defaults_to_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDACCEL_STATE_DIR", str(tmp_path / "s"))
    assert state_run_dir("", 9) == tmp_path / "s" / "run-9"


# --------------------------------------------------------------------------- #
# choose_backend
# --------------------------------------------------------------------------- #
def test_choose_backend_auto_threshold():
    """Two versions per client count (committed + pending, VersionedState)."""
    per_client = 3 * 407_000
    limit_clients = AUTO_DISK_BYTES // (2 * per_client)
    assert choose_backend("auto", limit_clients, per_client) == "context"
    assert choose_backend("auto", limit_clients + 1, per_client) == "disk"
    assert choose_backend("auto", 1, AUTO_DISK_BYTES // 2) == "context"  # exactly at the limit
    assert choose_backend("auto", 1, AUTO_DISK_BYTES // 2 + 1) == "disk"
    assert choose_backend("auto", 10_000, 0) == "context"  # stateless solvers


@pytest.mark.parametrize("mode", ["context", "disk"])
def test_choose_backend_explicit_modes_pass_through(mode):
    assert choose_backend(mode, 1, 0) == mode
    assert choose_backend(mode, 10**9, 10**9) == mode


# --------------------------------------------------------------------------- #
# state across rounds in real runs
# --------------------------------------------------------------------------- #
SMALL = {
    "algo": "fedcdr",
    "synthetic.max-samples": 60,
    "clients-per-round": 3,
    "local-epochs": 1,
    "num-server-rounds": 4,
    "accl-every": 2,
}


def small_config(tmp_path: Path, name: str, **overrides) -> dict:
    return fuse(default_run_config(), {**SMALL, "results-dir": str(tmp_path / "results"),
                                       "run-name": name, **overrides})


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def run_on_grid(run_config: dict, num_clients: int):
    """Run the real ServerApp/ClientApp on a LocalGrid we keep (run_local does
    the same, then deletes the disk state)."""
    from fedaccel.apps.client_app import app as client_app
    from fedaccel.apps.server_app import QUIET, app as server_app
    from fedaccel.local_grid import LocalGrid

    grid = LocalGrid(client_app, run_config, num_clients, seed=int(run_config["seed"]))
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={QUIET: True}, state=RecordDict(),
                      run_config=run_config)
    grid.serve(server_app, context)
    return grid


def partition_of(context: Context) -> int:
    return int(context.node_config["partition-id"])


def test_run_local_context_and_disk_give_identical_runs(tmp_path, monkeypatch):
    puts: list[Path] = []
    real_write = DiskState._write  # put and put_flat write through it

    def spy(self, version, name, values):
        puts.append(self.folder)
        real_write(self, version, name, values)

    monkeypatch.setattr(DiskState, "_write", spy)
    state_dir = tmp_path / "state"
    ctx_dir = run_local(small_config(tmp_path, "ctx", **{"client-state": "context"}),
                        num_clients=6, quiet=True)
    assert puts == []  # context mode never touches the disk
    disk_dir = run_local(small_config(tmp_path, "disk", **{"client-state": "disk",
                                                           "state-dir": str(state_dir)}),
                         num_clients=6, quiet=True)
    # 4 rounds x 3 clients, each writes its state once, under state-dir/run-<id>/client-<pid>
    assert len(puts) == 12
    assert {p.parent.parent for p in puts} == {state_dir}
    assert {p.name for p in puts} == {f"client-{i}" for i in range(6)}
    # the same seed gives the same run whichever store kept the state
    assert metrics(ctx_dir) == metrics(disk_dir)
    assert len(metrics(ctx_dir)) == 4
    for name in ("final_model.npz",):
        with np.load(ctx_dir / name) as a, np.load(disk_dir / name) as b:
            assert sorted(a.files) == sorted(b.files)
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k])
    # run_local removed this run's state folder
    assert not state_dir.exists() or list(state_dir.iterdir()) == []


def test_state_survives_rounds_in_both_stores(tmp_path):
    """Every client trained twice (2 meta-epochs of reshuffling); the tensors
    each store keeps after the run are the same, and disk mode leaves the
    Contexts empty."""
    grid_ctx = run_on_grid(small_config(tmp_path, "g-ctx", **{"client-state": "context"}), 6)
    state_dir = tmp_path / "state"
    grid_disk = run_on_grid(small_config(tmp_path, "g-disk", **{"client-state": "disk",
                                                                "state-dir": str(state_dir)}), 6)
    run_folder = state_run_dir(str(state_dir), grid_disk.run.run_id)
    assert sorted(p.name for p in run_folder.iterdir()) == [f"client-{i}" for i in range(6)]

    from_context = {partition_of(c): context_client_state(c.state).get("dr", CPU)
                    for c in grid_ctx.contexts.values()}
    # the fast runner keeps context state as rows of one stacked store, not in each RecordDict
    assert all(isinstance(context_client_state(c.state), StackedRowState) and len(c.state) == 0
               for c in grid_ctx.contexts.values())
    assert tuple(grid_ctx.client_states.names["dr"].slots[0].shape)[0] == 6
    for c in grid_disk.contexts.values():
        assert not any(k.startswith("fedaccel.") for k in c.state.array_records)
    from_disk = {pid: DiskState(run_folder / f"client-{pid}").get("dr", CPU) for pid in range(6)}

    final = dict(np.load(tmp_path / "results" / "g-ctx" / "final_model.npz"))
    expected_keys = {f"{part}.{k}" for part in ("y", "x", "xhat") for k in final}
    for pid in range(6):
        assert from_context[pid] is not None and from_disk[pid] is not None
        assert set(from_context[pid]) == expected_keys
        for k, t in from_context[pid].items():
            assert torch.equal(t, from_disk[pid][k]), (pid, k)
            assert t.dtype == torch.float32
        # the client state really moved away from its start
        assert not torch.equal(from_context[pid][f"y.{next(iter(final))}"],
                               from_context[pid][f"xhat.{next(iter(final))}"])


def test_auto_switches_to_disk_above_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(state_mod, "AUTO_DISK_BYTES", 1)
    state_dir = tmp_path / "state"
    grid = run_on_grid(small_config(tmp_path, "auto", **{"client-state": "auto",
                                                         "state-dir": str(state_dir),
                                                         "num-server-rounds": 1}), 6)
    folder = state_run_dir(str(state_dir), grid.run.run_id)
    # the 3 clients of round 1 wrote their (pending) version 1
    assert len([p for p in folder.iterdir() if (p / "v1" / "dr.npz").is_file()]) == 3
    assert all(not any(k.startswith("fedaccel.") for k in c.state.array_records)
               for c in grid.contexts.values())


def test_stateless_algorithm_keeps_no_state(tmp_path):
    grid = run_on_grid(small_config(tmp_path, "avg", algo="fedavg", **{"client-state": "disk",
                                                                       "state-dir": str(tmp_path / "s"),
                                                                       "num-server-rounds": 1}), 6)
    assert not state_run_dir(str(tmp_path / "s"), grid.run.run_id).exists()
    assert all(len(c.state.array_records) == 0 for c in grid.contexts.values())


def test_lost_client_state_is_detected_and_reported(tmp_path, caplog):
    """A SuperNode restarted with client-state='context' comes back without its
    state: the client notices (the server tells it that it trained before),
    restarts from the initial state, and the round's metrics say so."""
    from flwr.app import Context, RecordDict

    from fedaccel.apps.client_app import app as client_app
    from fedaccel.apps.server_app import QUIET, app as server_app
    from fedaccel.local_grid import LocalGrid

    cfg = fuse(default_run_config(), {
        "algo": "fedcdr", "num-server-rounds": 4, "clients-per-round": 2, "local-epochs": 1,
        "accl-every": 0, "synthetic.max-samples": 60, "client-state": "context",
        "results-dir": str(tmp_path), "run-name": "lost"})
    trained_once: set[int] = set()

    def restarting_client(message, context):
        """Partition 0 'restarts' (loses context.state) before its second training."""
        pid = context.node_config["partition-id"]
        if message.metadata.message_type == "train":
            if pid == 0 and pid in trained_once:
                context.state = RecordDict()
            trained_once.add(pid)
        return client_app(message, context)

    grid = LocalGrid(restarting_client, cfg, num_clients=4)
    grid.serve(server_app, Context(run_id=grid.run.run_id, node_id=0, node_config={QUIET: True}, state=RecordDict(),
                             run_config=cfg))
    rows = [json.loads(line) for line in (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["state_lost"] for r in rows) == 1  # reshuffle: partition 0 trains twice in 4 rounds
    assert "had lost its fedcdr state" in caplog.text


def test_only_state_folders_of_ended_fast_runner_processes_are_removed(tmp_path):
    import socket
    import subprocess
    import sys

    from fedaccel.clients.state import OWNER_FILE, claim_state_run_dir, remove_orphaned_state_dirs

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    folders = {name: tmp_path / f"run-{name}" for name in ("mine", "ended", "elsewhere", "supernode")}
    claim_state_run_dir(folders["mine"])  # this process: alive
    for name, host in (("ended", socket.gethostname()), ("elsewhere", "another-host")):
        folders[name].mkdir()
        (folders[name] / OWNER_FILE).write_text(json.dumps({"pid": int(ended.stdout), "pid_start": None,
                                                            "host": host}))
    (folders["supernode"] / "client-0").mkdir(parents=True)  # no owner: a SuperNode's, kept across runs
    assert remove_orphaned_state_dirs(str(tmp_path)) == [folders["ended"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-elsewhere", "run-mine", "run-supernode"]


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_flat_state_is_the_same_state_as_the_tensors(tmp_path, kind):
    """``put_flat`` stores exactly what ``put`` stores for the tensors the
    flat vector holds (the same record bytes and layout in a Context), so
    either reads the other's state; ``get_flat`` is ``get`` concatenated."""
    from fedaccel.clients.state import tensor_layout, unflatten

    src = OrderedDict((k, v) for k, v in tensors().items() if v.dtype == torch.float32)  # one dtype
    src["scale"] = torch.tensor(0.5)  # a 0-d tensor
    layout = tensor_layout(src)
    flat = torch.cat([v.reshape(-1) for v in src.values()])
    a, b = {"context": lambda: (ContextState(RecordDict()), ContextState(RecordDict())),
            "disk": lambda: (DiskState(tmp_path / "a"), DiskState(tmp_path / "b")),
            "stacked": lambda: (StackedRowState(StackedClientStates(2), 0),
                                StackedRowState(StackedClientStates(2), 1))}[kind]()
    a.put("dr", src)
    b.put_flat("dr", flat.clone(), layout)
    if kind == "context":
        assert list(a.record.keys()) == list(b.record.keys())
        for key in a.record.keys():
            assert a.record[key] == b.record[key], key  # byte for byte
    for store in (a, b):
        got = store.get("dr", CPU)
        assert list(got) == list(src) and all(torch.equal(got[k], src[k]) for k in src)
        assert torch.equal(store.get_flat("dr", layout, CPU), flat)
    assert all(torch.equal(v, src[k]) for k, v in unflatten(flat, layout).items())
    assert a.get_flat("other", layout, CPU) is None


@pytest.mark.parametrize("kind", ["context", "stacked"])
def test_flat_state_of_another_model_is_refused_in_one_line(tmp_path, kind):
    from fedaccel.clients.state import tensor_layout
    from fedaccel.config import ConfigError

    store = stores(tmp_path)[kind]
    store.put("dr", {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)})
    wider = {"fc.weight": torch.zeros(3, 3), "fc.bias": torch.zeros(3)}
    with pytest.raises(ConfigError, match=r"not this model's .*entry 0: saved \('fc.weight', 'float32', \(2, 3\)\), "
                       r"expected \('fc.weight', 'float32', \(3, 3\)\).*fresh state-dir"):
        store.get_flat("dr", tensor_layout(wider), CPU)
    with pytest.raises(ValueError, match="one dtype"):
        store.get_flat("dr", (("a", "float32", (1,)), ("b", "int64", (1,))), CPU)
    with pytest.raises(ValueError, match=r"torch.float64 vector of \(3,\) for a layout of 3 float32"):
        store.put_flat("dr", torch.zeros(3, dtype=torch.float64), (("a", "float32", (3,)),))
    with pytest.raises(ValueError, match=r"vector of \(5,\) for a layout of 8 float32"):
        store.put_flat("dr", torch.zeros(5), (("a", "float32", (2, 3)), ("b", "float32", (2,))))


@pytest.mark.slow  # 70 runs of the protocol with durable writes
def test_overlapping_rounds_on_disk_state_never_leave_a_wrong_state(tmp_path):
    """Flower's simulation can run a node's next training message on another
    worker while a message whose round timed out still runs (its reply is
    late: never applied). The two share a client's disk state. In every
    interleaving of their steps (resolve, begin, write, seal; the late round
    started first), the next round the server sends, with the round it
    applied (the next one's, or neither), finds exactly that version's state
    or reports the state lost: never another round's state as if it were it."""
    import itertools

    committed_round, late_round, next_round = 3, 5, 6
    outcomes = set()
    for early_at in itertools.combinations(range(1, 8), 4):  # the late round's resolve comes first
        for applied in (committed_round, next_round):
            folder = tmp_path / f"{'-'.join(map(str, early_at))}-{applied}"
            first = DiskState(folder)
            first.begin(committed_round)
            first.put("s", {"w": torch.tensor([float(committed_round)])})
            first.seal()
            first.resolve(committed_round)
            late, nxt = DiskState(folder), DiskState(folder)  # two workers, one folder

            def steps(store, server_round):
                yield lambda: store.resolve(committed_round)  # neither round was applied when sent
                yield lambda: store.begin(server_round)
                yield lambda: store.put("s", {"w": torch.tensor([float(server_round)])})
                yield store.seal
            runs = {"late": steps(late, late_round), "next": steps(nxt, next_round)}
            for who in ["next" if at in early_at else "late" for at in range(8)]:
                try:
                    next(runs[who])()
                except FileNotFoundError:  # the late round's write into a version the other dropped
                    runs[who] = iter(())  # that round fails: its reply is an error (never applied)
            then = DiskState(folder)
            outcome = then.resolve(applied)
            outcomes.add(outcome)
            if outcome != "lost":
                assert then.get("s", torch.device("cpu"))["w"].item() == float(applied), (early_at, applied)
    assert {"lost", "committed", "rolled-back"} <= outcomes  # the interleavings reach every case
