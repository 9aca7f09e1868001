"""Cohort nodes (``logical-clients``): Flower nodes that serve logical clients in slices.

The envelope codec by hand; runs on the fast runner's in-process Grid, whose
nodes then play Flower's simulated SuperNodes, equal bit for bit to the same
clients as nodes of their own (the per-client path) and to float32 rounding
when each node trains its slice as one batch; and the commit protocol's
two-sided invariants when a node's whole reply is lost, when it is an error,
and when one client's reply inside it is rejected. The same through Flower's
Ray simulation is in tests/test_flwr_run.py (engine matrix).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from fedaccel.apps.client_app import app as client_app, train_logical_clients
from fedaccel.checkpoint import record_dict_bytes, record_dict_from_bytes
from fedaccel.clients.state import ContextState, DiskState, state_run_dir
from fedaccel.cohort_nodes import (CohortNodes, client_state, keep_client_state, logical_messages,
                                   logical_node_id, pack_envelope, pack_replies, unpack_replies)
from fedaccel.experiment import Experiment, discover_federation
from fedaccel.grids import NOT_SENT, PromptGrid, SerialNodes
from fedaccel.local_grid import CLIENT_APP_RAISED_EXCEPTION, LocalGrid
from fedaccel.local_run import default_run_config, fuse, run_local
from fedaccel.run_config import parse_run_config
from test_state_protocol import STATE_NAME, effective_version, invariant_error

pytestmark = pytest.mark.usefixtures("server_identity")


# --------------------------------------------------------------------------- #
# the envelope codec
# --------------------------------------------------------------------------- #
def test_an_envelope_carries_each_clients_message_and_a_shared_record_once():
    model = ArrayRecord({"w": Array(np.arange(3, dtype=np.float32))})
    own = ArrayRecord({"c": Array(np.ones(2, dtype=np.float32))})
    messages = [Message(RecordDict({"arrays": model, "config": ConfigRecord({"server-round": 4, "p": p})}),
                        logical_node_id(p), "train", group_id="4") for p in (5, 2)]
    messages[1].content["scaffold.c"] = own
    envelope = pack_envelope(messages, num_clients=9)
    assert [k for k, r in envelope.items() if isinstance(r, ArrayRecord)] == ["0/arrays", "1/scaffold.c"]
    envelope_msg = Message(envelope, 77, "train.cohort", group_id="4")
    envelope_msg.metadata.__dict__["_message_id"] = "env"
    unpacked = logical_messages(envelope_msg)
    assert [(pid, n) for pid, n, _ in unpacked] == [(5, 9), (2, 9)]
    for (pid, _, message), original in zip(unpacked, messages):
        assert message.metadata.message_type == "train"
        assert message.metadata.dst_node_id == logical_node_id(pid)
        assert message.metadata.group_id == "4"
        assert list(message.content.keys()) == list(original.content.keys())
        assert message.content["arrays"]["w"].numpy().tolist() == [0.0, 1.0, 2.0]
        assert message.content["config"]["p"] == pid
    assert unpacked[1][2].content["scaffold.c"]["c"].numpy().tolist() == [1.0, 1.0]


def test_a_reply_envelope_gives_each_client_its_reply_or_its_error():
    sent = [Message(RecordDict({"config": ConfigRecord()}), logical_node_id(p), "train") for p in range(3)]
    for i, m in enumerate(sent):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    replies = [Message(RecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord({"num-examples": 7})}),
                       reply_to=sent[0]),
               Message(Error(CLIENT_APP_RAISED_EXCEPTION, "node 9 (partition 1): data file corrupted"),
                       reply_to=sent[1]),
               Message(RecordDict({"metrics": MetricRecord({"num-examples": 3})}), reply_to=sent[2])]
    back = unpack_replies(pack_replies(replies), sent)
    assert [m.metadata.src_node_id for m in back] == [logical_node_id(p) for p in range(3)]
    assert [m.metadata.reply_to_message_id for m in back] == ["m0", "m1", "m2"]
    assert back[1].has_error() and back[1].error.reason == "node 9 (partition 1): data file corrupted"
    assert back[0].content["metrics"]["num-examples"] == 7 and back[2].content["metrics"]["num-examples"] == 3
    with pytest.raises(ValueError, match="answered 3 of 2 clients"):
        unpack_replies(pack_replies(replies), sent[:2])


def test_a_malformed_reply_envelope_is_each_of_its_clients_error(tmp_path):
    """A node whose reply envelope cannot be unpacked (another fedaccel
    version, say) fails its clients of the round with one line; the run goes on."""
    class Garbled(LocalGrid):
        def deliver(self, message):
            if message.metadata.message_type == "train.cohort":  # a reply without the index
                return Message(RecordDict({"0/metrics": MetricRecord({"num-examples": 1})}), reply_to=message)
            return super().deliver(message)

    run_config = fuse(default_run_config(), {"num-server-rounds": 1, "clients-per-round": 6, "local-epochs": 1,
                                             "synthetic.max-samples": 60, "logical-clients": 6,
                                             "results-dir": str(tmp_path), "run-name": "garbled"})
    view = CohortNodes(PromptGrid(Garbled(client_app, run_config, num_clients=2, seed=0)), 6, query_timeout=5.0)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), node, "train")
                for node in view.get_node_ids()]
    replies = list(view.send_and_receive(messages, timeout=5.0))
    assert len(replies) == 6 and all(r.has_error() for r in replies)
    assert all("a malformed cohort reply ('cohort-replies')" in r.error.reason for r in replies)


def test_a_restarted_node_takes_its_slot_over_once_the_old_one_is_offline(tmp_path):
    """A SuperNode restarted without SuperNode authentication comes back
    under a new node id while the old one still counts as online: its slot's
    clients move to it once the old node is offline. Before the first round,
    two nodes with one partition-id are refused."""
    from flwr.app import Context

    from fedaccel.errors import FederationError

    class Recording(LocalGrid):
        def deliver(self, message):
            self.delivered.append(message.metadata.dst_node_id)
            return super().deliver(message)

    run_config = fuse(default_run_config(), {"logical-clients": 6, "results-dir": str(tmp_path)})
    grid = Recording(client_app, run_config, num_clients=2, seed=0)
    grid.delivered = []
    old = next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 1)
    restarted = Context(run_id=grid.run.run_id, node_id=999, node_config=dict(grid.contexts[old].node_config),
                        state=RecordDict(), run_config=dict(run_config))

    def train_slot_1():
        grid.delivered.clear()
        message = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(1), "train")
        assert len(list(view.send_and_receive([message], timeout=5.0))) == 1
        return [n for n in grid.delivered if n in (old, 999)]

    early = CohortNodes(PromptGrid(grid), 6, query_timeout=5.0)
    grid.contexts[999] = restarted
    with pytest.raises(FederationError, match="two nodes claim partition-id=1"):
        early.get_node_ids()
    del grid.contexts[999]

    view = CohortNodes(PromptGrid(grid), 6, query_timeout=5.0)
    assert len(list(view.get_node_ids())) == 6
    assert train_slot_1() == [old]
    grid.contexts[999] = restarted  # back under a new id; the old session still counts as online
    assert len(list(view.get_node_ids())) == 6 and train_slot_1() == [old]
    del grid.contexts[old]  # the old session is declared offline
    assert len(list(view.get_node_ids())) == 6 and train_slot_1() == [999]


@pytest.mark.parametrize("crashes", [2, 3])
def test_cohort_discovery_asks_again_after_flowers_own_errors(tmp_path, crashes):
    """Before the first round, a node whose answer was an error of Flower's
    own (its ClientApp process died) is asked again, up to three times in all,
    as discover_federation asks a node of its own; a third such answer stops
    the run with the cause."""
    from flwr.common.constant import ErrorCode

    from fedaccel.errors import FederationError

    class Crashing(LocalGrid):
        left = crashes

        def deliver(self, message):
            if message.metadata.message_type == "query" and self.contexts[message.metadata.dst_node_id] \
                    .node_config["partition-id"] == 1 and Crashing.left:
                Crashing.left -= 1
                return Message(Error(ErrorCode.CLIENT_APP_CRASHED, "ClientApp stopped responding."),
                               reply_to=message)
            return super().deliver(message)

    run_config = fuse(default_run_config(), {"logical-clients": 4, "results-dir": str(tmp_path)})
    view = CohortNodes(PromptGrid(Crashing(client_app, run_config, num_clients=2, seed=0)), 4, query_timeout=1.0)
    if crashes < 3:
        federation = discover_federation(view, timeout=5, poll=0.01)
        assert sorted(federation.node_of_partition) == [0, 1, 2, 3]
    else:
        with pytest.raises(FederationError, match=r"could not report which clients it serves: ClientApp stopped "
                                                  r"responding\. \(3 such answers\)$"):
            discover_federation(view, timeout=5, poll=0.01)
    assert Crashing.left == 0


def test_a_node_that_joins_and_never_answers_is_asked_once(tmp_path):
    """After discovery, a node that cannot say which clients it serves is
    logged and left out; it is not asked again (each ask waits the query
    timeout, every round)."""
    from flwr.app import Context

    class Silent(LocalGrid):
        queries = 0

        def deliver(self, message):
            reply = super().deliver(message)
            if message.metadata.dst_node_id == 777:
                Silent.queries += 1
                reply.metadata.__dict__["_lost"] = True
            return reply

        def pull_messages(self, message_ids):
            return [r for r in super().pull_messages(message_ids) if not r.metadata.__dict__.get("_lost")]

    run_config = fuse(default_run_config(), {"logical-clients": 4, "results-dir": str(tmp_path)})
    grid = Silent(client_app, run_config, num_clients=2, seed=0)
    view = CohortNodes(PromptGrid(grid), 4, query_timeout=0.2)
    assert len(list(view.get_node_ids())) == 4
    view.close_discovery()
    grid.contexts[777] = Context(run_id=grid.run.run_id, node_id=777,
                                 node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                                 run_config=dict(run_config))
    for _ in range(3):
        assert len(list(view.get_node_ids())) == 4
    assert Silent.queries == 1


def test_each_logical_clients_state_lives_under_its_own_keys_in_its_nodes_state():
    node_state = RecordDict({"client-3/old": ConfigRecord({"v": 1}), "client-30/x": ConfigRecord({"v": 2})})
    assert list(client_state(node_state, 3).keys()) == ["old"]
    keep_client_state(node_state, 3, RecordDict({"new": ConfigRecord({"v": 3})}))
    assert sorted(node_state.keys()) == ["client-3/new", "client-30/x"]  # client 30 untouched
    assert client_state(node_state, 3)["new"]["v"] == 3


def test_a_slices_states_are_read_and_kept_in_one_pass_as_client_by_client():
    """``client_states`` / ``keep_client_states`` (one pass over the node's
    records for a whole envelope) give and leave what ``client_state`` /
    ``keep_client_state`` do client by client: each client's own records in
    their order, another client's (``client-30`` beside ``client-3``), a
    look-alike key (``client-03``) and the node's own records untouched."""
    from fedaccel.cohort_nodes import client_states, keep_client_states

    node_state = RecordDict({"client-3/b": ConfigRecord({"v": 1}), "client-30/x": ConfigRecord({"v": 2}),
                             "client-3/a": ConfigRecord({"v": 3}), "client-03/y": ConfigRecord({"v": 4}),
                             "own": ConfigRecord({"v": 5}), "client-7/z": ConfigRecord({"v": 6})})
    states = client_states(node_state, [3, 7, 8])
    for pid in (3, 7, 8):
        assert list(states[pid].items()) == list(client_state(node_state, pid).items())
    assert list(states[3].keys()) == ["b", "a"] and len(states[8]) == 0
    one_by_one = RecordDict(dict(node_state.items()))
    new = {3: RecordDict({"n": ConfigRecord({"v": 7})}), 8: RecordDict({"m": ConfigRecord({"v": 8})}),
           7: RecordDict()}
    keep_client_states(node_state, new)
    for pid, state in new.items():
        keep_client_state(one_by_one, pid, state)
    assert sorted(node_state.keys()) == sorted(one_by_one.keys()) == [
        "client-03/y", "client-3/n", "client-30/x", "client-8/m", "own"]


# --------------------------------------------------------------------------- #
# runs: cohort nodes against one node per client
# --------------------------------------------------------------------------- #
def _run(tmp_path, name, nodes, **overrides):
    config = fuse(default_run_config(), {
        "num-server-rounds": 3, "clients-per-round": 5, "local-epochs": 1, "synthetic.max-samples": 80,
        "accl-every": 3, "results-dir": str(tmp_path), "run-name": name, "state-dir": str(tmp_path / "state"),
        **overrides})
    folder = run_local(config, nodes, quiet=True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return dict(np.load(folder / "final_model.npz")), rows


COMPARED = ("accg", "loss", "accl", "train_loss", "bytes_up", "bytes_down", "clients", "failures")


@pytest.mark.parametrize("algo,state", [("fedavg", "context"), ("scaffold", "context"), ("fedcdr", "disk")])
def test_cohort_nodes_equal_one_node_per_client_bit_for_bit(tmp_path, algo, state):
    """12 clients on 3 nodes (``logical-clients=12``), each client trained as
    alone: the same run as 12 nodes, to the bit: model, metrics, bytes.
    (Batched, a node's slice shares its matrix products with other clients
    than the whole round does, which on some machines rounds a client's
    products differently: to float32 rounding, the test below.)"""
    kw = {"algo": algo, "client-state": state, "cohort-batching": "off"}
    model, rows = _run(tmp_path, "nodes", 3, **kw, **{"logical-clients": 12})
    ref_model, ref_rows = _run(tmp_path, "clients", 12, **kw)
    assert all(np.array_equal(model[k], ref_model[k]) for k in ref_model)
    assert [{k: r.get(k) for k in COMPARED} for r in rows] == [{k: r.get(k) for k in COMPARED} for r in ref_rows]


def test_a_cohort_node_trains_its_slice_as_one_batch(tmp_path, monkeypatch):
    """With cohort-batching, each node's share of a round trains as one batched
    model (equal to training the clients alone to float32 rounding)."""
    import fedaccel.apps.client_app as ca

    sizes, pools = [], set()
    real = ca.fit_cohort

    def counted(model, jobs, *a, **k):
        sizes.append(len(jobs))
        pools.update(id(job.data.pool) for job in jobs)
        return real(model, jobs, *a, **k)

    monkeypatch.setattr(ca, "fit_cohort", counted)
    kw = {"algo": "fedprox", "clients-per-round": 8}
    model, rows = _run(tmp_path, "batched", 3, **kw, **{"logical-clients": 12, "cohort-batching": "on"})
    assert len(sizes) == 9 and sum(sizes) == 3 * 8 and max(sizes) > 1  # 3 rounds x 3 nodes
    # the fast runner pooled the 12 logical clients' data before round 1 (not its 3 nodes' partitions)
    assert len(pools) == 1 and id(None) not in pools
    ref_model, ref_rows = _run(tmp_path, "alone", 12, **kw)
    for k in ref_model:
        np.testing.assert_allclose(model[k], ref_model[k], atol=2e-5, rtol=1e-4)
    assert [r["accg"] for r in rows] == pytest.approx([r["accg"] for r in ref_rows], abs=0.02)


@pytest.mark.parametrize("algo,says", [
    ("fedcdr", "fedaccel: cohort nodes: each node trains its clients of a round as one batched model\n"),
    ("fedpm", "fedaccel: cohort nodes: each node trains its clients one after another "
              "(fedpm.refresh-every=2 recomputes each client's FOOF matrix at its own weights during the round)\n")])
def test_the_fast_runner_says_once_how_its_cohort_nodes_train(tmp_path, capsys, algo, says):
    """As for its own clients, the fast runner says on stderr, once, how its
    cohort nodes train (batched, or one after another and why); not with
    ``quiet``. (It once said it only in Flower's log, which the fast runner
    keeps at WARNING.)"""
    config = fuse(default_run_config(), {
        "algo": algo, **({"fedpm.refresh-every": 2} if algo == "fedpm" else {}), "logical-clients": 8, "clients-per-round": 4,
        "num-server-rounds": 2, "synthetic.max-samples": 80, "accl-every": 0, "results-dir": str(tmp_path)})
    for quiet in (False, True):
        capsys.readouterr()
        run_local({**config, "run-name": f"{algo}-{quiet}"}, 2, quiet=quiet)
        lines = [line + "\n" for line in capsys.readouterr().err.splitlines() if "cohort nodes" in line]
        assert lines == ([] if quiet else [says])


@pytest.mark.parametrize("logical", [9, 9.0])
def test_a_cohort_nodes_clients_are_the_partitions_of_its_slot(logical):
    """``served_contexts``: slot 1 of 3 nodes with 9 logical clients (an
    integral float, as the server accepts it, too) serves partitions 1, 4, 7
    of 9; a node without logical clients, or with its own data file, is one
    client, itself."""
    from flwr.app import Context

    from fedaccel.apps.client_app import served_contexts

    def node(run_config, **node_config):
        return Context(run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": 3, **node_config},
                       state=RecordDict(), run_config=run_config)

    clients = served_contexts(node({"logical-clients": logical}))
    assert [(c.node_config["partition-id"], c.node_config["num-partitions"]) for c in clients] == [
        (1, 9), (4, 9), (7, 9)]
    assert [c.node_id for c in clients] == [logical_node_id(p) for p in (1, 4, 7)]
    beyond = Context(run_id=1, node_id=6, node_config={"partition-id": 10, "num-partitions": 12},
                     state=RecordDict(), run_config={"logical-clients": logical})
    assert served_contexts(beyond) == []  # slot 10 of 12 nodes: more nodes than the 9 clients
    for config, extra in (({"logical-clients": 0}, {}), ({}, {}), ({"logical-clients": True}, {}),
                          ({"logical-clients": logical}, {"data-path": "/data/own.npz"})):
        alone = node(config, **extra)
        assert served_contexts(alone) == [alone]


def test_prepare_clients_counts_cohort_nodes_clients_before_building_any(monkeypatch):
    """More logical clients than the runtime cache holds: ``prepare_clients``
    builds nothing, not even the logical clients' Contexts (it counts the
    partitions each node serves first); at the cap it builds each of them."""
    from flwr.app import Context

    import fedaccel.apps.client_app as ca

    built, runtimes = [], []
    real = ca._logical_context
    monkeypatch.setattr(ca, "_logical_context", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(ca, "pool_training_data", lambda contexts: None)
    monkeypatch.setattr(ca, "client_runtime", lambda context: runtimes.append(context))
    nodes = [Context(run_id=1, node_id=5 + slot, node_config={"partition-id": slot, "num-partitions": 2},
                     state=RecordDict(), run_config={"logical-clients": ca.RUNTIME_CACHE_SIZE + 1})
             for slot in range(2)]
    ca.prepare_clients(nodes)
    assert built == [] and runtimes == []
    for node in nodes:
        node.run_config["logical-clients"] = ca.RUNTIME_CACHE_SIZE
    ca.prepare_clients(nodes)
    assert sorted(built) == list(range(ca.RUNTIME_CACHE_SIZE))
    assert len(runtimes) == ca.RUNTIME_CACHE_SIZE


def test_the_fast_runner_builds_its_cohort_nodes_logical_clients_only(tmp_path, monkeypatch):
    """With ``logical-clients=12`` on 3 nodes the fast runner prepares (and
    decides how to train) the 12 logical clients: the dataset is split 12
    ways only, never 3 ways for the nodes' own contexts, which no client
    trains on."""
    import fedaccel.apps.client_app as ca

    splits = []
    real = ca.data_config_for
    monkeypatch.setattr(ca, "data_config_for", lambda cfg, n: splits.append(n) or real(cfg, n))
    _run(tmp_path, "split", 3, **{"algo": "fedavg", "logical-clients": 12, "num-server-rounds": 1,
                                  "cohort-batching": "on", "accl-every": 0})
    assert splits == [12]


def test_a_cohort_node_that_must_batch_and_cannot_says_why(tmp_path):
    """``cohort-batching='on'`` under flwr run, with a run the trainer cannot
    batch (FedPM refreshing its FOOF factors mid-round): the node answers its
    envelope with the fast runner's line (so every client's reply says it)."""
    from flwr.app import Context

    from fedaccel.apps.client_app import train_logical_clients

    config = fuse(default_run_config(), {"algo": "fedpm", "fedpm.refresh-every": 2, "logical-clients": 4,
                                         "cohort-batching": "on", "synthetic.max-samples": 80})
    kept = ConfigRecord({"v": 1})
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict({"client-0/earlier": kept}), run_config=config)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(p), "train")
                for p in (0, 2)]
    envelope = Message(pack_envelope(messages, 4), 5, "train.cohort")
    envelope.metadata.__dict__["_message_id"] = "env"
    reply = train_logical_clients(envelope, context)
    assert reply.has_error()
    assert ("cohort node 5 (slot 0): cohort-batching='on' but this run cannot be batched: fedpm.refresh-every=2"
            in reply.error.reason)
    assert list(context.state.keys()) == ["client-0/earlier"] and context.state["client-0/earlier"] is kept


def test_an_envelope_that_names_a_client_twice_is_refused_and_keeps_the_nodes_state():
    """Each client's state is read and kept once per envelope, so a node
    refuses an envelope with two messages for one client (only a server of
    another version would build one): its error reply says so, and nothing
    of the node's state changes."""
    from flwr.app import Context

    from fedaccel.apps.client_app import train_logical_clients

    config = fuse(default_run_config(), {"logical-clients": 4, "synthetic.max-samples": 80})
    kept = ConfigRecord({"v": 1})
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict({"client-2/earlier": kept}), run_config=config)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(p), "train")
                for p in (2, 0, 2)]
    envelope = Message(pack_envelope(messages, 4), 5, "train.cohort")
    envelope.metadata.__dict__["_message_id"] = "env"
    reply = train_logical_clients(envelope, context)
    assert reply.has_error() and "a cohort envelope carries two messages for client 2" in reply.error.reason
    assert list(context.state.keys()) == ["client-2/earlier"] and context.state["client-2/earlier"] is kept


def test_a_clients_second_message_of_one_send_goes_in_an_envelope_of_its_own(tmp_path, monkeypatch):
    """Two messages for one logical client in one send (Flower's strategies
    send one; a strategy of a user's may send more): the second goes in a
    further envelope to the same node, which SerialNodes sends once the
    first is answered, so each message of that client runs on the state the
    one before it left, in the order sent, and every message gets its own
    reply."""
    import fedaccel.apps.client_app as ca
    from fedaccel.cohort_nodes import INDEX

    def train(message, context):  # counts each client's messages in its own state
        seen = int(context.state["seen"]["n"]) + 1 if "seen" in context.state else 1
        context.state["seen"] = ConfigRecord({"n": seen})
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "seen": seen,
                                                            "tag": message.content["config"]["tag"]})}),
                       reply_to=message)

    monkeypatch.setattr(ca, "train", train)

    class Recording(LocalGrid):
        envelopes: list[tuple[int, list[int]]] = []

        def deliver(self, message):
            if message.metadata.message_type == "train.cohort":
                slot = int(self.contexts[message.metadata.dst_node_id].node_config["partition-id"])
                self.envelopes.append((slot, list(message.content[INDEX]["partitions"])))
            return super().deliver(message)

    run_config = fuse(default_run_config(), {"logical-clients": 6, "synthetic.max-samples": 60,
                                             "cohort-batching": "off", "results-dir": str(tmp_path),
                                             "run-name": "twice"})
    grid = Recording(client_app, run_config, num_clients=2, seed=0)
    view = CohortNodes(PromptGrid(SerialNodes(grid, give_up_after=1e9)), 6, query_timeout=5.0)
    list(view.get_node_ids())
    sent = [(0, 1), (2, 2), (0, 3), (3, 4), (0, 5)]  # (client, tag)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1, "tag": tag})}), logical_node_id(p),
                        "train") for p, tag in sent]
    replies = list(view.send_and_receive(messages, timeout=5.0))
    assert [parts for slot, parts in grid.envelopes if slot == 0] == [[0, 2], [0], [0]]
    assert sorted(grid.envelopes) == [(0, [0]), (0, [0]), (0, [0, 2]), (1, [3])]
    assert not any(r.has_error() for r in replies)
    by_id = {r.metadata.reply_to_message_id: r for r in replies}
    assert len(by_id) == len(messages)
    got = [(by_id[m.metadata.message_id].content["metrics"]["tag"], by_id[m.metadata.message_id].content["metrics"]["seen"])
           for m in messages]
    assert got == [(1, 1), (2, 1), (3, 2), (4, 1), (5, 3)]  # client 0's three messages in order, on its state


def test_one_clients_bug_fails_that_client_alone(monkeypatch):
    """An exception that is not a user error in one client of a slice (trained
    one after another) is that client's error reply, as on a node of its own;
    the node's other clients reply as usual."""
    from flwr.app import Context

    import fedaccel.apps.client_app as ca

    def train(message, context):
        if context.node_config["partition-id"] == 2:
            raise RuntimeError("boom")
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=message)

    monkeypatch.setattr(ca, "train", train)
    config = fuse(default_run_config(), {"logical-clients": 4, "synthetic.max-samples": 80,
                                         "cohort-batching": "off"})
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config=config)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(p), "train")
                for p in (0, 2)]
    for i, m in enumerate(messages):
        m.metadata.__dict__["_message_id"] = f"m{i}"
    envelope = Message(pack_envelope(messages, 4), 5, "train.cohort")
    envelope.metadata.__dict__["_message_id"] = "env"
    reply = ca.train_logical_clients(envelope, context)
    ok, failed = unpack_replies(reply.content, messages)
    assert not ok.has_error() and failed.has_error() and failed.error.reason == "RuntimeError: boom"
    assert reply.content["cohort-replies"]["note"].startswith("each node trains its clients one after another")


def test_a_bug_that_fails_a_whole_envelope_is_logged_as_the_cohort_nodes_slot(monkeypatch, caplog):
    """A bug outside any one client (here in the batched trainer itself) fails
    the cohort node's envelope on the in-process grid; its log line names the
    node and the slot it serves, not a client partition (a cohort node's
    ``partition-id`` is its slot)."""
    import logging

    import fedaccel.apps.client_app as ca
    import fedaccel.client_errors as client_errors

    def broken(*args, **kwargs):
        raise RuntimeError("shared step bug")

    monkeypatch.setattr(ca, "train_cohort", broken)
    monkeypatch.setattr(client_errors, "_RAISED", set())
    config = fuse(default_run_config(), {"logical-clients": 4, "synthetic.max-samples": 80, "cohort-batching": "on"})
    grid = LocalGrid(client_app, config, num_clients=2)
    node = next(n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 1)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(p), "train")
                for p in (1, 3)]
    envelope = Message(pack_envelope(messages, 4), node, "train.cohort")
    envelope.metadata.__dict__["_message_id"] = "env"
    caplog.set_level(logging.ERROR, logger="flwr")
    reply = grid.deliver(envelope)
    assert reply.has_error() and reply.error.reason == "RuntimeError: shared step bug"
    assert [r.getMessage() for r in caplog.records] == [f"[fedaccel] cohort node {node} (slot 1) raised"]
    # a client's own message on a node of its own keeps the partition wording
    assert client_errors.node_label(grid.contexts[node], messages[0]) == f"node {node} (partition 1)"


def test_a_user_error_that_fails_a_whole_envelope_names_the_cohort_nodes_slot():
    """A user error of the whole envelope (here: a node with a data-path of
    its own cannot serve logical clients) is the envelope's error reply,
    hence every client's; its line names the cohort node and the slot it
    serves, not "partition <slot>" (which would read as a client's)."""
    config = fuse(default_run_config(), {"logical-clients": 6, "synthetic.max-samples": 60})
    context = Context(run_id=1, node_id=77, node_config={"partition-id": 1, "num-partitions": 3,
                                                         "data-path": "/data/own.npz"},
                      state=RecordDict(), run_config=config)
    messages = [Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), logical_node_id(p), "train")
                for p in (1, 4)]
    envelope = Message(pack_envelope(messages, 6), 77, "train.cohort")
    envelope.metadata.__dict__["_message_id"] = "env"
    reply = train_logical_clients(envelope, context)
    assert reply.has_error() and reply.error.reason.startswith("cohort node 77 (slot 1): "), reply.error.reason
    assert "partition 1" not in reply.error.reason


def test_the_fast_runner_refuses_to_checkpoint_cohort_nodes(tmp_path):
    """A resumed fast run would rebuild its nodes with one client each (the
    checkpoint knows the clients, not the nodes): refused in one line."""
    from fedaccel.config import ConfigError

    with pytest.raises(ConfigError, match=r"logical-clients=12: the fast runner does not checkpoint cohort nodes"):
        _run(tmp_path, "ckpt", 3, **{"logical-clients": 12, "checkpoint-every": 1})
    assert not (tmp_path / "ckpt" / "checkpoints").exists()


# --------------------------------------------------------------------------- #
# faults: the two-sided state invariants
# --------------------------------------------------------------------------- #
class EnvelopeFaults(LocalGrid):
    """The fast runner's Grid as Flower's simulation with 3 nodes, with faults
    on the nodes' reply envelopes: ``faults[round]`` maps a node's slot to
    ``late`` (the envelope trains on a copy of the node's Context and its
    reply comes only after the next round, when :meth:`finish_late` writes
    that copy back as the node's Context: Flower's simulation keeps the
    Context of the worker that ends last), ``crash`` (an error reply: every
    client's reply is that error) or ``nan`` (its first client's reply
    carries non-finite values and is rejected), ``chunk-crash`` (the
    batched steps of the envelope's second chunk raise after its first
    chunk's clients trained and sealed their state: the envelope fails as a
    whole, and the node's Context keeps what the first chunk wrote, as the
    in-process grid's does) or ``chunk-crash-flower`` (the same, and the
    node's Context is the one from before the envelope, as Flower's
    simulation keeps it when a ClientApp raised) or ``lost`` (the node
    trained and kept its Context, and its reply is lost for good) or
    ``not-sent`` (the node never got it: SerialNodes' error reply
    :data:`fedaccel.grids.NOT_SENT` for a message that waited too long
    behind an earlier one).
    ``delivered``: the
    ``(round, slot)`` of every training envelope a node got."""

    def __init__(self, *args, faults, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.applied: list[tuple[int, int, str]] = []
        self.delivered: list[tuple[int, int]] = []
        self._late: list[tuple[int, Message, Context]] = []  # (round, reply, the late worker's Context)

    def deliver(self, message):
        if message.metadata.message_type != "train.cohort":
            return super().deliver(message)
        server_round = int(message.content["0/config"]["server-round"])
        context = self.contexts[message.metadata.dst_node_id]
        slot = int(context.node_config["partition-id"])
        self.delivered.append((server_round, slot))
        kind = self.faults.get(server_round, {}).get(slot)
        if kind == "late":  # a worker of its own, on a copy of the node's Context
            copy = Context(run_id=context.run_id, node_id=context.node_id, node_config=dict(context.node_config),
                           state=record_dict_from_bytes(record_dict_bytes(context.state.saved())),
                           run_config=context.run_config)
            reply = self.client_app(message, copy)
            reply.metadata.__dict__["_late"] = True
            self._late.append((server_round, reply, copy))
            self.applied.append((server_round, slot, kind))
            return reply
        if kind == "lost":
            reply = super().deliver(message)
            reply.metadata.__dict__["_late"] = True  # and never finished
            self.applied.append((server_round, slot, kind))
            return reply
        if kind in ("chunk-crash", "chunk-crash-flower"):
            return self._crash_in_second_chunk(message, context, server_round, slot, kind)
        if kind == "not-sent":  # SerialNodes' answer for a message it did not send
            self.applied.append((server_round, slot, kind))
            return Message(Error(ErrorCode.NODE_UNAVAILABLE, NOT_SENT), reply_to=message)
        reply = super().deliver(message)
        if kind is None:
            return reply
        self.applied.append((server_round, slot, kind))
        if kind == "crash":
            reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, "SuperNode died after training"), reply_to=message)
        elif kind == "nan":
            arrays = reply.content["0/arrays"]
            reply.content["0/arrays"] = ArrayRecord({k: Array(np.full(a.shape, np.nan, dtype=np.float32))
                                                     for k, a in arrays.items()})
        return reply

    def _crash_in_second_chunk(self, message, context, server_round, slot, kind):
        import fedaccel.clients.cohort as cohort

        before = record_dict_bytes(context.state.saved())
        train_stacked, calls = cohort.train_stacked, []

        def crashing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("out of memory in the second chunk")
            return train_stacked(*args, **kwargs)

        cohort.train_stacked = crashing
        try:
            reply = super().deliver(message)
        finally:
            cohort.train_stacked = train_stacked
        if len(calls) < 2:  # one client of this node in the round: nothing sealed before a crash
            return reply
        assert reply.has_error()
        if kind == "chunk-crash-flower":
            context.state.restore(record_dict_from_bytes(before))
        self.applied.append((server_round, slot, kind))
        return reply

    def finish_late(self, server_round: int) -> None:
        """The late envelopes of rounds before ``server_round`` end now: each
        one's Context replaces its node's (Flower's ``update_context``) and
        its reply can be pulled."""
        for late in [late for late in self._late if late[0] < server_round]:
            self._late.remove(late)
            _, reply, copy = late
            self.contexts[copy.node_id].state.restore(copy.state)
            reply.metadata.__dict__["_late"] = False
            self._replies[reply.metadata.reply_to_message_id] = reply

    def pull_messages(self, message_ids):
        return [r for r in super().pull_messages(message_ids) if not r.metadata.__dict__.get("_late")]


def logical_states(grid: EnvelopeFaults, strategy, cfg, name: str, num_clients: int) -> dict:
    """Every logical client's effective state (its node's context.state, its
    own keys, or its folder of ``client-state='disk'``), checked to be the
    version of the round the server applied."""
    node_of_slot = {int(c.node_config["partition-id"]): c for c in grid.contexts.values()}
    out = {}
    for pid in range(num_clients):
        if cfg.client_state == "disk":
            store = DiskState(state_run_dir(cfg.state_dir, grid.run.run_id) / f"client-{pid}")
        else:
            store = ContextState(client_state(node_of_slot[pid % len(node_of_slot)].state, pid))
        accepted = strategy.accepted_round.get(pid, 0)
        version = effective_version(store, accepted)
        assert version == accepted, f"client {pid}: the server applied round {accepted}, it holds {version}"
        tensors = store.read_version(version, name, "cpu")
        out[pid] = None if tensors is None else {k: v.double().numpy() for k, v in tensors.items()}
    return out


def run_checked(grid: EnvelopeFaults, run_config: dict, algo: str, num_clients: int, give_up_after: float,
                after_check=None) -> tuple[Experiment, list[int]]:
    """Run ``grid``'s federation as every run does (cohort nodes over
    PromptGrid over SerialNodes) and, after every round, check that each
    logical client holds the version the server applied and that the
    server's aggregate agrees with the clients' (:func:`invariant_error`);
    then ``after_check(round)``. Returns the experiment and the rounds checked."""
    cfg = parse_run_config(run_config)
    view = CohortNodes(PromptGrid(SerialNodes(grid, give_up_after=give_up_after)), num_clients, query_timeout=5.0)
    experiment = Experiment(cfg, discover_federation(view), quiet=True)
    x0: dict[str, np.ndarray] = {}
    checked_rounds: list[int] = []
    on_round_end = experiment.on_round_end

    def checked(server_round, arrays):
        out = on_round_end(server_round, arrays)
        model = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
        if server_round == 0:
            x0.update(model)
            return out
        states = logical_states(grid, experiment.strategy, cfg, STATE_NAME[algo], num_clients)
        invariant_error(algo, experiment.strategy, states, model, x0)
        checked_rounds.append(server_round)
        if after_check is not None:
            after_check(server_round)
        return out

    experiment.on_round_end = checked
    experiment.run(view)
    return experiment, checked_rounds


@pytest.mark.parametrize("algo,client_state_kind,stragglers", [
    ("scaffold", "context", False), ("fedcdr", "context", False), ("feddc", "disk", True),
    pytest.param("feddyn", "context", True, marks=pytest.mark.slow),
    pytest.param("fedrkmgc", "disk", False, marks=pytest.mark.slow),
    pytest.param("feddr", "context", True, marks=pytest.mark.slow),
    pytest.param("scaffold", "disk", True, marks=pytest.mark.slow)])
def test_invariants_hold_when_a_nodes_reply_is_late_an_error_or_partly_rejected(tmp_path, algo, client_state_kind,
                                                                                stragglers):
    """A late envelope (its reply after the next round, its Context written
    back then, as in Flower's simulation), a crashed node, an envelope not
    sent because its node was still busy (SerialNodes' error reply), an envelope whose
    second chunk's batched steps raised after its first chunk's clients
    sealed their state (its node's Context as the in-process grid keeps it,
    and as Flower's simulation does), one rejected client's reply (and,
    with ``stragglers``, a third of each round's clients dropped): after every round each logical client holds exactly the state
    version of the round the server applied, in its node's context or its
    folder, and the server's aggregate agrees with the clients' (SCAFFOLD's
    c = mean c_i, FedDC's c and drift sum, FedDyn's h = mean grad_prev_i,
    FedCDR's and FedDR's x = mean xhat_i; FedRKMGC keeps no server state:
    the version check is its invariant); no client loses its state, because
    a node with an envelope outstanding gets none in the next round
    (SerialNodes). Without that, the late worker's Context would overwrite
    what the node's clients trained in that round."""
    faults = {1: {1: "chunk-crash"}, 2: {0: "late", 2: "chunk-crash-flower"}, 3: {1: "crash"},
              4: {2: "nan", 0: "late"}, 5: {1: "chunk-crash", 2: "chunk-crash-flower"}, 6: {2: "not-sent"}}
    num_clients, rounds = 9, 6
    run_config = fuse(default_run_config(), {
        "algo": algo, "num-server-rounds": rounds, "clients-per-round": 6, "local-epochs": 1,
        "accl-every": 0, "synthetic.max-samples": 60, "client-state": client_state_kind,
        "state-dir": str(tmp_path / "state"),
        **({"straggler-fraction": 0.34, "straggler-policy": "drop"} if stragglers else {}),
        "logical-clients": num_clients, "results-dir": str(tmp_path / "results"), "run-name": algo,
        "round-timeout": 0.5, "cohort-batching": "on", "cohort-chunk": 1})
    grid = EnvelopeFaults(client_app, run_config, num_clients=3, seed=0, faults=faults)
    # a late envelope of the round before ends after each round's check
    experiment, checked_rounds = run_checked(grid, run_config, algo, num_clients, give_up_after=1e9,
                                             after_check=grid.finish_late)
    assert checked_rounds == list(range(1, rounds + 1))
    # each kind of fault happened (a fault on a node none of whose clients
    # were sampled that round has nothing to act on: FedCDR's reshuffled cohorts)
    assert {kind for *_, kind in grid.applied} == {"late", "crash", "nan", "chunk-crash", "chunk-crash-flower",
                                                   "not-sent"}
    # a message SerialNodes did not send failed each of its clients with its reason
    assert any(NOT_SENT in reason for reason in experiment.strategy.client_error_rounds)
    logs = experiment.strategy.rounds
    assert sum(log.rejected for log in logs.values()) == 1
    assert all(logs[r].failures >= 1 for r, _, _ in grid.applied)
    assert sum(log.state_lost for log in logs.values()) == 0
    assert (sum(log.dropped for log in logs.values()) >= 3) == stragglers
    # the round after a late envelope, its node got none, though clients it serves were sampled
    for late_round, slot, kind in grid.applied:
        if kind == "late" and late_round < rounds:
            assert any(p % 3 == slot for p in logs[late_round + 1].sampled)
            assert (late_round + 1, slot) not in grid.delivered


def test_a_node_whose_reply_is_lost_for_good_is_given_up_on_and_trains_again(tmp_path, caplog):
    """A cohort node trained its envelope and its reply never comes: the
    node gets no message while SerialNodes waits for it, then, once given
    up on (``GIVE_UP_ROUNDS`` round-timeouts after it was sent, as every run
    does), trains again; its clients roll the unapplied version back, and
    after every round both sides agree (SCAFFOLD's c = mean c_i and each
    client's state version), no state lost."""
    import logging

    from fedaccel.grids import GIVE_UP_ROUNDS

    algo, num_clients, rounds, lost_round = "scaffold", 9, 9, 2
    run_config = fuse(default_run_config(), {
        "algo": algo, "num-server-rounds": rounds, "clients-per-round": 6, "local-epochs": 1,
        "accl-every": 0, "synthetic.max-samples": 60, "logical-clients": num_clients,
        "results-dir": str(tmp_path / "results"), "run-name": algo, "round-timeout": 0.3})
    grid = EnvelopeFaults(client_app, run_config, num_clients=3, seed=0, faults={lost_round: {0: "lost"}})
    caplog.set_level(logging.WARNING, logger="flwr")
    experiment, checked_rounds = run_checked(grid, run_config, algo, num_clients,
                                             give_up_after=GIVE_UP_ROUNDS * parse_run_config(run_config).round_timeout)
    assert checked_rounds == list(range(1, rounds + 1))
    assert grid.applied == [(lost_round, 0, "lost")]
    assert any("given up on, it takes messages again" in r.getMessage() for r in caplog.records)
    logs = experiment.strategy.rounds
    assert sum(log.state_lost for log in logs.values()) == 0
    after = [r for r, slot in grid.delivered if slot == 0 and r > lost_round]
    assert after, "node 0 never trained again after its reply was lost"
    # while it was waited for it got nothing, though its clients were sampled
    skipped = [r for r in range(lost_round + 1, after[0]) if any(p % 3 == 0 for p in logs[r].sampled)]
    assert skipped
    # its clients that trained again hold the version the server applied (checked every round above)
    assert any(logs[r].failures == 0 for r in after)


@pytest.mark.parametrize("client_state_kind", ["context", "disk"])
def test_a_restarted_cohort_node_loses_its_clients_context_state_alone(tmp_path, caplog, client_state_kind):
    """A cohort node restarted after round 2 (its Context's state empty, as a
    SuperNode that came back with client-state='context'): each of its
    clients that had trained reports its state lost the next time it trains,
    once, and no client of another node does; with client-state='disk' the
    state is in the clients' folders and nothing is lost."""
    import re

    class Restarting(LocalGrid):
        def deliver(self, message):
            if message.metadata.message_type == "train.cohort":
                server_round = int(message.content["0/config"]["server-round"])
                context = self.contexts[message.metadata.dst_node_id]
                if server_round == 3 and context.node_config["partition-id"] == 1 and not self.restarted:
                    context.state.restore(RecordDict())
                    self.restarted = True
            return super().deliver(message)

    num_clients, rounds = 9, 6
    run_config = fuse(default_run_config(), {
        "algo": "fedcdr", "num-server-rounds": rounds, "clients-per-round": 6, "local-epochs": 1,
        "accl-every": 0, "synthetic.max-samples": 60, "client-state": client_state_kind,
        "state-dir": str(tmp_path / "state"), "logical-clients": num_clients,
        "results-dir": str(tmp_path / "results"), "run-name": client_state_kind})
    grid = Restarting(client_app, run_config, num_clients=3, seed=0)
    grid.restarted = False
    view = CohortNodes(PromptGrid(SerialNodes(grid, give_up_after=1e9)), num_clients, query_timeout=5.0)
    experiment = Experiment(parse_run_config(run_config), discover_federation(view), quiet=True)
    trained_before: set[int] = set()
    on_round_end = experiment.on_round_end

    def noted(server_round, arrays):
        if server_round == 2:
            trained_before.update(p for p, r in experiment.strategy.accepted_round.items() if r > 0)
        return on_round_end(server_round, arrays)

    experiment.on_round_end = noted
    experiment.run(view)
    assert grid.restarted
    logs = experiment.strategy.rounds
    lost = [int(p) for p in re.findall(r"client (\d+) had lost its fedcdr state", caplog.text)]
    if client_state_kind == "disk":
        assert lost == [] and sum(log.state_lost for log in logs.values()) == 0
        return
    # the restarted node's clients that had trained, each the first time it trained again
    expected = sorted(p for p in trained_before if p % 3 == 1
                      and any(p in logs[r].sampled for r in range(3, rounds + 1)))
    assert expected and sorted(lost) == expected
    assert sum(log.state_lost for log in logs.values()) == len(expected)
