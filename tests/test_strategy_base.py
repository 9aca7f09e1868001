"""The strategy mixin every algorithm shares (``fedaccel/strategies/base.py``,
``FedAccelStrategy``): replies ordered before aggregation, byte and failure
accounting, seeded sampling and ``configure_train``, the evaluation (ACCL)
path, and malformed replies rejected instead of aggregated.

Strategies are built through the registry (``spec.build_strategy``); replies
are real Flower ``Message`` objects built as ``reply_to`` the instructions
the strategy made.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fakes import NODES, StubGrid, arrays, build, by_node, configure, eval_record, reply
from fedaccel.errors import RoundFailedError
from fedaccel.samplers import uniform_cohort
from fedaccel.torch_utils import payload_bytes

pytestmark = pytest.mark.usefixtures("server_identity")


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #

def error_reply(instruction: Message, reason: str | None = "ValueError: boom") -> Message:
    return Message(Error(4, reason), reply_to=instruction)


# --------------------------------------------------------------------------- #
# replies are ordered before aggregation
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("algo", ["fedavg", "fedprox", "fedavgm", "fedadam"])
def test_reply_order_does_not_change_aggregate(algo):
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(64).astype(np.float32)
    models = [rng.standard_normal(64).astype(np.float32) * 10 ** i for i in range(3)]
    counts = [3, 7, 11]
    results = set()
    for perm in itertools.permutations(range(3)):
        strategy = build(algo)
        msgs = by_node(configure(strategy, 1, ArrayRecord({"w": Array(x0)})))
        replies = [
            Message(RecordDict({
                "arrays": ArrayRecord({"w": Array(models[pid])}),
                "metrics": MetricRecord({"num-examples": counts[pid], "train-loss": 0.1 * pid}),
            }), reply_to=msgs[NODES[pid]])
            for pid in perm
        ]
        out, metrics = strategy.aggregate_train(1, replies)
        results.add((out["w"].numpy().tobytes(), metrics["train-loss"]))
    assert len(results) == 1


def test_flower_alone_is_order_sensitive_on_this_data():
    """Guard for the test above: its data would expose unordered summation."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    rng = np.random.default_rng(7)
    rng.standard_normal(64)
    models = [rng.standard_normal(64).astype(np.float32) * 10 ** i for i in range(3)]
    counts = [3, 7, 11]
    records = [RecordDict({"arrays": ArrayRecord({"w": Array(models[i])}),
                           "metrics": MetricRecord({"num-examples": counts[i]})})
               for i in range(3)]
    outs = {aggregate_arrayrecords([records[i] for i in perm], "num-examples")["w"]
            .numpy().tobytes() for perm in itertools.permutations(range(3))}
    assert len(outs) > 1


# --------------------------------------------------------------------------- #
# byte accounting and failures
# --------------------------------------------------------------------------- #
def test_bytes_and_failure_accounting():
    strategy = build("fedavg")
    sent = arrays(w=np.zeros((4, 3)), b=np.zeros(3))
    msgs = configure(strategy, 1, sent)
    assert len(msgs) == 3
    per_message = sum(len(a.data) for a in sent.values())
    assert per_message > 0
    assert strategy.rounds[1].bytes_down == 3 * per_message

    nodes = by_node(msgs)
    ok1 = reply(nodes[101], 5, w=np.ones((4, 3)), b=np.ones(3))
    ok2 = reply(nodes[102], 5, w=np.ones((4, 3)), b=np.ones(3))
    bad = error_reply(nodes[103])
    expected_up = sum(len(a.data) for m in (ok1, ok2)
                      for rec in m.content.array_records.values() for a in rec.values())
    assert expected_up == payload_bytes(ok1.content["arrays"]) + payload_bytes(ok2.content["arrays"])
    strategy.aggregate_train(1, [bad, ok1, ok2])
    log = strategy.rounds[1]
    assert log.bytes_up == expected_up
    assert log.replies == 2
    assert log.failures == 1
    assert log.bytes_down == 3 * per_message  # aggregation does not touch downlink bytes


@pytest.mark.parametrize("algo", ["fedavg", "fedavgm", "fedadam"])
def test_aggregated_replies_hold_no_arrays_afterwards_and_the_model_is_the_same(algo):
    """Flower's ``start`` keeps a round's replies alive through the next
    round; ``aggregate_train`` drops their arrays once it has used them
    (metrics stay), and the model it returns is the one it returned before."""
    import gc
    import weakref

    import fedaccel.strategies.base as base_module

    def round_of(release):
        strategy = build(algo)
        msgs = by_node(configure(strategy, 1, arrays(w=np.zeros((4, 3)), b=np.zeros(3))))
        replies = [reply(msgs[node], 3 + i, w=np.full((4, 3), float(i + 1)), b=np.full(3, -float(i)))
                   for i, node in enumerate((101, 102))]
        watched = weakref.ref(replies[0].content["arrays"]["w"])
        if release:
            out = strategy.aggregate_train(1, replies)
        else:
            with base_module.views_reused():
                out = strategy._aggregate_train(1, list(replies))
        return out, replies, watched

    (model, metrics), replies, watched = round_of(release=True)
    gc.collect()
    assert all(not any(isinstance(rec, ArrayRecord) for rec in r.content.values()) for r in replies)
    assert [int(r.content["metrics"]["num-examples"]) for r in replies] == [3, 4]
    assert watched() is None  # nothing else kept the reply's arrays
    (kept, kept_metrics), kept_replies, kept_watched = round_of(release=False)
    assert all("arrays" in r.content for r in kept_replies) and kept_watched() is not None
    assert list(model.keys()) == list(kept.keys())
    assert all(model[k].data == kept[k].data for k in model.keys()) and dict(metrics) == dict(kept_metrics)


def test_all_replies_failing_names_the_round():
    strategy = build("fedavg")
    msgs = configure(strategy, 4, arrays(w=[0.0]))
    replies = [error_reply(m, "Traceback ...\nValueError: out of memory") for m in msgs]
    with pytest.raises(RoundFailedError) as info:
        strategy.aggregate_train(4, replies)
    msg = str(info.value)
    assert "round 4" in msg
    assert "ValueError: out of memory" in msg
    assert "\n" not in msg
    assert strategy.rounds[4].failures == 3 and strategy.rounds[4].replies == 0


def test_no_reply_at_all_is_a_round_failure():
    strategy = build("fedavg")
    configure(strategy, 2, arrays(w=[0.0]))
    with pytest.raises(RoundFailedError, match="round 2"):
        strategy.aggregate_train(2, [])


@pytest.mark.parametrize("reason", [None, ""])
def test_all_replies_failing_without_reason(reason):
    strategy = build("fedavg")
    msgs = configure(strategy, 3, arrays(w=[0.0]))
    with pytest.raises(RoundFailedError, match="round 3"):
        strategy.aggregate_train(3, [error_reply(m, reason) for m in msgs])


# --------------------------------------------------------------------------- #
# sampling and configure_train
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("algo", ["fedavg", "fedprox", "fedavgm", "fedadam"])
def test_configure_train_sends_to_sampled_partitions(algo):
    nodes = {pid: 1000 + 7 * pid for pid in range(10)}
    strategy = build(algo, nodes=nodes, lr=0.03, **{"local-epochs": 4})
    for server_round in (1, 2, 3):
        msgs = configure(strategy, server_round, arrays(w=[0.0]), nodes=nodes)
        cohort = uniform_cohort(strategy.run_cfg.seed, server_round, 10, 3)
        assert strategy.rounds[server_round].sampled == cohort
        assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(nodes[p] for p in cohort)
        for m in msgs:
            assert m.metadata.message_type == "train"
            config = m.content["config"]
            assert config["lr"] == pytest.approx(0.03)
            assert config["local-epochs"] == 4
            assert config["server-round"] == server_round
            if algo == "fedprox":
                assert config["proximal-mu"] == pytest.approx(strategy.run_cfg.algo_params.mu)
            else:
                assert "proximal-mu" not in config


# --------------------------------------------------------------------------- #
# evaluation (ACCL)
# --------------------------------------------------------------------------- #
def test_configure_evaluate_only_on_accl_rounds():
    strategy = build("fedavg", **{"num-server-rounds": 12, "accl-every": 5})
    grid = StubGrid(NODES.values())
    for server_round in (1, 4, 6, 11):
        assert list(strategy.configure_evaluate(server_round, arrays(w=[0.0]), ConfigRecord(),
                                                grid)) == []
    for server_round in (5, 10, 12):
        msgs = list(strategy.configure_evaluate(server_round, arrays(w=[0.0]), ConfigRecord(),
                                                grid))
        assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(NODES.values())
        assert all(m.metadata.message_type == "evaluate" for m in msgs)
        assert all(m.content["config"]["server-round"] == server_round for m in msgs)


def test_configure_evaluate_disabled_with_accl_every_zero():
    strategy = build("fedavg", **{"num-server-rounds": 3, "accl-every": 0})
    for server_round in (1, 2, 3):
        assert list(strategy.configure_evaluate(server_round, arrays(w=[0.0]), ConfigRecord(),
                                                StubGrid(NODES.values()))) == []


def test_aggregate_evaluate_records_accl():
    strategy = build("fedavg", **{"num-server-rounds": 10, "accl-every": 5})
    msgs = list(strategy.configure_evaluate(5, arrays(w=[0.0]), ConfigRecord(),
                                            StubGrid(NODES.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"e{i}"
    values = {101: (10, 0.2, 1.0), 102: (20, 0.4, 1.0), 103: (0, float("nan"), float("nan"))}
    replies = [Message(eval_record(*values[m.metadata.dst_node_id]), reply_to=m) for m in msgs]
    metrics = strategy.aggregate_evaluate(5, replies)
    assert metrics["accl"] == pytest.approx(0.3)
    assert metrics["num-clients"] == 2
    assert strategy.rounds[5].accl == pytest.approx(0.3)


def test_no_client_with_a_local_test_sample_is_said_once_not_left_silent(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="flwr")
    strategy = build("fedavg", **{"num-server-rounds": 10, "accl-every": 5})
    for server_round in (5, 10):
        msgs = list(strategy.configure_evaluate(server_round, arrays(w=[0.0]), ConfigRecord(),
                                                StubGrid(NODES.values())))
        for i, m in enumerate(msgs):
            m.metadata.__dict__["_message_id"] = f"e{server_round}-{i}"
        replies = [Message(eval_record(0, float("nan"), float("nan")), reply_to=m) for m in msgs]
        assert "accl" not in strategy.aggregate_evaluate(server_round, replies)
    told = [r.getMessage() for r in caplog.records if "no ACCL" in r.getMessage()]
    assert told == ["round 5: no ACCL (accl stays empty): none of the 3 clients that answered has a local test "
                    "sample (a client's local test split is round(samples x local-test-fraction=0.2)); raise "
                    "local-test-fraction or give the clients more samples"]


# --------------------------------------------------------------------------- #
# malformed replies are rejected with a reason, never aggregated


def raw_reply(instruction: Message, record: ArrayRecord, n: int = 1) -> Message:
    content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": n})})
    return Message(content, reply_to=instruction)


@pytest.mark.parametrize("bad, reason", [
    ({"w2": [9.0]}, "keys"),
    ({"w": [9.0, 9.0, 9.0]}, "shape"),
    ({"w": [float("nan")]}, "non-finite"),
    ({"w": [float("inf")]}, "non-finite"),
    ({"w": [-float("inf")]}, "non-finite"),
])
def test_malformed_reply_is_rejected_not_aggregated(bad, reason, caplog):
    strategy = build("fedavg")
    msgs = configure(strategy, 1, arrays(w=[0.0]))
    good = [reply(m, n=1, w=[2.0]) for m in msgs[:-1]]
    new, _ = strategy.aggregate_train(1, good + [raw_reply(msgs[-1], arrays(**bad))])
    np.testing.assert_allclose(new["w"].numpy(), [2.0])
    assert strategy.rounds[1].rejected == 1 and strategy.rounds[1].failures == 1
    assert reason in caplog.text


@pytest.mark.parametrize("bad, wanted", [
    ([{"w": [float("nan")]}] * 3,
     "3 replies rejected for NaN or inf values: their local training diverged, so lower lr or set clip-norm"),
    ([{"w": [float("inf")]}, {"w": [float("nan")]}, {"w2": [1.0]}], "3 malformed replies rejected"),
])
def test_a_round_whose_replies_all_diverged_says_so(bad, wanted):
    """Every reply rejected for NaN or inf values (too large a step): the
    round's error says the training diverged and what to change; any other
    rejection among them keeps the plain count."""
    from fedaccel.errors import RoundFailedError

    strategy = build("fedavg")
    msgs = configure(strategy, 1, arrays(w=[0.0]))
    assert len(msgs) == len(bad)
    with pytest.raises(RoundFailedError) as info:
        strategy.aggregate_train(1, [raw_reply(m, arrays(**b)) for m, b in zip(msgs, bad)])
    assert str(info.value) == f"round 1: all 3 sampled clients failed ({wanted})"


@pytest.mark.parametrize("on_device", [False, True], ids=["host-stacks", "device-stacks"])
def test_replies_that_are_rows_of_a_stack_are_checked_and_averaged_as_the_plain_ones(on_device, monkeypatch):
    """Replies whose arrays are rows of the cohort trainer's stacks
    (``StackedRows``), one row with a NaN: that reply alone is rejected by
    the stack's per-row flags, and the model is the same bits as from the
    same replies as plain Arrays, with the mean on the stacks' "device"
    (forced on the CPU) or in the NumPy loop."""
    import torch

    from fedaccel.arrays import StackedRows, arrays_to_record, deferred_row, from_numpy

    if on_device:
        monkeypatch.setattr(StackedRows, "on_device", property(lambda self: True))
    generator = torch.Generator().manual_seed(11)

    def aggregate(stacked: bool):
        strategy = build("fedavg")
        msgs = configure(strategy, 1, arrays(w=[0.0, 0.0, 0.0], b=[0.0]))
        w, b = torch.randn(len(msgs), 3, generator=generator), torch.randn(len(msgs), 1, generator=generator)
        w[1, 2] = float("nan")
        rows = {"w": StackedRows(w), "b": StackedRows(b)}
        records = [arrays_to_record((k, deferred_row(rows[k], c) if stacked else from_numpy(rows[k].tensor[c].numpy()))
                                    for k in ("w", "b")) for c in range(len(msgs))]
        new, _ = strategy.aggregate_train(1, [raw_reply(m, r, n=c + 1) for c, (m, r) in enumerate(zip(msgs, records))])
        assert strategy.rounds[1].rejected == 1 and strategy.rounds[1].replies == len(msgs) - 1
        return {k: new[k].numpy().tobytes() for k in ("w", "b")}

    state = generator.get_state()
    plain = aggregate(stacked=False)
    generator.set_state(state)
    assert aggregate(stacked=True) == plain


@pytest.mark.parametrize("algo", ["fedavg", "scaffold"])
def test_two_replies_from_one_client_in_a_round_are_both_rejected(algo, caplog):
    """A strategy that sent one client two messages gets two replies from it;
    the client keeps the state of the one it trained last, which the server
    cannot tell apart, so neither is applied (its accepted round stays, the
    client rolls back): SCAFFOLD's ``c`` does not count its ``dc`` twice."""
    strategy = build(algo)
    msgs = configure(strategy, 1, arrays(w=[0.0]))
    records = {"scaffold.dc": arrays(w=[1.0])} if algo == "scaffold" else {}

    def answer(m: Message, value: float) -> Message:
        content = RecordDict({"arrays": arrays(w=[value]), "metrics": MetricRecord({"num-examples": 1}), **records})
        return Message(content, reply_to=m)

    twice = Message(msgs[-1].content, msgs[-1].metadata.dst_node_id, msgs[-1].metadata.message_type)
    twice.metadata.__dict__["_message_id"] = "second"
    replies = [answer(m, 2.0) for m in msgs] + [answer(twice, 9.0)]
    new, _ = strategy.aggregate_train(1, replies)
    np.testing.assert_allclose(new["w"].numpy(), [2.0])
    assert strategy.rounds[1].rejected == 2 and strategy.rounds[1].replies == len(msgs) - 1
    assert "2 replies from this client in one round" in caplog.text
    pid = strategy.federation.partition_of_node[msgs[-1].metadata.dst_node_id]
    assert strategy.accepted_round.get(pid, 0) == 0
    assert all(strategy.accepted_round[strategy.federation.partition_of_node[m.metadata.dst_node_id]] == 1
               for m in msgs[:-1])
    if algo == "scaffold":  # c = sum of the applied dc / N
        np.testing.assert_allclose(strategy.c["w"], [(len(msgs) - 1) / strategy.federation.num_clients])


def test_zero_examples_reply_is_rejected():
    strategy = build("fedavg")
    msgs = configure(strategy, 1, arrays(w=[0.0]))
    good = [reply(m, n=1, w=[2.0]) for m in msgs[:-1]]
    new, _ = strategy.aggregate_train(1, good + [reply(msgs[-1], n=0, w=[9.0])])
    np.testing.assert_allclose(new["w"].numpy(), [2.0])


def test_missing_replies_count_as_failures_and_all_missing_stops():
    strategy = build("fedavg")
    msgs = configure(strategy, 1, arrays(w=[0.0]))
    new, _ = strategy.aggregate_train(1, [reply(msgs[0], n=1, w=[3.0])])
    np.testing.assert_allclose(new["w"].numpy(), [3.0])
    assert strategy.rounds[1].failures == len(msgs) - 1
    configure(strategy, 2, new)
    with pytest.raises(RoundFailedError, match="no reply within round-timeout"):
        strategy.aggregate_train(2, [])


def test_messages_bytes_counts_every_message_and_measures_a_shared_record_once(monkeypatch):
    """The payload of a round's messages: a record several messages share
    (FedAvg's one content) counts once per message, as it crosses the wire
    once per message; it is only measured once."""
    import numpy as np
    from flwr.app import Message, RecordDict

    from fedaccel.arrays import numpy_to_record
    from fedaccel.strategies import base as base_module

    shared = numpy_to_record({"w": np.zeros((3, 4), np.float32)})
    own = numpy_to_record({"w": np.zeros(5, np.float64), "b": np.ones(2, np.float32)})
    content = RecordDict({"arrays": shared})
    messages = [Message(content, 7, "train"), Message(content, 8, "train"),
                Message(RecordDict({"arrays": shared, "extra": own}), 9, "train")]
    measured = []
    real = base_module.payload_bytes
    monkeypatch.setattr(base_module, "payload_bytes", lambda rec: measured.append(id(rec)) or real(rec))
    expected = 3 * sum(len(a.data) for a in shared.values()) + sum(len(a.data) for a in own.values())
    assert base_module.messages_bytes(messages) == expected
    assert sorted(measured) == sorted([id(shared), id(own)])
    assert base_module.messages_bytes([]) == 0
    # a generator of messages made and dropped one by one: each record measured as its own
    fresh = (Message(RecordDict({"arrays": numpy_to_record({"w": np.zeros(n, np.float32)})}), 7, "train")
             for n in (1, 50, 3))
    assert base_module.messages_bytes(fresh) == sum(
        len(numpy_to_record({"w": np.zeros(n, np.float32)})["w"].data) for n in (1, 50, 3))


def test_a_shape_mismatch_is_found_after_a_reply_that_matched():
    """The sent model's layout is cached per round: a later reply with one
    wrong shape is still rejected, and a new round's model is compared anew."""
    strategy = build("fedavg")
    msgs = configure(strategy, 1, arrays(w=[0.0], b=[0.0, 0.0]))
    assert strategy.reply_problem(reply(msgs[0], n=1, w=[1.0], b=[1.0, 1.0])) is None
    assert "shape" in strategy.reply_problem(reply(msgs[1], n=1, w=[1.0], b=[1.0, 1.0, 1.0]))
    msgs = configure(strategy, 2, arrays(w=[0.0, 0.0], b=[0.0, 0.0]))
    assert strategy.reply_problem(reply(msgs[0], n=1, w=[1.0, 2.0], b=[1.0, 1.0])) is None
    assert "shape" in strategy.reply_problem(reply(msgs[1], n=1, w=[1.0], b=[1.0, 1.0]))
