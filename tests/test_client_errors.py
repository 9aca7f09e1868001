"""A client that fails with an error the user can fix (a corrupted or missing
data file, a bad node config) replies with one line naming the node and the
cause; the server logs it once, counts it in the round's ``failures`` and goes
on with the other clients, and stops with the causes when no client is left.

Everything runs in-process: the real ServerApp and ClientApp on the fast
runner's :class:`~fedaccel.local_grid.LocalGrid` (no Ray, no ``flwr run``).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord,
                      RecordDict)
from flwr.common.constant import ErrorCode

import fedaccel.apps.client_app as client_module
from fedaccel.apps.client_app import app as client_app
from fedaccel.apps.server_app import app as server_app
from fedaccel.data import DataConfig, DataError
from fedaccel.data.device_file import export_partition
from fakes import StubGrid
from fedaccel.contract import train_config_record
from fedaccel.run_config import parse_run_config
from fedaccel.errors import RoundFailedError
from fedaccel.experiment import run_experiment
from fedaccel.local_grid import LocalGrid
from fedaccel.local_run import default_run_config, fuse
from fedaccel.registry import get_algorithm
from fedaccel.membership import Federation

SERVER_LINE = "[fedaccel] client failed in round"


# messages built by hand below read the sender identity, as in a ServerApp process
pytestmark = pytest.mark.usefixtures("server_identity")

def run_config(tmp_path, **overrides) -> dict:
    return fuse(default_run_config(), {
        "num-server-rounds": 3, "clients-per-round": 4, "local-epochs": 1, "accl-every": 2,
        "synthetic.max-samples": 120, "results-dir": str(tmp_path / "results"), "run-name": "errors",
        "state-dir": str(tmp_path / "state"), **overrides})


def grid_with_device_files(tmp_path, cfg: dict, num_clients: int = 4, corrupt: tuple[int, ...] = ()) -> LocalGrid:
    """Each client trains on its own .npz (data-path); the partitions in
    ``corrupt`` get garbage bytes instead."""
    data_cfg = DataConfig(dataset="synthetic", num_clients=num_clients, synthetic_max_samples=120)
    grid = LocalGrid(client_app, cfg, num_clients=num_clients)
    rng = np.random.default_rng(0)
    for ctx in grid.contexts.values():
        pid = ctx.node_config["partition-id"]
        path = export_partition(data_cfg, pid, tmp_path / f"d{pid}.npz")
        if pid in corrupt:
            path.write_bytes(rng.integers(0, 256, 2000, dtype=np.uint8).tobytes())
        ctx.node_config["data-path"] = str(path)
    return grid


def node_of(grid: LocalGrid, pid: int) -> int:
    return next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == pid)


def server_lines(caplog, text: str = SERVER_LINE) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- #
# the reply
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("message_type", [MessageType.TRAIN, MessageType.EVALUATE])
def test_error_reply_names_node_partition_and_cause(tmp_path, message_type):
    grid = LocalGrid(client_app, run_config(tmp_path), num_clients=3)
    node = node_of(grid, 2)
    grid.contexts[node].node_config["data-path"] = str(tmp_path / "missing.npz")
    message = grid.create_message(RecordDict({"arrays": ArrayRecord(),
                                              "config": ConfigRecord(train_config_record(1, 0.05, 1))}),
                                  message_type, node, group_id="1")
    (reply,) = grid.send_and_receive([message])
    assert reply.has_error()
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    reason = reply.error.reason
    assert reason.startswith(f"node {node} (partition 2): data-path=")
    assert "missing.npz" in reason and "no such file" in reason
    assert "\n" not in reason and "Traceback" not in reason


def test_bad_node_config_is_an_error_reply_too(tmp_path):
    """A node without partition-id (a ConfigError): the reply still names the node."""
    grid = LocalGrid(client_app, run_config(tmp_path), num_clients=2)
    node = node_of(grid, 1)
    del grid.contexts[node].node_config["partition-id"]
    message = grid.create_message(RecordDict({"arrays": ArrayRecord(),
                                              "config": ConfigRecord(train_config_record(1, 0.05, 1))}),
                                  MessageType.TRAIN, node, group_id="1")
    (reply,) = grid.send_and_receive([message])
    assert reply.has_error()
    assert reply.error.reason.startswith(f"node {node} (partition ?): ")
    assert "partition-id" in reply.error.reason


def test_a_programming_error_still_raises_in_the_client_app(tmp_path, monkeypatch):
    """Only user errors become error replies in the ClientApp; a bug raises,
    so Flower logs its traceback on the node (and replies with an error itself)."""
    import fedaccel.clients.base

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(fedaccel.clients.base.LocalSolver, "run_epochs", broken)
    cfg = run_config(tmp_path)
    grid = LocalGrid(client_app, cfg, num_clients=2)
    node = node_of(grid, 0)
    from fedaccel.torch_utils import state_to_arrays

    rt = client_module.client_runtime(grid.contexts[node])

    message = grid.create_message(RecordDict({"arrays": state_to_arrays(rt.model),
                                              "config": ConfigRecord(train_config_record(1, 0.05, 1))}),
                                  MessageType.TRAIN, node, group_id="1")
    with pytest.raises(RuntimeError, match="disk on fire"):
        client_app(message, grid.contexts[node])


# --------------------------------------------------------------------------- #
# runs
# --------------------------------------------------------------------------- #
def test_corrupted_data_file_fails_one_client_and_the_run_goes_on(tmp_path, caplog):
    cfg = run_config(tmp_path)
    grid = grid_with_device_files(tmp_path, cfg, corrupt=(1,))
    bad_node = node_of(grid, 1)
    with caplog.at_level(logging.INFO, logger="flwr"):
        grid.serve(server_app, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                                 run_config=cfg))
    rows = read_metrics(tmp_path / "results" / "errors")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["failures"] == 1 and r["clients"] == 3 for r in rows)
    assert all(0 <= r["accg"] <= 1 for r in rows)
    assert rows[1]["accl"] is not None  # ACCL from the other three clients
    # the server names the node and the cause once, in one line, no traceback
    lines = server_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[fedaccel] client failed in round 1: node {bad_node} (partition 1): "
                               f"data-path='{tmp_path / 'd1.npz'}' is not an .npz file")
    assert sum(f"node {bad_node} (partition 1)" in r.getMessage() and "d1.npz" in r.getMessage()
               and r.levelno >= logging.WARNING and "client failed" in r.getMessage()
               and "reported once above" not in r.getMessage() for r in caplog.records) == 1
    assert "Traceback" not in caplog.text
    # repeats are counted at the end (training every round, ACCL in rounds 2 and 3)
    (repeats,) = server_lines(caplog, "rounds (reported once above")
    assert repeats.startswith(f"[fedaccel] client failed in 3 of 3 rounds (reported once above, first in "
                              f"round 1): node {bad_node} (partition 1): data-path=")


@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_a_resumed_run_counts_a_client_error_over_the_whole_run(tmp_path, caplog, monkeypatch):
    """The error replies seen are server state: a run killed after its round-4
    checkpoint and resumed counts the corrupted client's failures over all 6
    rounds, as the uninterrupted run does, and logs the error once more in
    the resumed process (its console is a new one)."""
    from fedaccel.strategies.base import FedAccelStrategy

    def serve(cfg, corrupt=(1,)):
        grid = grid_with_device_files(tmp_path, cfg, corrupt=corrupt)
        grid.serve(server_app, Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                       state=RecordDict(), run_config=cfg))
        return grid

    def repeats():
        return [r.getMessage().split(": node")[0] for r in caplog.records if "rounds (" in r.getMessage()]

    base = {"num-server-rounds": 6, "checkpoint-every": 2}
    with caplog.at_level(logging.INFO, logger="flwr"):
        serve(run_config(tmp_path, **base, **{"run-name": "whole"}))
    assert repeats() == ["[fedaccel] client failed in 6 of 6 rounds (reported once above, first in round 1)"]

    original = FedAccelStrategy.aggregate_train

    def dying(self, server_round, replies):
        if server_round == 5:
            raise KeyboardInterrupt  # killed after the round-4 checkpoint
        return original(self, server_round, replies)

    def killed_in_round_5(name):
        cut = run_config(tmp_path, **base, **{"run-name": name})
        with monkeypatch.context() as patch:
            patch.setattr(FedAccelStrategy, "aggregate_train", dying)
            with pytest.raises(KeyboardInterrupt):
                serve(cut)
        caplog.clear()
        return {**cut, "resume": str(tmp_path / "results" / name)}

    resume = killed_in_round_5("cut")
    with caplog.at_level(logging.INFO, logger="flwr"):
        serve(resume)
    assert repeats() == ["[fedaccel] client failed in 6 of 6 rounds (reported once above, first in round 1)"]
    assert [line.split(":")[0] for line in server_lines(caplog)] == ["[fedaccel] client failed in round 5"]
    # its data file repaired before the resume: rounds 1-4 counted, logged before the resume
    resume = killed_in_round_5("repaired")
    with caplog.at_level(logging.INFO, logger="flwr"):
        serve(resume, corrupt=())
    assert repeats() == ["[fedaccel] client failed in 4 of 6 rounds (before the run was resumed, first in round 1)"]
    assert server_lines(caplog) == []  # it did not fail after the resume


def test_every_data_file_corrupted_stops_with_the_causes(tmp_path, caplog):
    cfg = run_config(tmp_path, **{"clients-per-round": 3})
    grid = grid_with_device_files(tmp_path, cfg, num_clients=3, corrupt=(0, 1, 2))
    with caplog.at_level(logging.INFO, logger="flwr"), pytest.raises(RoundFailedError) as info:
        run_experiment(grid, cfg)
    message = str(info.value)
    assert message.startswith("round 1: all 3 sampled clients failed (")
    assert "\n" not in message
    for pid in range(3):
        assert f"node {node_of(grid, pid)} (partition {pid}): data-path='{tmp_path / f'd{pid}.npz'}' " \
               "is not an .npz file" in message
    assert len(server_lines(caplog)) == 3  # each node's cause logged before the stop


def test_same_cause_on_many_clients_is_listed_once_in_the_stop(tmp_path):
    """One cause hitting every client: the stop names it once, with the count."""
    cfg = run_config(tmp_path, **{"clients-per-round": 3})
    grid = LocalGrid(client_app, cfg, num_clients=3)
    for ctx in grid.contexts.values():
        ctx.node_config["data-path"] = "/nonexistent/same.npz"
    with pytest.raises(RoundFailedError) as info:
        run_experiment(grid, cfg)
    message = str(info.value)
    assert f"node {node_of(grid, 0)} (partition 0) and 2 other clients: data-path='/nonexistent/same.npz'" \
           in message
    assert message.count("no such file") == 1


def test_programming_error_is_reported_with_its_cause(tmp_path, monkeypatch, caplog):
    """A bug in one client (a RuntimeError, not a user error) is not swallowed:
    the ClientApp raises, the runner turns it into an error reply as Flower
    does, and the server logs the node and the exception's line."""
    import fedaccel.clients.base

    current: dict[str, int] = {}
    real_runtime, real_epochs = client_module.client_runtime, fedaccel.clients.base.LocalSolver.run_epochs

    def tracked(context):
        rt = real_runtime(context)
        current["pid"] = rt.partition_id
        return rt

    def run_epochs(self, *args, **kwargs):
        if current["pid"] == 2:
            raise RuntimeError("disk on fire")
        return real_epochs(self, *args, **kwargs)

    monkeypatch.setattr(client_module, "client_runtime", tracked)
    monkeypatch.setattr(fedaccel.clients.base.LocalSolver, "run_epochs", run_epochs)
    cfg = run_config(tmp_path, **{"accl-every": 0})
    grid = LocalGrid(client_app, cfg, num_clients=4)
    with caplog.at_level(logging.INFO, logger="flwr"):
        run_experiment(grid, cfg)
    rows = read_metrics(tmp_path / "results" / "errors")
    assert all(r["failures"] == 1 and r["clients"] == 3 for r in rows)
    (line,) = server_lines(caplog)
    assert line == (f"[fedaccel] client failed in round 1: node {node_of(grid, 2)} (partition 2): "
                    "RuntimeError: disk on fire")
    # the repeats are summed up at the end of the run, also without any evaluation round
    assert [r.getMessage() for r in caplog.records if "rounds (reported once above" in r.getMessage()] == [
        f"[fedaccel] client failed in 3 of 3 rounds (reported once above, first in round 1): "
        f"node {node_of(grid, 2)} (partition 2): RuntimeError: disk on fire"]


def test_a_failed_round_commits_no_client_state(tmp_path, monkeypatch, caplog):
    """SCAFFOLD, a client whose training fails with a user error after it wrote
    its new control variate (round 2): nothing is sealed, the server does not
    count the round for it, and the two-sided invariant (server c = mean of the
    clients' c_i) holds after every round (checked by ``run_with_faults``)."""
    from fedaccel.clients.state import context_client_state
    from fedaccel.registry import get_algorithm
    from test_state_protocol import run_with_faults

    solver_cls = get_algorithm("scaffold").solver
    current: dict[str, int] = {}
    real_runtime, real_end_round = client_module.client_runtime, solver_cls.end_round
    seen: list[tuple[int, int]] = []

    tags_before: list[tuple[int, int]] = []  # partition 1's (committed, latest) before each round

    def tracked(context):
        rt = real_runtime(context)
        current["pid"] = rt.partition_id
        if rt.partition_id == 1:
            tags_before.append(context_client_state(context.state).versions())
        return rt

    def end_round(self, model, state):
        extra = real_end_round(self, model, state)  # the new c_i is written (pending)
        if current["pid"] == 1 and state.open_round == 2:
            seen.append(state.versions())
            raise DataError("x holds NaN or infinite values (simulated, after training)")
        return extra

    monkeypatch.setattr(client_module, "client_runtime", tracked)
    monkeypatch.setattr(solver_cls, "end_round", end_round)
    with caplog.at_level(logging.INFO, logger="flwr"):
        grid, experiment, _ = run_with_faults(tmp_path, "scaffold", {}, rounds=4,
                                              **{"clients-per-round": 6, "straggler-fraction": 0.0})
    strategy = experiment.strategy
    assert [strategy.rounds[r].failures for r in (1, 2, 3, 4)] == [0, 1, 0, 0]
    assert seen == [(1, 1)]  # round 1 committed; round 2 was being written
    (line,) = server_lines(caplog)
    assert "round 2:" in line and "(partition 1): x holds NaN" in line
    # the failed round 2 sealed nothing: round 3 started from round 1's state as
    # the latest version (not a pending round 2), then training resumed normally
    assert tags_before == [(0, 0), (0, 1), (1, 1), (1, 3)]
    store = context_client_state(grid.contexts[node_of(grid, 1)].state)
    assert store.versions() == (3, 4) and strategy.accepted_round[1] == 4


# --------------------------------------------------------------------------- #
# the server's side, with the reasons Flower's engines write
# --------------------------------------------------------------------------- #
FLOWER_REASONS = {
    # an exception raised in the ClientApp, as the SuperNode runtime reports it
    "supernode": "<class 'RuntimeError'>:<'disk on fire'>",
    # ... and as the Ray simulation does (ClientAppException wraps the message)
    "ray": "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\n"
           "Exception ClientAppException occurred. Message: disk on fire'>",
}


def fedavg_on_two_nodes(**changes):
    """A FedAvg strategy over nodes 101 and 102 (partitions 0 and 1)."""
    cfg = parse_run_config(fuse(default_run_config(), {"clients-per-round": 2, **changes}))
    return get_algorithm("fedavg").build_strategy(cfg, Federation({0: 101, 1: 102}))


@pytest.mark.usefixtures("server_identity")
@pytest.mark.parametrize("engine", sorted(FLOWER_REASONS))
def test_server_names_the_node_of_an_error_flower_wrote(engine, caplog):
    """Flower's own error replies do not name the node; the server adds it
    (node id and the partition it learned at discovery), on one line."""
    strategy = fedavg_on_two_nodes()
    msgs = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), StubGrid([101, 102])))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    replies = [Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, FLOWER_REASONS[engine]), reply_to=m)
               for m in msgs]
    with caplog.at_level(logging.INFO, logger="flwr"), pytest.raises(RoundFailedError) as info:
        strategy.aggregate_train(1, replies)
    lines = server_lines(caplog)
    # worded as the fast runner words it (test_programming_error_is_reported_with_its_cause);
    # Flower's Ray engine does not pass the exception's type on
    cause = {"supernode": "RuntimeError: disk on fire", "ray": "disk on fire"}[engine]
    assert lines == [f"[fedaccel] client failed in round 1: node 101 (partition 0): {cause}",
                     f"[fedaccel] client failed in round 1: node 102 (partition 1): {cause}"]
    assert f"node 101 (partition 0) and 1 other client: {cause}" in str(info.value)


@pytest.mark.usefixtures("server_identity")
def test_a_hundred_failing_rounds_log_the_cause_once(caplog):
    """One node failing with the same cause every round: one warning with the
    cause, the count in every round's ``failures``, the repeats at the end."""
    strategy = fedavg_on_two_nodes(**{"num-server-rounds": 100, "accl-every": 0})
    model = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    reason = "node 102 (partition 1): data-path='/data/d1.npz' is corrupted"
    with caplog.at_level(logging.INFO, logger="flwr"):
        for server_round in range(1, 101):
            msgs = list(strategy.configure_train(server_round, model, ConfigRecord(), StubGrid([101, 102])))
            for i, m in enumerate(msgs):
                m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
            good, bad = sorted(msgs, key=lambda m: m.metadata.dst_node_id)
            ok = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(2, np.float32))}),
                                     "metrics": MetricRecord({"num-examples": 5})}), reply_to=good)
            err = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=bad)
            model, _ = strategy.aggregate_train(server_round, [err, ok])
            strategy.aggregate_evaluate(server_round, [])
            assert strategy.rounds[server_round].failures == 1
        strategy.client_errors.report_repeats()  # as Experiment.run does after the last round
    assert server_lines(caplog) == [f"[fedaccel] client failed in round 1: {reason}"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, warnings  # the cause, round 1's count, the repeats at the end
    assert warnings[-1] == ("[fedaccel] client failed in 100 of 100 rounds (reported once above, "
                            f"first in round 1): {reason}")


def test_a_bug_is_logged_with_its_traceback_once_and_a_user_error_never(monkeypatch, caplog):
    """``log_raised``: a client's bug gets its traceback in the log the first
    time (later at DEBUG); a user error, or a message of another version's
    contract, is left to its reply's one line."""
    import fedaccel.client_errors as client_errors
    from fedaccel.config import ConfigError
    from fedaccel.contract import ContractError

    monkeypatch.setattr(client_errors, "_RAISED", set())
    caplog.set_level(logging.DEBUG, logger="flwr")
    for err in (ConfigError("lr=-1: must be > 0"), ContractError("unknown key"), RuntimeError("boom"),
                RuntimeError("boom")):
        try:
            raise err
        except Exception as raised:  # noqa: BLE001 - logged with its traceback
            client_errors.log_raised("node 7 (partition 2)", raised)
    records = [r for r in caplog.records if r.getMessage() == "[fedaccel] node 7 (partition 2) raised"]
    assert [r.levelno for r in records] == [logging.ERROR, logging.DEBUG]
    assert all(str(r.exc_info[1]) == "boom" for r in records)
