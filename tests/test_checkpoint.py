"""Checkpoints and resumed runs (fedaccel/checkpoint.py, docs/checkpoints.md).

The property that matters: a run killed after a checkpoint and resumed ends
with a final model bit-identical to the run that was never interrupted, for
every algorithm, with every client's state (fast runner) or the server's side
only (Flower's engines, algorithms whose clients keep no state).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedaccel.checkpoint import (Checkpoint, decode_state, encode_state, list_checkpoints,
                                 read_checkpoint, read_manifest, write_checkpoint)
from fedaccel.config import ConfigError
from fedaccel.errors import CheckpointError
from fedaccel.local_run import default_run_config, fuse, main as run_main, resume_config, run_local
from fedaccel.registry import algorithm_names
from fedaccel.strategies.base import FedAccelStrategy
from fedaccel.strategies.server_steps import AdamState

NUM_CLIENTS = 8


def config(tmp_path: Path, algo: str, name: str, **extra) -> dict:
    overrides = {
        "algo": algo, "num-server-rounds": 10, "clients-per-round": 3, "local-epochs": 1,
        "accl-every": 5, "results-dir": str(tmp_path), "run-name": name,
        "synthetic.max-samples": 120, **extra,
    }
    return fuse(default_run_config(), overrides)


class Killed(Exception):
    """Stands for the process dying in the middle of a round."""


def run_killed_in_round(monkeypatch, run_config: dict, kill_round: int) -> None:
    """Run until ``kill_round``'s clients have trained, then die before the server aggregates."""
    original = FedAccelStrategy.aggregate_train

    def dying(self, server_round, replies):
        if server_round == kill_round:
            raise Killed(f"killed in round {server_round}")
        return original(self, server_round, replies)

    with monkeypatch.context() as patch:
        patch.setattr(FedAccelStrategy, "aggregate_train", dying)
        with pytest.raises(Killed):
            run_local(run_config, num_clients=NUM_CLIENTS, quiet=True)


def final_model(run_dir: Path) -> dict[str, np.ndarray]:
    with np.load(run_dir / "final_model.npz") as data:
        return {k: data[k] for k in data.files}


def assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def rows_without_time(run_dir: Path) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def kill_and_resume(tmp_path, monkeypatch, algo: str, **extra) -> None:
    """The 10-round run killed in round 6 (checkpoint after round 5) and
    resumed equals the uninterrupted run: final model and every metrics row."""
    whole = run_local(config(tmp_path, algo, "whole", **extra), num_clients=NUM_CLIENTS, quiet=True)
    cut = config(tmp_path, algo, "cut", **{"checkpoint-every": 5, **extra})
    run_killed_in_round(monkeypatch, cut, kill_round=6)
    run_dir = tmp_path / "cut"
    assert [p.name for p in list_checkpoints(run_dir)] == ["round-00005.zip"]
    run_config, num_clients = resume_config(str(run_dir), {}, None)
    resumed = run_local(run_config, num_clients=num_clients, quiet=True)
    assert resumed == run_dir.resolve()
    assert_bit_identical(final_model(whole), final_model(resumed))
    assert rows_without_time(whole) == rows_without_time(resumed)


# ~1.5 s each: the slow tier; the quick tier kills and resumes FedCDR (server
# and client state) in test_flower_engines_checkpoint_without_a_client_store
@pytest.mark.slow
@pytest.mark.parametrize("algo", algorithm_names())
def test_killed_and_resumed_run_is_bit_identical(tmp_path, monkeypatch, algo):
    kill_and_resume(tmp_path, monkeypatch, algo)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {"client-state": "disk", "cohort-batching": "on"},
    {"gc.mode": "local", "straggler-fraction": 0.4, "lr-schedule": "step"},
], ids=["disk-state-batched", "local-gc-stragglers-schedule"])
def test_killed_and_resumed_fedcdr_with_options(tmp_path, monkeypatch, extra):
    kill_and_resume(tmp_path, monkeypatch, "fedcdr", **{"state-dir": str(tmp_path / "state"), **extra})


# ------------------------------------------------------------------ the codec
def test_state_codec_round_trips_exactly():
    value = {
        "accepted_round": {0: 3, 7: 5},
        "momentum": {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 3},
        "flag": True, "none": None, "ratio": 0.1, "scalar": np.float64(1 / 3),
        "pair": (1, "a"), "items": [np.int64(4)],
    }
    arrays: dict[str, np.ndarray] = {}
    back = decode_state(encode_state(value, arrays), arrays)
    assert back["accepted_round"] == {0: 3, 7: 5}
    assert back["momentum"]["fc.weight"].dtype == np.float32
    assert np.array_equal(back["momentum"]["fc.weight"], value["momentum"]["fc.weight"])
    assert back["ratio"] == 0.1 and back["flag"] is True and back["none"] is None
    assert back["scalar"] == np.float64(1 / 3) and isinstance(back["scalar"], np.float64)
    assert back["pair"] == (1, "a") and back["items"] == [4]
    adam = decode_state(encode_state(AdamState(m={"w": np.ones(2)}, v=None), arrays), arrays, like=AdamState())
    assert isinstance(adam, AdamState) and np.array_equal(adam.m["w"], np.ones(2)) and adam.v is None
    with pytest.raises(CheckpointError, match="does not fit this version"):
        decode_state(encode_state(AdamState(), arrays), arrays, like=None)  # the strategy has no such dataclass
    with pytest.raises(TypeError, match="cannot checkpoint a object"):
        encode_state(object(), {})


class _Carrying:
    carried_state = ("momentum",)


class _CarryingMore(_Carrying):
    carried_state = ("error_rounds",)
    optional_carried_state = ("error_rounds",)  # added after checkpoints without it were written

    def __init__(self):
        self.momentum, self.error_rounds = 0.0, {}


def test_an_optional_entry_may_be_absent_from_an_older_checkpoint_and_nothing_else():
    from fedaccel.checkpoint import restore_carried_state

    def restore(state):
        strategy = _CarryingMore()
        arrays: dict = {}
        ckpt = tiny_checkpoint(2)
        ckpt.server_state = {k: encode_state(v, arrays) for k, v in state.items()}
        ckpt.server_arrays = arrays
        restore_carried_state(strategy, ckpt)
        return strategy.momentum, strategy.error_rounds

    assert restore({"momentum": 0.5, "error_rounds": {"node 1": [1, 2]}}) == (0.5, {"node 1": [1, 2]})
    assert restore({"momentum": 0.5}) == (0.5, {})  # older checkpoint: keeps its fresh value
    with pytest.raises(CheckpointError, match=r"\(error_rounds\) does not match _CarryingMore's "
                                              r"\(error_rounds, momentum\)"):
        restore({"error_rounds": {}})  # a required entry missing
    with pytest.raises(CheckpointError, match="another fedaccel version or for another algorithm"):
        restore({"momentum": 0.5, "velocity": 1.0})  # an entry this strategy does not carry


def tiny_checkpoint(server_round: int) -> Checkpoint:
    from flwr.app import Array, ArrayRecord

    return Checkpoint(round=server_round, run_config={"algo": "fedavg", "lr": 0.1}, num_clients=2,
                      model=ArrayRecord({"w": Array(np.full(3, float(server_round), dtype=np.float32))}),
                      server_state={}, server_arrays={}, rows=[{"round": server_round}],
                      clients={"context/0.pb": b"abc"})


def test_write_keeps_the_newest_two_and_reads_back(tmp_path):
    for r in (2, 4, 6):
        write_checkpoint(tmp_path, tiny_checkpoint(r))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00004.zip", "round-00006.zip"]
    ckpt = read_checkpoint(list_checkpoints(tmp_path)[-1])
    assert ckpt.round == 6 and ckpt.clients == {"context/0.pb": b"abc"}
    assert np.array_equal(ckpt.model["w"].numpy(), np.full(3, 6.0, dtype=np.float32))
    import tomli

    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.toml")) == ["resume.toml", "round-00004.toml", "round-00006.toml"]
    assert tomli.loads((folder / "resume.toml").read_text())["resume"] == str(tmp_path.resolve())
    assert tomli.loads((folder / "round-00004.toml").read_text()) == {
        "algo": "fedavg", "lr": 0.1, "resume": str(folder.resolve() / "round-00004.zip")}


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, tiny_checkpoint(2))
    import fedaccel.checkpoint as module

    def crash(*args, **kwargs):
        raise Killed("power lost while writing")

    monkeypatch.setattr(module, "durable_replace", crash)
    with pytest.raises(Killed):
        write_checkpoint(tmp_path, tiny_checkpoint(4))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00002.zip"]
    assert read_checkpoint(list_checkpoints(tmp_path)[-1]).round == 2


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_named(tmp_path):
    write_checkpoint(tmp_path, tiny_checkpoint(2))
    path = write_checkpoint(tmp_path, tiny_checkpoint(4))
    with zipfile.ZipFile(path) as zf:
        offset = zf.getinfo("model.pb").header_offset + 60
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    previous = r"resume from the previous one instead \(fedaccel-run --resume '.*round-00002.zip'; " \
               r"flwr run: --run-config '.*round-00002.toml'\)"
    with pytest.raises(CheckpointError, match=r"damaged .*" + previous):
        read_checkpoint(path)
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short: the manifest too
    for read in (read_checkpoint, read_manifest):  # fedaccel-run --resume reads the manifest first
        with pytest.raises(CheckpointError, match="damaged or not a fedaccel checkpoint.*" + previous):
            read(path)


# ----------------------------------------------------------- the command line
def cli(capsys, *argv: str) -> tuple[int, str]:
    code = run_main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture
def checkpointed_run(tmp_path, monkeypatch) -> Path:
    run_killed_in_round(monkeypatch, config(tmp_path, "fedavg", "cut", **{"checkpoint-every": 2,
                                                                          "num-server-rounds": 4}), 3)
    return tmp_path / "cut"


def test_resume_refuses_a_changed_config_and_a_run_without_checkpoints(tmp_path, capsys, checkpointed_run):
    code, err = cli(capsys, "--resume", str(checkpointed_run), "lr=0.5")
    assert code == 2 and err.count("\n") == 1
    assert "--resume continues the run with the config it started with; drop lr" in err
    code, err = cli(capsys, "--resume", str(checkpointed_run), "--num-clients", "3")
    assert code == 2 and f"the run has {NUM_CLIENTS} clients" in err
    (tmp_path / "empty").mkdir()
    code, err = cli(capsys, "--resume", str(tmp_path / "empty"))
    assert code == 3 and err.count("\n") == 1 and "the run has no checkpoint" in err
    code, err = cli(capsys, "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and err.count("\n") == 1 and "no such run folder or checkpoint file" in err


def test_a_resume_key_with_another_config_is_refused(checkpointed_run):
    run_config = config(checkpointed_run.parent, "fedavg", "cut", **{"checkpoint-every": 2, "num-server-rounds": 4,
                                                                      "lr": 0.2, "resume": str(checkpointed_run)})
    with pytest.raises(ConfigError, match=r"resume=.*another run config \(lr=0\.2 \(checkpoint: 0\.05\)\)"):
        run_local(run_config, num_clients=NUM_CLIENTS, quiet=True)


def test_a_checkpoint_older_than_a_key_resumes_with_the_value_runs_had_before_it():
    """A checkpoint written before ``gc.global-scope`` existed lacks the key:
    it ran as ``split`` (what Global GC did then), so it matches a config
    with ``split`` and not one with ``all``; any other missing key still
    counts as a change."""
    from fedaccel.checkpoint import KEYS_ADDED_LATER, config_mismatch

    assert KEYS_ADDED_LATER["gc.global-scope"] == "split"
    saved = {"algo": "gcfed", "lr": 0.05}
    assert config_mismatch(saved, {**saved, "gc.global-scope": "split"}) == []
    assert config_mismatch(saved, {**saved, "gc.global-scope": "all"}) == [
        "gc.global-scope='all' (checkpoint: 'split')"]
    assert config_mismatch(saved, {**saved, "gc.lambda": 0.5}) == ["gc.lambda=0.5 (checkpoint: '<absent>')"]
    # synthetic.shared-model (2026-11-28): every run before it drew FedProx's independent client models
    assert config_mismatch(saved, {**saved, "synthetic.shared-model": False}) == []
    assert config_mismatch(saved, {**saved, "synthetic.shared-model": True}) == [
        "synthetic.shared-model=true (checkpoint: false)"]


def test_resume_with_a_new_checkpoint_interval_is_allowed(checkpointed_run, capsys):
    code, _ = cli(capsys, "--quiet", "--resume", str(checkpointed_run), "checkpoint-every=1")
    assert code == 0
    assert [p.name for p in list_checkpoints(checkpointed_run)] == ["round-00003.zip", "round-00004.zip"]
    assert [r["round"] for r in rows_without_time(checkpointed_run)] == [1, 2, 3, 4]


# ------------------------------------------------- Flower's engines: server side only
def flower_like_grid(run_config: dict):
    """The fast runner's grid behind a view that, like Flower's grids, offers
    no client store: the server checkpoints its own side only."""
    from fedaccel.apps.client_app import app as client_app
    from fedaccel.grids import GridView
    from fedaccel.local_grid import LocalGrid

    grid = LocalGrid(client_app, run_config, NUM_CLIENTS, seed=0)
    assert getattr(GridView(grid), "client_store", None) is None
    return grid, GridView(grid)


def run_on_flower_like_grid(run_config: dict) -> Path:
    from fedaccel.experiment import run_experiment

    grid, view = flower_like_grid(run_config)
    with __import__("fedaccel.local_grid", fromlist=["task_identity"]).task_identity(grid.run.run_id):
        return run_experiment(view, run_config, quiet=True)


@pytest.mark.parametrize("algo,extra", [
    pytest.param("fedacg", {}, marks=pytest.mark.slow),  # server side only: the clients keep nothing
    ("fedcdr", {"client-state": "disk"}),  # the clients' state files, read where they lie
    # cohort nodes: 16 logical clients on the 8 nodes, their state files by partition id
    pytest.param("fedcdr", {"client-state": "disk", "logical-clients": 2 * NUM_CLIENTS}, marks=pytest.mark.slow),
], ids=["fedacg", "fedcdr-disk", "fedcdr-disk-cohort-nodes"])
def test_flower_engines_checkpoint_without_a_client_store(tmp_path, monkeypatch, algo, extra):
    extra = {"num-server-rounds": 4, "state-dir": str(tmp_path / "state"), **extra}
    whole = run_on_flower_like_grid(config(tmp_path, algo, "whole", **extra))
    cut = config(tmp_path, algo, "cut", **{"checkpoint-every": 2, **extra})
    original = FedAccelStrategy.aggregate_train

    def dying(self, server_round, replies):
        if server_round == 3:
            raise Killed
        return original(self, server_round, replies)

    monkeypatch.setattr(FedAccelStrategy, "aggregate_train", dying)
    with pytest.raises(Killed):
        run_on_flower_like_grid(cut)
    monkeypatch.undo()
    saved = read_checkpoint(list_checkpoints(tmp_path / "cut")[-1]).clients
    assert saved is None if algo == "fedacg" else (saved and all(n.startswith("disk/") for n in saved))
    resumed = run_on_flower_like_grid({**cut, "resume": str(tmp_path / "cut")})
    assert_bit_identical(final_model(whole), final_model(resumed))


def test_clients_state_files_the_server_cannot_see_refuse_the_checkpoint(tmp_path):
    from fedaccel.checkpoint import SharedDiskClientStore

    store = SharedDiskClientStore(tmp_path / "run-1", applied=lambda: {3: 2, 5: 2})
    with pytest.raises(CheckpointError, match="does not see the state files of client.s. 3, 5 under"):
        store.client_state_files()
    with pytest.raises(CheckpointError, match="resume it with fedaccel-run --resume"):
        store.restore_client_state_files({"context/0.pb": b""})


def test_flower_engines_refuse_to_checkpoint_stateful_clients(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint-every=2: algo='scaffold' keeps state on its clients"):
        run_on_flower_like_grid(config(tmp_path, "scaffold", "x", **{"checkpoint-every": 2}))


# ------------------------------------------------------- a real kill -9
@pytest.mark.slow
def test_a_process_killed_with_sigkill_resumes_to_the_same_model(tmp_path):
    state = tmp_path / "state"
    args = ["--quiet", "--num-clients", str(NUM_CLIENTS), "algo=fedcdr", "num-server-rounds=30",
            "clients-per-round=3", "local-epochs=1", "synthetic.max-samples=120",
            f"results-dir='{tmp_path}'", "client-state='disk'", f"state-dir='{state}'"]
    command = [sys.executable, "-m", "fedaccel.local_run", *args]
    subprocess.run([*command, "run-name=whole"], check=True, capture_output=True)
    proc = subprocess.Popen([*command, "run-name=cut", "checkpoint-every=3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "cut" / "checkpoints" / "round-00006.zip"
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for the condition, not a fixed wait
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists() and not (tmp_path / "cut" / "final_model.npz").exists()
    (left,) = state.iterdir()  # the killed run's client state: nothing removed it
    assert (left / "client-0").is_dir()
    done = subprocess.run([sys.executable, "-m", "fedaccel.local_run", "--quiet", "--resume", str(tmp_path / "cut")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"removed {left}: client state of a run whose process was killed" in done.stderr
    assert not any(state.iterdir())  # the resumed run removed that folder first, and its own at the end
    assert_bit_identical(final_model(tmp_path / "whole"), final_model(tmp_path / "cut"))
    assert rows_without_time(tmp_path / "whole") == rows_without_time(tmp_path / "cut")


def test_a_resume_whose_auto_straggler_policy_now_means_another_rule_is_refused(tmp_path):
    """A FedProx run with stragglers and straggler-policy='auto' resolved it
    to 'drop' when it started (config.json says so; 'auto' means 'partial'
    for FedProx now): resuming it would switch rules mid-run, so it is
    refused in one line; the same checkpoint with its own rule resumes."""
    import json

    run_config = config(tmp_path, "fedprox", "cut", **{"num-server-rounds": 2, "checkpoint-every": 1,
                                                       "straggler-fraction": 0.5})
    run_dir = run_local(run_config, num_clients=NUM_CLIENTS, quiet=True)
    settings = json.loads((run_dir / "config.json").read_text())
    assert settings["resolved"]["straggler_policy"] == "partial"
    resumed, num_clients = resume_config(str(list_checkpoints(run_dir)[0]), {}, None)
    settings["resolved"]["straggler_policy"] = "drop"  # what a run started before the change recorded
    (run_dir / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match="started with straggler-policy resolved to 'drop'.*cannot be resumed"):
        run_local(resumed, num_clients=num_clients, quiet=True)
    # the checkpoint file named from inside its folder: the run folder is still found
    import os

    here = os.getcwd()
    os.chdir(run_dir / "checkpoints")
    try:
        relative, _ = resume_config(list_checkpoints(run_dir)[0].name, {}, None)
        with pytest.raises(CheckpointError, match="cannot be resumed"):
            run_local(relative, num_clients=num_clients, quiet=True)
    finally:
        os.chdir(here)
    settings["resolved"]["straggler_policy"] = "partial"
    (run_dir / "config.json").write_text(json.dumps(settings))
    assert run_local(resumed, num_clients=num_clients, quiet=True) == run_dir.resolve()
