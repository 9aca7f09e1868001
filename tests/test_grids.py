"""fedaccel/grids.py: PromptGrid notices replies without Flower's fixed sleeps,
SerialNodes keeps a node to one message at a time (on a fake clock, so no
test waits)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

import fedaccel.grids as grids
from fakes import StubGrid
from fedaccel.grids import NodeSubset, PromptGrid, SerialNodes

pytestmark = pytest.mark.usefixtures("server_identity")


class _FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _DelayedGrid(StubGrid):
    """Replies to message i become available ``ready[i]`` seconds after the push."""

    def __init__(self, ready: list[float], clock: _FakeClock) -> None:
        super().__init__(range(1, len(ready) + 1))
        self.ready, self.clock, self._pushed = ready, clock, {}

    def push_messages(self, messages):
        ids = []
        for i, m in enumerate(messages):
            mid = f"m{i}"
            m.metadata.__dict__["_message_id"] = mid
            self._pushed[mid] = (m, self.clock.now + self.ready[i])
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in message_ids:
            m, at = self._pushed[mid]
            if self.clock.now >= at:
                out.append(Message(RecordDict({"metrics": MetricRecord({"i": int(mid[1:])})}), reply_to=m))
                del self._pushed[mid]
        return out

    def send_and_receive(self, messages, *, timeout=None):  # Flower's grids sleep 0.1-3 s between pulls
        raise AssertionError("PromptGrid must not call the wrapped send_and_receive")


def _queries(n, kind="query"):
    return [Message(RecordDict({"config": ConfigRecord()}), node, kind) for node in range(1, n + 1)]


def test_prompt_grid_returns_every_reply_soon_after_it_arrives(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _DelayedGrid([0.0, 0.05, 2.0], clock)
    replies = list(PromptGrid(grid, max_interval=0.1).send_and_receive(_queries(3), timeout=None))
    assert [int(r.content["metrics"]["i"]) for r in replies] == [0, 1, 2]
    assert clock.sleeps[0] == 0.005 and max(clock.sleeps) == 0.1  # back-off from 5 ms to the cap
    assert 2.0 <= clock.now < 2.0 + 0.1  # at most one interval late (Flower's sleep: 0.1-3 s)


@pytest.mark.parametrize("arrives", [0.003, 0.07, 0.4, 0.95])
def test_prompt_grid_collects_a_reply_within_a_tenth_of_the_time_waited(monkeypatch, arrives):
    """A reply that arrives ``arrives`` seconds after the push is collected
    at most 5 ms plus a tenth of that later (the back-off grows by a tenth:
    grown by half, a reply at 0.07 s was collected at 0.104 s), with no
    more pulls than that back-off makes."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    replies = list(PromptGrid(_DelayedGrid([arrives], clock)).send_and_receive(_queries(1), timeout=None))
    assert len(replies) == 1
    assert arrives <= clock.now <= arrives * 1.1 + 0.005 + 1e-9
    assert len(clock.sleeps) <= 36  # about 31 waits to reach the 0.1 s cap in the first second


def test_prompt_grid_stops_at_the_timeout_with_what_arrived(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _DelayedGrid([0.0, 5.0], clock)
    replies = list(PromptGrid(grid).send_and_receive(_queries(2), timeout=0.3))
    assert [int(r.content["metrics"]["i"]) for r in replies] == [0]
    assert clock.now == pytest.approx(0.3)  # the last sleep is cut to the deadline


def test_node_subset_shows_only_the_chosen_nodes():
    grid = StubGrid([1, 2, 3])
    assert list(NodeSubset(grid, [3, 1]).get_node_ids()) == [3, 1]
    assert list(grid.get_node_ids()) == [1, 2, 3]


class _TimedGrid(StubGrid):
    """A node answers each message ``delay[node]`` seconds (as it was when
    the message was pushed; None: never) after it was pushed, or with the
    SuperLink's error reply once :meth:`fail_in_flight`; ``pushed``: the node
    of every message pushed, in order."""

    def __init__(self, clock: _FakeClock, delay: dict) -> None:
        super().__init__(sorted(delay))
        self.clock, self.delay, self.errors = clock, dict(delay), set()
        self.pushed: list[int] = []
        self._held: dict[str, tuple[Message, float, float | None]] = {}
        self._count = 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self._count += 1
            m.metadata.__dict__["_message_id"] = f"id{self._count}"
            self._held[m.metadata.message_id] = (m, self.clock.now, self.delay[m.metadata.dst_node_id])
            self.pushed.append(m.metadata.dst_node_id)
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in message_ids:
            if mid not in self._held:
                continue
            m, at, delay = self._held[mid]
            node = m.metadata.dst_node_id
            if mid in self.errors:
                del self._held[mid]
                out.append(Message(Error(ErrorCode.NODE_UNAVAILABLE, "node offline"), reply_to=m))
            elif delay is not None and self.clock.now >= at + delay:
                del self._held[mid]
                out.append(Message(RecordDict({"metrics": MetricRecord({"node": node, "sent": at})}), reply_to=m))
        return out

    def fail_in_flight(self, node: int) -> None:
        self.errors.update(mid for mid, (m, _, _) in self._held.items() if m.metadata.dst_node_id == node)


def _send(view, nodes, timeout=1.0, kind="query"):
    """One send_and_receive of a message (of type ``kind``) to each of
    ``nodes``; the nodes that replied, and each reply's message checked to
    be the one it answers (error replies: ``view.last_errors``)."""
    messages = _queries(max(nodes), kind)
    messages = [messages[n - 1] for n in nodes]
    replies = list(view.send_and_receive(messages, timeout=timeout))
    by_id = {m.metadata.message_id: m for m in messages}
    for r in replies:  # a reply answers one of this call's messages, by the id the caller knows
        asked = by_id[r.metadata.reply_to_message_id]
        assert r.has_error() or asked.metadata.dst_node_id == int(r.content["metrics"]["node"])
    view.last_errors = {by_id[r.metadata.reply_to_message_id].metadata.dst_node_id: r.error.reason
                        for r in replies if r.has_error()}
    return sorted(int(r.content["metrics"]["node"]) for r in replies if not r.has_error())


def test_a_nodes_next_message_waits_until_it_answered_the_last(monkeypatch):
    """Node 2 answers after 1.5 s, past the 1 s timeout: the next round's
    message for it (a round of 2.5 s) is not pushed at once but when its
    late reply has come (dropped, not returned), with 2 s of that round
    left, more than the node took, and answered within that round; the other
    nodes go on as usual."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 1.5, 3: 0.01})
    view = PromptGrid(SerialNodes(grid, give_up_after=3.0))
    assert _send(view, [1, 2, 3]) == [1, 3]
    assert view._grid.busy_nodes == {2} and grid.pushed == [1, 2, 3]
    grid.delay[2] = 0.2  # for the messages pushed from now on
    assert _send(view, [1, 2, 3], timeout=2.5) == [1, 2, 3]  # its late reply is not among them
    assert grid.pushed == [1, 2, 3, 1, 3, 2]  # node 2's message pushed after the others, once it was free
    assert clock.now == pytest.approx(1.7, abs=0.2)  # late reply in at t=1.5, the new one 0.2 s after its push
    assert view._grid.busy_nodes == set()


def test_a_waiting_message_with_less_of_its_round_left_than_its_node_took_is_not_sent(monkeypatch, caplog):
    """Node 2 answers its first message after 1.5 s (timeout 1 s), later
    ones after 0.9 s. Freed 0.5 s into the next round, which has less left
    than the 1.5 s it took: that round's message is not sent (pushed, it
    would be late too and keep the node busy into the round after, and so
    on); from the round after on, pushed at the round's start, it answers
    in time. The message of a round whose deadline has passed is never sent."""
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 1.5})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    got, lasted, errors = [], [], []
    for r in range(5):
        if r == 1:
            grid.delay[2] = 0.9
        clock.now += 0.02  # the server's work between rounds
        start = clock.now
        got.append(_send(view, [1, 2]))
        lasted.append(clock.now - start)
        errors.append(view.last_errors)
    assert got == [[1], [1], [1, 2], [1, 2], [1, 2]]
    assert grid.pushed == [1, 2, 1, 1, 2, 1, 2, 1, 2]  # round 1's message for node 2 never went out
    # it is answered at once with an error saying why, so that round ends when node 2 is free (1.5 s)
    assert errors[1] == {2: grids.NOT_SENT} and errors[2:] == [{}, {}, {}]
    assert lasted[1] == pytest.approx(0.48, abs=0.05)
    assert "node 2 became free with 0.5 s of this round left; it took 1.5 s or more" in caplog.text


def test_a_waiting_message_whose_round_ends_is_not_sent(monkeypatch):
    """Node 2 never answers within the next round either: that round's
    message for it waits the whole round and is dropped unsent; every
    message of a round can wait so, and the round then ends at its timeout
    with no reply rather than at once."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 10.0})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    assert _send(view, [1, 2]) == [1]
    start = clock.now
    assert _send(view, [2]) == []
    assert clock.now - start == pytest.approx(1.0)  # waited for it until the timeout
    assert grid.pushed == [1, 2]  # the second message for node 2 was never sent
    clock.now = 11.0  # node 2's first reply is in: nothing of it is sent later either
    assert _send(view, [1]) == [1] and grid.pushed == [1, 2, 1]


def test_an_error_reply_or_a_reply_lost_for_good_frees_the_node(monkeypatch, caplog):
    """The SuperLink's error reply for a message in flight (node offline)
    frees its node; a message never answered is given up on
    ``give_up_after`` seconds after it was pushed, not before."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: None, 3: None})
    serial = SerialNodes(grid, give_up_after=20.0)
    view = PromptGrid(serial)
    assert _send(view, [1, 2, 3], timeout=10.0) == [1]  # pushed at t=0
    assert serial.busy_nodes == {2, 3}
    grid.fail_in_flight(3)  # the SuperLink answers node 3's message: node offline
    grid.delay.update({2: 0.01, 3: 0.01})
    clock.now = 19.0
    grid.pushed.clear()
    assert _send(view, [1, 2, 3], timeout=0.5) == [1, 3]  # node 3 free again: its new message answered
    assert grid.pushed == [1, 3] and serial.busy_nodes == {2}  # node 2's not sent: 19.5 s < 20 s
    assert "node 3: a message of an earlier round ended with an error (node offline)" in caplog.text
    clock.now = 20.0  # 20 s after node 2's message was pushed: given up on at the first pull
    serial.pull_messages([])
    assert serial.busy_nodes == set()
    assert _send(view, [1, 2, 3], timeout=1.0) == [1, 2, 3]
    assert serial.busy_nodes == set() and "node 2 has not answered a message sent 20 s ago" in caplog.text


def test_a_node_freed_as_its_waiting_messages_round_ends_gets_neither_it_nor_an_error(monkeypatch):
    """Node 2's late reply comes in the pull at the round's deadline: its
    waiting message is not pushed (no time left) and gets no error reply
    either: dropped unsent when the round ends, as any waiting message
    whose node stays busy."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 2.0})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    assert _send(view, [1, 2]) == [1]  # t = 0 to 1
    assert _send(view, [1, 2]) == [1] and view.last_errors == {}  # t = 1 to 2: node 2 free at 2.0
    assert grid.pushed == [1, 2, 1] and clock.now == pytest.approx(2.0)
    assert view._grid.busy_nodes == set()


def test_one_slow_answer_does_not_keep_a_nodes_waiting_message_out(monkeypatch):
    """Node 2 answered in 0.3 s twice, then once in 1.5 s (late): freed
    0.5 s into the next round, its fastest recent answer fits, so that
    round's message is sent and answered in time."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 0.3})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    assert _send(view, [1, 2]) == [1, 2] and _send(view, [1, 2]) == [1, 2]
    grid.delay[2] = 1.5
    assert _send(view, [1, 2]) == [1]
    grid.delay[2] = 0.3
    assert _send(view, [1, 2]) == [1, 2]


def test_a_waiting_message_is_judged_by_its_nodes_answers_to_messages_of_its_type(monkeypatch):
    """Node 2 trains in 0.8 s, then once in 1.2 s (late, timeout 1 s); the
    evaluation that waits for it takes 0.02 s: sent with 0.8 s left, though
    shorter than any of its training times, and answered."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 0.8})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    for _ in range(3):
        assert _send(view, [1, 2], kind="train") == [1, 2]
    grid.delay[2] = 1.2
    assert _send(view, [1, 2], kind="train") == [1]
    grid.delay[2] = 0.02
    assert _send(view, [1, 2], kind="evaluate") == [1, 2]
    grid.delay[2] = 1.5  # late again: the next training message is judged by its training times (0.8 s or more)
    assert _send(view, [1, 2], kind="train") == [1]
    assert _send(view, [1, 2], kind="train") == [1] and 2 in view.last_errors


def test_a_message_the_caller_still_waits_for_is_not_given_up_on(monkeypatch):
    """Give-up is for messages no longer waited for: while a late message
    (node 3's) is pulled, those the caller still asks for, unanswered for
    longer than ``give_up_after``, keep their nodes and their replies."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 3.0, 2: 3.0, 3: 100.0})
    serial = SerialNodes(grid, give_up_after=2.0)
    messages = _queries(3)
    waited_for = list(serial.push_messages(messages[:2]))
    clock.now = 1.5
    serial.push_messages(messages[2:])  # not asked for below: late
    clock.now = 2.5  # 1, 2 pushed 2.5 s ago, 3 1 s ago
    assert list(serial.pull_messages(waited_for)) == [] and serial.busy_nodes == {1, 2, 3}
    clock.now = 3.0
    assert sorted(int(r.content["metrics"]["node"]) for r in serial.pull_messages(waited_for)) == [1, 2]
    assert serial.busy_nodes == {3}


def test_a_given_up_message_answered_later_is_collected_and_said_to_have_overlapped(monkeypatch, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 25.0})
    serial = SerialNodes(grid, give_up_after=20.0)
    view = PromptGrid(serial)
    assert _send(view, [1, 2]) == [1]
    clock.now = 20.0
    grid.delay[2] = 0.01
    assert _send(view, [1, 2]) == [1, 2]  # given up on: node 2 takes the new message
    assert "node 2 answered a message given up on" not in caplog.text
    clock.now = 25.0  # the first one ends now
    assert _send(view, [1]) == [1]
    assert "node 2 answered a message given up on earlier (not used)" in caplog.text
    assert serial._given_up == {} and grid._held == {}  # pulled, nothing left at the SuperLink
    # one the SuperLink answers (node gone) is said to have ended with that error
    grid.delay[2] = None
    assert _send(view, [1, 2]) == [1]
    clock.now = 50.0
    assert _send(view, [1]) == [1] and serial._given_up  # given up on
    grid.fail_in_flight(2)
    assert _send(view, [1]) == [1] and not serial._given_up
    assert "node 2: a message given up on earlier ended with an error (node offline)" in caplog.text


def test_a_node_that_took_a_message_is_told_of_its_next_wait_again(monkeypatch, caplog):
    """The warning that a node's message waits is given once per wait, also
    when the node's last wait ended with its message dropped unsent and it
    then took a message pushed at once."""
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.01, 2: 3.0})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    _send(view, [1, 2]), _send(view, [1, 2])  # node 2's second message waits, dropped unsent
    clock.now += 2
    _send(view, [1])  # a round without node 2: its late reply is collected, it is free
    grid.delay[2] = 0.01
    assert _send(view, [1, 2]) == [1, 2]  # pushed at once
    grid.delay[2] = 3.0
    _send(view, [1, 2]), _send(view, [1, 2])  # late again: its next message waits
    assert caplog.text.count("node 2 has not answered its last message yet") == 2


def test_two_messages_for_one_node_in_one_send_go_one_after_the_other(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _TimedGrid(clock, {1: 0.3})
    view = PromptGrid(SerialNodes(grid, give_up_after=30.0))
    first, second = _queries(1) + _queries(1)
    replies = list(view.send_and_receive([first, second], timeout=1.0))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == sorted([first.metadata.message_id,
                                                                              second.metadata.message_id])
    sent = sorted(float(r.content["metrics"]["sent"]) for r in replies)
    assert sent[0] == 0.0 and sent[1] >= 0.3  # the second pushed once the first was answered


def test_every_run_sends_through_serial_nodes(tmp_path, monkeypatch):
    """run_experiment (the fast runner's and flwr run's ServerApp) puts
    SerialNodes under PromptGrid, giving up on a message three round-timeouts
    after it was sent, and every message of the run goes through it."""
    import fedaccel.experiment as experiment
    from fedaccel.local_run import default_run_config, fuse, run_local

    made, pushed = [], []

    class Recording(SerialNodes):
        def __init__(self, grid, give_up_after):
            super().__init__(grid, give_up_after)
            made.append(give_up_after)

        def push_messages(self, messages):
            messages = list(messages)
            pushed.extend(m.metadata.message_type for m in messages)
            return super().push_messages(messages)

    monkeypatch.setattr(experiment, "SerialNodes", Recording)
    run_local(fuse(default_run_config(), {"num-server-rounds": 1, "clients-per-round": 2, "round-timeout": 7.0,
                                          "results-dir": str(tmp_path), "accl-every": 1}), 3, quiet=True)
    assert made == [21.0]
    assert pushed.count("train") == 2 and pushed.count("query") == 3 and "evaluate" in pushed
