"""fedaccel/grids.py: PromptGrid notices replies without Flower's fixed sleeps,
SerialNodes keeps a node to one message at a time (on a fake clock, so no
test waits)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

import fedaccel.grids as grids
from fakes import StubGrid
from fedaccel.grids import GridView, NodeSubset, PromptGrid, SerialNodes

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


def _queries(n):
    return [Message(RecordDict({"config": ConfigRecord()}), node, "query") for node in range(1, n + 1)]


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


class _ManualGrid(StubGrid):
    """Pushed messages wait for :meth:`answer` (a reply) or :meth:`fail` (the
    SuperLink's error reply); ``pushed``: the node of every message pushed."""

    def __init__(self, node_ids) -> None:
        super().__init__(node_ids)
        self.pushed: list[int] = []
        self._waiting: dict[str, Message] = {}
        self._ready: dict[str, Message] = {}
        self._count = 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self._count += 1
            m.metadata.__dict__["_message_id"] = f"id{self._count}"
            self._waiting[m.metadata.message_id] = m
            self.pushed.append(m.metadata.dst_node_id)
            ids.append(m.metadata.message_id)
        return ids

    def answer(self, node: int, error: bool = False) -> None:
        for mid, m in list(self._waiting.items()):
            if m.metadata.dst_node_id == node:
                del self._waiting[mid]
                self._ready[mid] = (Message(Error(ErrorCode.NODE_UNAVAILABLE, "node offline"), reply_to=m) if error
                                    else Message(RecordDict({"metrics": MetricRecord({"node": node})}), reply_to=m))

    def pull_messages(self, message_ids):
        return [self._ready.pop(mid) for mid in message_ids if mid in self._ready]


def _round(view, grid, answering, timeout=1.0):
    """One send to nodes 1-3 through ``view``; the nodes in ``answering`` reply at once."""
    class Answering(GridView):
        def send_and_receive(self, messages, *, timeout=None):
            ids = self._grid.push_messages(messages)
            for node in answering:
                grid.answer(node)
            return self._grid.pull_messages(ids)
    view._grid = Answering(grid)
    grid.pushed.clear()
    return sorted(int(r.content["metrics"]["node"]) for r in view.send_and_receive(_queries(3), timeout=timeout))


def test_a_node_gets_no_message_while_its_last_one_is_unanswered(monkeypatch):
    """Node 2 does not reply in time: its next message is not sent (and gets
    no reply) until its late reply has come, which is not returned; the
    other nodes go on as usual."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _ManualGrid([1, 2, 3])
    view = SerialNodes(grid)
    assert _round(view, grid, answering=[1, 3]) == [1, 3]
    assert view.busy_nodes == {2}
    assert _round(view, grid, answering=[1, 3]) == [1, 3]
    assert grid.pushed == [1, 3]  # nothing sent to node 2: it still works on the first
    grid.answer(2)  # the late reply arrives
    assert _round(view, grid, answering=[1, 2, 3]) == [1, 2, 3]  # the late reply is not among them
    assert grid.pushed == [1, 2, 3] and view.busy_nodes == set()


def test_an_error_reply_or_a_reply_lost_for_good_frees_the_node(monkeypatch):
    """The SuperLink's error reply for an outstanding message (node offline)
    frees its node; a message never answered is given up on after
    ``give_up_factor`` times the timeout it was sent with, not before."""
    clock = _FakeClock()
    monkeypatch.setattr(grids, "time", clock)
    grid = _ManualGrid([1, 2, 3])
    view = SerialNodes(grid)
    _round(view, grid, answering=[1], timeout=10.0)
    assert view.busy_nodes == {2, 3}
    grid.answer(3, error=True)
    clock.now = 19.9  # before 2 x 10 s
    assert _round(view, grid, answering=[1, 3], timeout=10.0) == [1, 3]
    assert grid.pushed == [1, 3] and view.busy_nodes == {2}
    clock.now = 20.0
    assert _round(view, grid, answering=[1, 2, 3], timeout=10.0) == [1, 2, 3]
    assert grid.pushed == [1, 2, 3] and view.busy_nodes == set()


def test_without_a_timeout_nothing_is_outstanding(monkeypatch):
    grid = _ManualGrid([1, 2, 3])
    view = SerialNodes(grid)
    _round(view, grid, answering=[1], timeout=None)
    assert view.busy_nodes == set()
