"""The client-state commit protocol (docs/client-state.md).

A stateful client's new state is pending until the server's next message
says the reply of that round was applied (``accepted-round``); otherwise it
is rolled back. The unit tests drive :class:`fedaccel.clients.state.VersionedState`
directly; the run tests drive the real ServerApp and ClientApp on the fast
runner's in-process Grid with injected faults (a lost reply, a late reply
past the round timeout, a reply rejected as non-finite, a client that dies
after training, dropped stragglers) and assert each algorithm's two-sided
invariant after every round:

- SCAFFOLD: server ``c`` = mean over all N clients of ``c_i``;
- FedDyn: server ``h`` = mean over all N clients of ``grad_prev_i``;
- FedCDR / FedDR: global model ``x`` = mean over all N clients of ``xhat_i``;
- every stateful algorithm (FedRKMGC included): the version of its state
  each client will train from is the one of the last round the server
  applied for it (never a state the server did not count).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict

from fedaccel.apps.client_app import app as client_app, train_cohort
from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState
from fedaccel.clients.state import ContextState, DiskState, VersionedState, context_client_state, state_run_dir
from fedaccel.run_config import parse_run_config
from fedaccel.experiment import Experiment, discover_federation
from fedaccel.local_grid import CLIENT_APP_RAISED_EXCEPTION, LocalGrid
from fedaccel.local_run import default_run_config, fuse
from fedaccel.grids import PromptGrid

# the experiment is driven by hand below (not through LocalGrid.serve): messages
# read the ServerApp identity from the process
pytestmark = pytest.mark.usefixtures("server_identity")

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- #
# the versioned store
# --------------------------------------------------------------------------- #
def stores(tmp_path):
    return {"context": ContextState(RecordDict()), "disk": DiskState(tmp_path / "client-0"),
            "stacked": StackedRowState(StackedClientStates(3), 1)}


def value(store: VersionedState) -> float | None:
    got = store.get("s", CPU)
    return None if got is None else float(got["w"])


def train_round(store: VersionedState, accepted: int, server_round: int, new: float) -> str:
    """What LocalSolver.fit does around training: resolve, begin, put, seal."""
    outcome = store.resolve(accepted)
    store.begin(server_round)
    store.put("s", {"w": torch.tensor(new)})
    store.seal()
    return outcome


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_commit_rollback_and_lost(tmp_path, kind):
    store = stores(tmp_path)[kind]
    assert train_round(store, 0, 3, 1.0) == "kept"  # first round: nothing to resolve
    assert store.versions() == (0, 3) and value(store) == 1.0  # pending, readable
    assert train_round(store, 3, 5, 2.0) == "committed"  # round 3 was applied
    assert store.versions() == (3, 5)
    # round 5's reply was lost: the server says 3 -> back to round 3's state
    assert store.resolve(3) == "rolled-back"
    assert store.versions() == (3, 3) and value(store) == 1.0
    assert store.read_version(5, "s", CPU) is None  # the unapplied version is gone
    # the server counts on a round the client does not have: lost, initial state
    assert store.resolve(8) == "lost"
    assert store.versions() == (0, 0) and value(store) is None


@pytest.mark.parametrize("kind", ["context", "disk", "stacked"])
def test_no_server_information_commits_the_latest(tmp_path, kind):
    store = stores(tmp_path)[kind]
    train_round(store, 0, 1, 1.0)
    assert store.resolve(None) == "committed" and store.versions() == (1, 1)


def test_disk_crash_before_seal_keeps_the_sealed_state(tmp_path):
    """A client killed while writing round 7 leaves an orphan version; the
    tags file still names the sealed versions, and the next resolve deletes
    the orphan."""
    folder = tmp_path / "client-0"
    train_round(DiskState(folder), 0, 4, 1.0)
    crashed = DiskState(folder)
    crashed.resolve(4)
    crashed.begin(7)
    crashed.put("s", {"w": torch.tensor(9.0)})  # ... and the process dies here
    restarted = DiskState(folder)
    assert restarted.versions() == (4, 4) and value(restarted) == 1.0
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["v4", "v7"]
    assert restarted.resolve(4) == "kept"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["v4"]


# --------------------------------------------------------------------------- #
# runs with faults
# --------------------------------------------------------------------------- #
class FaultyGrid(LocalGrid):
    """The fast runner's Grid, with faults injected into training rounds.

    ``faults[server_round]`` lists fault kinds applied, in order, to that
    round's training messages sorted by partition id: ``lose`` (the client
    trains, its reply never arrives: a dead link or node), ``late`` (the
    reply is not there when the round times out; Flower never pulls a reply
    of an earlier round, so for the server a late reply is a lost one, and
    the round waits ``round-timeout`` for it), ``nan`` (the reply carries
    non-finite values and is rejected), ``crash`` (the client trains and
    saves its state, then dies: an error reply), ``extra-shape``,
    ``extra-missing`` and ``extra-key`` (the reply's extra record, such as
    SCAFFOLD's ``dc``, holds its first entry as one value, lacks it, or
    holds one more entry: it must be rejected).
    """

    def __init__(self, *args, faults: dict[int, list[str]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.applied: list[tuple[int, int, str]] = []  # (round, partition, kind)
        self.batched_messages = 0  # training messages that went through the cohort trainer

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        train = sorted((m for m in messages if m.metadata.message_type == "train"),
                       key=lambda m: self.contexts[m.metadata.dst_node_id].node_config["partition-id"])
        if train:
            server_round = int(train[0].content["config"]["server-round"])
            for message, kind in zip(train, self.faults.get(server_round, [])):
                message.metadata.__dict__["_fault"] = kind
        return ids

    def deliver(self, message):
        return self._apply_fault(message, super().deliver(message))

    def _deliver_cohort(self, message_ids):
        """The batched path (cohort-batching): the same faults on its replies."""
        messages = {i: self._pending[i] for i in message_ids}
        self.batched_messages += len(messages)
        super()._deliver_cohort(message_ids)
        for i, message in messages.items():
            self._replies[i] = self._apply_fault(message, self._replies[i])

    def _apply_fault(self, message, reply):
        kind = message.metadata.__dict__.get("_fault")
        if kind is None:
            return reply
        pid = self.contexts[message.metadata.dst_node_id].node_config["partition-id"]
        self.applied.append((int(message.content["config"]["server-round"]), pid, kind))
        if kind == "nan":
            arrays = reply.content["arrays"]
            reply.content["arrays"] = ArrayRecord({k: Array(np.full(a.shape, np.nan, dtype=np.float32))
                                                   for k, a in arrays.items()})
        elif kind.startswith("extra-"):
            name = next(n for n in reply.content.array_records if n != "arrays")
            items = [(k, a.numpy()) for k, a in reply.content[name].items()]
            if kind == "extra-shape":  # one finite value: numpy would broadcast it
                items[0] = (items[0][0], np.ones((1,), dtype=items[0][1].dtype))
            elif kind == "extra-missing":
                items = items[1:]
            else:
                items.append(("no.such.entry", np.zeros((2,), dtype=np.float32)))
            reply.content[name] = ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in items})
        elif kind == "crash":
            reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, "SuperNode died after training"),
                            reply_to=message)
        elif kind in ("lose", "late"):
            reply.metadata.__dict__["_fault"] = kind
        return reply

    def pull_messages(self, message_ids):
        out = []
        for reply in super().pull_messages(message_ids):
            if reply.metadata.__dict__.get("_fault") in ("lose", "late"):
                continue  # never reaches the server (late: not before the round gave up)
            out.append(reply)
        return out


CHECK_VERSIONS = True


def effective_version(store: VersionedState, accepted: int) -> int | None:
    """The version the client will train from next, given the server's
    ``accepted-round`` (what resolve() will keep), or None if lost."""
    committed, latest = store.versions()
    return latest if accepted == latest else committed if accepted == committed else None


def client_states(grid: FaultyGrid, strategy, name: str, cfg) -> dict[int, dict[str, np.ndarray] | None]:
    """Every partition's effective state tensors (None: the initial state)."""
    out = {}
    for node, context in grid.contexts.items():
        pid = int(context.node_config["partition-id"])
        if cfg.client_state == "disk":
            store: VersionedState = DiskState(state_run_dir(cfg.state_dir, grid.run.run_id) / f"client-{pid}")
        else:
            store = context_client_state(context.state)
        accepted = strategy.accepted_round.get(pid, 0)
        version = effective_version(store, accepted)
        assert not CHECK_VERSIONS or version == accepted, (f"partition {pid}: the server applied its round {accepted}, the "
                                     f"client would train from version {version} {store.versions()}")
        tensors = store.read_version(version, name, CPU)
        out[pid] = None if tensors is None else {k: v.double().numpy() for k, v in tensors.items()}
    return out


def mean_over_all(states: dict, prefix: str, keys, initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.mean([initial[k] if s is None else s[f"{prefix}.{k}"] for s in states.values()], axis=0)
            for k in keys}


STATE_NAME = {"scaffold": "scaffold", "feddc": "feddc", "feddyn": "feddyn", "fedrkmgc": "fedrkmgc", "fedcdr": "dr",
              "feddr": "dr"}


def check_invariant(algo: str, cfg, strategy, grid: FaultyGrid, model: dict, x0: dict) -> float:
    """Assert the algorithm's server/client invariant; returns its error
    (0 for an algorithm without client state, such as FedPM)."""
    if algo not in STATE_NAME:
        return 0.0
    return invariant_error(algo, strategy, client_states(grid, strategy, STATE_NAME[algo], cfg), model, x0)


def invariant_error(algo: str, strategy, states: dict, model: dict, x0: dict) -> float:
    """Assert the algorithm's server/client invariant over every client's
    effective state ``states`` (partition id -> its tensors, None: the
    initial state); returns its error."""
    zeros = {k: np.zeros_like(v, dtype=np.float64) for k, v in x0.items()}
    if algo == "scaffold":
        server, clients = strategy.c, mean_over_all(states, "c", strategy.c, zeros)
    elif algo == "feddc":  # c = mean of every c_i, and H = the sum of every client's drift h_i
        n = len(states)
        assert n == strategy.federation.num_clients  # every client's state, trained or not
        server = {**{f"c.{k}": v for k, v in strategy.c.items()},
                  **{f"h.{k}": v / n for k, v in (strategy.h_sum or zeros).items()}}
        clients = {**{f"c.{k}": v for k, v in mean_over_all(states, "c", strategy.c, zeros).items()},
                   **{f"h.{k}": v for k, v in mean_over_all(states, "h", strategy.c, zeros).items()}}
    elif algo == "feddyn":
        server, clients = strategy.h, mean_over_all(states, "grad_prev", strategy.h, zeros)
    elif algo in ("fedcdr", "feddr"):
        server, clients = model, mean_over_all(states, "xhat", model, x0)
    else:
        return 0.0  # FedRKMGC: no server state; the version check above is its invariant
    error = max(float(np.abs(np.asarray(server[k], dtype=np.float64) - clients[k]).max()) for k in server)
    assert error < 1e-5, f"{algo}: server and clients disagree by {error:.3g}"
    return error


def run_with_faults(tmp_path, algo: str, faults: dict[int, list[str]], rounds: int = 6,
                    cohort: bool = False, **overrides) -> tuple[FaultyGrid, Experiment, list[float]]:
    run_config = fuse(default_run_config(), {
        "algo": algo, "num-server-rounds": rounds, "clients-per-round": 3, "local-epochs": 1,
        "accl-every": 0, "synthetic.max-samples": 60, "client-state": "context",
        "straggler-fraction": 0.34, "straggler-policy": "drop", "lr": 0.05,
        "results-dir": str(tmp_path / "results"), "run-name": f"{algo}-faults",
        "state-dir": str(tmp_path / "state"),
        # a lost reply is noticed when the round times out
        "round-timeout": 0.5, **overrides})
    grid = FaultyGrid(client_app, run_config, num_clients=6, seed=0, faults=faults,
                      cohort_trainer=train_cohort if cohort else None)
    cfg = parse_run_config(run_config)
    federation = discover_federation(PromptGrid(grid))
    experiment = Experiment(cfg, federation, quiet=True)
    errors: list[float] = []
    x0: dict[str, np.ndarray] = {}
    on_round_end = experiment.on_round_end

    def checked(server_round: int, arrays: ArrayRecord):
        out = on_round_end(server_round, arrays)
        model = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
        if server_round == 0:
            x0.update(model)
        else:
            errors.append(check_invariant(algo, cfg, experiment.strategy, grid, model, x0))
        return out

    experiment.on_round_end = checked  # Flower's evaluate_fn: after every round
    experiment.run(PromptGrid(grid))
    assert len(errors) == rounds
    return grid, experiment, errors


FAULTS = {2: ["lose"], 3: ["nan"], 4: ["crash"], 5: ["lose", "nan"]}


SLOW = pytest.mark.slow  # the same protocol again: kept out of the quick suite


@pytest.mark.parametrize("algo,gc_mode,cohort", [
    pytest.param("scaffold", "none", False, marks=SLOW), pytest.param("fedcdr", "local", False, marks=SLOW),
    pytest.param("fedrkmgc", "none", False, marks=SLOW), pytest.param("feddyn", "global", False, marks=SLOW),
    # the batched trainer (docs/cohort-batching.md) runs the same commit protocol per client
    ("scaffold", "none", True), ("fedcdr", "local", True), ("feddc", "none", True),
    pytest.param("feddc", "global", False, marks=SLOW),
    pytest.param("feddyn", "none", False, marks=SLOW), pytest.param("fedcdr", "none", False, marks=SLOW),
    pytest.param("feddr", "none", False, marks=SLOW), pytest.param("scaffold", "global", False, marks=SLOW),
    pytest.param("feddyn", "global", True, marks=SLOW), pytest.param("fedrkmgc", "none", True, marks=SLOW),
    pytest.param("feddr", "none", True, marks=SLOW)])
def test_invariants_hold_every_round_under_lost_rejected_and_dropped_replies(tmp_path, algo, gc_mode, cohort):
    grid, experiment, _ = run_with_faults(tmp_path, algo, FAULTS, cohort=cohort, **{"gc.mode": gc_mode})
    assert (grid.batched_messages >= 6 * 3) == cohort
    # the faults really happened, and stragglers really were dropped
    assert sorted(kind for _, _, kind in grid.applied) == ["crash", "lose", "lose", "nan", "nan"]
    logs = experiment.strategy.rounds
    assert sum(log.rejected for log in logs.values()) == 2
    assert sum(log.dropped for log in logs.values()) >= 3
    assert all(log.failures >= 1 for r, log in logs.items() if r in FAULTS)


@pytest.mark.parametrize("algo,where", [
    ("scaffold", "close_round"), pytest.param("fedcdr", "close_round", marks=SLOW),
    pytest.param("scaffold", "open_round", marks=SLOW), pytest.param("feddyn", "begin_at_anchor", marks=SLOW),
    pytest.param("fedrkmgc", "setup", marks=SLOW)])
def test_a_batched_client_whose_code_raises_fails_alone(tmp_path, monkeypatch, algo, where):
    """A bug (not a user error) raised by one client's own code in a batched
    round (its setup on the node, its ``open_round``, its begin at the
    anchor, its ``close_round`` after its state was written): that client
    alone gets Flower's error reply (``RuntimeError: boom``, not a user
    error's line) and rolls back; the others train, and server and clients
    agree every round (``check_invariant``), as one client after another."""
    import fedaccel.apps.client_app as ca
    from fedaccel.clients.base import LocalSolver
    from fedaccel.clients.stacked_solver import StackedStateSolver

    owner, name = {"setup": (ca, "_round_inputs"), "begin_at_anchor": (StackedStateSolver, "begin_at_anchor")
                   }.get(where, (LocalSolver, where))
    real, calls = getattr(owner, name), []

    def raising(*args, **kwargs):
        out = real(*args, **kwargs)  # the client's work done (its state written), then the bug
        calls.append(1)
        if len(calls) in (4, 8):  # a client of rounds 2 and 3 (3 a round, stragglers dropped)
            raise RuntimeError("boom")
        return out
    monkeypatch.setattr(owner, name, raising if owner is ca else
                        lambda self, *a, **k: raising(self, *a, **k))
    grid, experiment, _ = run_with_faults(tmp_path, algo, {}, rounds=4, cohort=True,
                                          **{"straggler-fraction": 0.0})
    assert grid.batched_messages >= 4 * 3
    logs = experiment.strategy.rounds
    assert [logs[r].failures for r in sorted(logs)] == [0, 1, 1, 0]
    assert [logs[r].replies for r in sorted(logs)] == [3, 2, 2, 3]
    seen = experiment.strategy.client_errors.seen
    assert [line.split("): ", 1)[1] for line in seen] == ["RuntimeError: boom"] * len(seen)
    assert sorted(r for rounds in seen.values() for r in rounds) == [2, 3]


@pytest.mark.parametrize("cohort", [False, True])
def test_a_client_that_raises_is_logged_with_its_traceback_once(tmp_path, monkeypatch, caplog, cohort):
    """A bug raised in a client's code: its node logs the traceback once
    (later the same error at DEBUG), as a SuperNode does, whether the fast
    runner trains its clients one after another or batched."""
    import logging

    import fedaccel.client_errors as client_errors
    from fedaccel.clients.base import LocalSolver

    monkeypatch.setattr(client_errors, "_RAISED", set())  # the process may have seen "boom" before
    real, calls = LocalSolver.close_round, []

    def raising(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) in (4, 8):
            raise RuntimeError("boom")
        return out
    monkeypatch.setattr(LocalSolver, "close_round", raising)
    caplog.set_level(logging.DEBUG, logger="flwr")
    run_with_faults(tmp_path, "scaffold", {}, rounds=3, cohort=cohort, **{"straggler-fraction": 0.0})
    raised = [r for r in caplog.records if r.getMessage().endswith(" raised")]
    assert [r.levelno for r in raised] == [logging.ERROR, logging.DEBUG]
    assert all(isinstance(r.exc_info[1], RuntimeError) and str(r.exc_info[1]) == "boom" for r in raised)
    assert raised[0].getMessage().startswith("[fedaccel] node ")


@pytest.mark.parametrize("algo,cohort", [pytest.param("scaffold", False, marks=SLOW), ("scaffold", True),
                                         ("fedpm", True), pytest.param("fedpm", False, marks=SLOW)])
def test_a_reply_whose_extra_record_is_malformed_is_rejected(tmp_path, algo, cohort):
    """SCAFFOLD's ``dc`` or FedPM's preconditioners with an entry of another
    shape, one missing or one unknown: the reply is rejected (the client
    rolls back, server and clients agree every round), where it was summed
    into ``c`` by broadcasting (a silent disagreement) or stopped the round."""
    faults = {2: ["extra-shape"], 3: ["extra-missing"], 4: ["extra-key"]}
    grid, experiment, _ = run_with_faults(tmp_path, algo, faults, rounds=4, cohort=cohort,
                                          **{"straggler-fraction": 0.0})
    assert [kind for _, _, kind in grid.applied] == ["extra-shape", "extra-missing", "extra-key"]
    logs = experiment.strategy.rounds
    assert [logs[r].rejected for r in sorted(logs)] == [0, 1, 1, 1]
    assert [logs[r].replies for r in sorted(logs)] == [3, 2, 2, 2]  # the replies applied


def test_a_rounds_counts_say_what_was_aggregated_and_what_came(tmp_path):
    """``clients`` counts the replies that went into the model (not a
    straggler's reply that ``drop`` then discarded), so sampled = clients +
    failures + dropped every round; ``bytes_up`` counts every reply that
    came, a rejected one included (it crossed the wire): a round with a
    rejected reply moved the bytes of a round without one."""
    grid, experiment, _ = run_with_faults(tmp_path, "fedavg", {2: ["nan"], 3: ["crash"]}, rounds=3,
                                          **{"straggler-policy": "drop"})
    logs = experiment.strategy.rounds
    assert all(logs[r].dropped == 1 for r in logs)  # one straggler of three, every round
    assert [(logs[r].replies, logs[r].failures) for r in sorted(logs)] == [(2, 0), (1, 1), (1, 1)]
    assert all(len(logs[r].sampled) == logs[r].replies + logs[r].failures + logs[r].dropped for r in logs)
    assert logs[1].bytes_up == logs[2].bytes_up > 0 and logs[3].bytes_up == 2 * logs[1].bytes_up // 3


def test_late_reply_past_the_round_timeout(tmp_path):
    """A reply that arrives after round-timeout is never applied; the client
    rolls back when it is next selected."""
    grid, experiment, _ = run_with_faults(tmp_path, "scaffold", {1: ["late"], 2: ["late"]},
                                          rounds=4, **{"round-timeout": 0.3, "straggler-fraction": 0.0})
    assert [kind for _, _, kind in grid.applied] == ["late", "late"]
    assert experiment.strategy.rounds[1].failures == 1


def test_disk_state_invariant_under_faults(tmp_path):
    run_with_faults(tmp_path, "fedcdr", FAULTS, **{"client-state": "disk"})


def test_without_the_protocol_the_invariant_breaks(tmp_path, monkeypatch):
    """Guard: the checks above can fail. With the client committing whatever
    it wrote last (the behaviour before the protocol), SCAFFOLD's server c and
    the clients' mean c_i disagree after the first lost reply."""
    import sys

    module = sys.modules[__name__]
    real_resolve = VersionedState.resolve
    monkeypatch.setattr(VersionedState, "resolve", lambda self, accepted: real_resolve(self, None))
    monkeypatch.setattr(module, "CHECK_VERSIONS", False)
    monkeypatch.setattr(module, "effective_version", lambda store, accepted: store.versions()[1])
    with pytest.raises(AssertionError, match="scaffold: server and clients disagree"):
        run_with_faults(tmp_path, "scaffold", FAULTS)


# --------------------------------------------------------------------------- #
# property: any sequence of applied and unapplied replies
# --------------------------------------------------------------------------- #
@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=25),
       kind=st.sampled_from(["context", "disk", "stacked"]))
def test_client_always_trains_from_the_last_applied_state(tmp_path_factory, events, kind):
    """Rounds 1..n: the client is selected or not, and a selected client's
    reply is applied or not (lost, late, rejected, dropped). Whatever the
    sequence, a client trains from exactly the state of its last applied
    round, and what it holds never runs ahead of the server by more than the
    one pending version."""
    folder = tmp_path_factory.mktemp("prop")
    store = {"context": lambda: ContextState(RecordDict()), "disk": lambda: DiskState(folder / "client"),
             "stacked": lambda: StackedRowState(StackedClientStates(2), 1)}[kind]()
    accepted, applied_value = 0, None  # the server's view
    for server_round, (selected, applied) in enumerate(events, start=1):
        if not selected:
            continue
        store.resolve(accepted)
        assert value(store) == applied_value  # trains from the last applied state
        store.begin(server_round)
        new = (applied_value or 0.0) + server_round  # depends on the state it trained from
        store.put("s", {"w": torch.tensor(new, dtype=torch.float64)})
        store.seal()
        if applied:
            accepted, applied_value = server_round, new
        committed, latest = store.versions()
        assert committed <= accepted <= latest
    store.resolve(accepted)
    assert value(store) == applied_value and store.versions() == (accepted, accepted)
