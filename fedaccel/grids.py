"""Views of a Flower ``Grid`` that the strategies hand to Flower's own methods.

Written here because Flower offers no way to restrict a Grid to some nodes
(:class:`NodeSubset`: Flower's ``configure_train`` then builds one message per
chosen node), to change how often ``send_and_receive`` polls
(:class:`PromptGrid`), or to keep a node to one message at a time
(:class:`SerialNodes`).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from flwr.common import log
from flwr.serverapp import Grid

GIVE_UP_ROUNDS = 3  # a message unanswered this many round-timeouts after it was sent is given up on
#: the reason of the error reply to a waiting message not sent for lack of
#: time (one line for every such reply, so that the server's log says it once)
NOT_SENT = ("not sent: its node was still busy with an earlier message, and less of this round was left than "
            "the node takes (raise round-timeout if its work takes longer)")


class GridView(Grid):
    """A Grid that forwards everything to another Grid (base of the views below)."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


class NodeSubset(GridView):
    """A read-through view of a Grid that exposes only some node ids."""

    def __init__(self, grid: Grid, node_ids: list[int]) -> None:
        super().__init__(grid)
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)


class PromptGrid(GridView):
    """A Grid whose ``send_and_receive`` notices replies within milliseconds.

    Flower's own ``send_and_receive`` sleeps a fixed interval between pulls:
    0.1 s in the simulation's in-memory grid, 3 s in the ServerApp's grid on
    a real SuperLink, so every round ends up to that late. This
    one pushes, then pulls with a back-off from 5 ms growing by a tenth
    each time up to ``max_interval``: a reply is collected at most about
    5 ms plus 10 % of the time already waited (and at most
    ``max_interval``) after it arrives, with some 30 pulls in a round's
    first second and ten a second after. (Growing by half, as it once did,
    collected a reply up to half the time waited late: on Flower's Ray
    simulation with one Ray worker, two cohort nodes of 50 Synthetic
    clients each, FedAvg's rounds took 0.113 s against 0.103 s growing by
    a tenth, 2026-12-07; bench/results/overhead.) Same contract: returns what arrived before
    ``timeout`` (None: wait for all). Written here because Flower's
    interval is not configurable.
    """

    growth = 1.1  # each wait between pulls this many times the last

    def __init__(self, grid: Grid, max_interval: float = 0.1) -> None:
        super().__init__(grid)
        self.max_interval = max_interval

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if isinstance(self._grid, SerialNodes):  # a new round: what it pushes later must fit before its deadline
            self._grid.begin_send(deadline)
        pending = dict.fromkeys(m for m in self._grid.push_messages(messages) if m)  # ordered
        replies: list[Message] = []
        interval = 0.005
        while True:
            pulled = list(self._grid.pull_messages(list(pending)))
            replies.extend(pulled)
            for m in pulled:
                pending.pop(m.metadata.reply_to_message_id, None)
            if not pending:
                return replies
            if deadline is not None and time.monotonic() >= deadline:
                return replies
            wait = interval if deadline is None else min(interval, max(deadline - time.monotonic(), 0.0))
            time.sleep(wait)
            interval = min(interval * self.growth, self.max_interval)


class SerialNodes(GridView):
    """A Grid that gives each node one message at a time: a message for a
    node that has one in flight waits here, and is pushed once that one is
    answered.

    Flower's simulation hands a node's next message to another worker while
    a message that outlived its round still runs, each worker on its own
    copy of the node's ``Context``, and the one that ends last overwrites
    the other's ``context.state`` (``vce_api.worker``); a SuperNode, too,
    pulls its next message without waiting for its ClientApp to finish the
    last. On a cohort node (:mod:`fedaccel.cohort_nodes`) that state holds
    every client the node serves, so a late envelope would cost clients
    that were never late their state.

    Works at the level of ``push_messages`` / ``pull_messages``, under
    :class:`PromptGrid` (whose ``send_and_receive`` is a push, then pulls
    until its timeout, each pull asking for every message it still waits
    for: a message in flight that a pull does not ask for is late). Each
    pull fetches, with the replies asked for, those of the late messages
    (dropped; the SuperLink's error reply for one, node gone or message
    expired, frees its node too), then pushes each waiting message whose
    node is free and whose round (the deadline :class:`PromptGrid` passes
    to :meth:`begin_send`) has at least as long left as the node took to
    answer any of its last ``RECENT`` messages of the same type (the
    shortest: one slow answer does not keep a node out; training is not
    judged by evaluations): a waiting message pushed with less time left
    would most likely be late too, its work wasted, and its node busy into
    the next round again (its message waiting in turn, and so on, round
    after round), so it is answered at once with an error reply
    (:data:`NOT_SENT`) and its round need not wait for it. A message that
    waited is known to the caller by the id this Grid gave it: its reply
    says so, and so does the message once its reply came. A waiting message the caller no longer asks for is dropped
    unsent: it got no reply, as a late one. A message in flight for
    ``give_up_after`` seconds that the caller no longer waits for is given
    up on, with a warning (a reply lost for good must not keep a node out;
    should that message still run, the two overlap). Its id is still
    pulled, so that a reply that does come is collected, and said to have
    overlapped its node's later message (a SuperLink error reply for it is
    logged as that error).

    Written by hand: Flower's grids send every message at once.
    """

    def __init__(self, grid: Grid, give_up_after: float) -> None:
        super().__init__(grid)
        self.give_up_after = give_up_after
        # node -> (the inner grid's message id, pushed at, its message type)
        self._in_flight: dict[int, tuple[str, float, str]] = {}
        self._node_of: dict[str, int] = {}  # inner id of a message in flight -> its node
        self._waiting: dict[str, Message] = {}  # our id -> message, in the order they came
        self._waited: dict[str, tuple[str, Message]] = {}  # inner id of a message that waited -> (our id, it)
        self._inner_of: dict[str, str] = {}  # our id -> the inner id, for a message that waited and was pushed
        self._told: set[int] = set()  # nodes whose waiting was logged (once until they take a message)
        # (node, message type) -> seconds it took to answer its last RECENT messages of that type
        self._took: dict[tuple[int, str], deque[float]] = {}
        self._given_up: dict[str, int] = {}  # inner id of a message given up on -> its node
        self.deadline: float | None = None  # when the caller's current send stops waiting (begin_send)

    RECENT = 3  # answer times kept per node

    def begin_send(self, deadline: float | None) -> None:
        """A new send of the caller, which waits until ``deadline`` (None:
        until every reply came): the messages still waiting from its last
        send are no longer waited for (dropped unsent)."""
        self._waiting.clear()
        self.deadline = deadline

    @property
    def busy_nodes(self) -> set[int]:
        """The nodes with a message in flight."""
        return set(self._in_flight)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        now, later = [], []
        taken = set(self._in_flight)
        taken.update(m.metadata.dst_node_id for m in self._waiting.values())
        for message in messages:
            node = message.metadata.dst_node_id
            (later if node in taken else now).append(message)
            taken.add(node)
        ids = self._push(now)
        for message in later:
            our_id = f"serial-{uuid.uuid4().hex}"
            message.metadata.__dict__["_message_id"] = our_id
            self._waiting[our_id] = message
            ids.append(our_id)
            self._tell_waiting(message.metadata.dst_node_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        asked = set(message_ids)
        if self._waiting:
            for our_id in [i for i in self._waiting if i not in asked]:  # the caller stopped waiting for it
                del self._waiting[our_id]
        wanted = [self._inner_of.get(i, i) for i in asked if i not in self._waiting]
        # in flight, and no longer asked for: late (their replies are dropped)
        late = set(self._node_of).difference(wanted)
        replies = []
        pulled = (self._grid.pull_messages(wanted + list(late) + list(self._given_up))
                  if wanted or late or self._given_up else [])
        for reply in pulled:
            inner_id = reply.metadata.reply_to_message_id
            if inner_id in self._given_up:
                node = self._given_up.pop(inner_id)
                if reply.has_error():  # the SuperLink's: node gone, message expired or deleted
                    log(INFO, "[fedaccel] node %s: a message given up on earlier ended with an error (%s)", node,
                        reply.error.reason)
                else:
                    log(INFO, "[fedaccel] node %s answered a message given up on earlier (not used): it ran "
                        "alongside the node's later message", node)
                continue
            node = self._node_of.get(inner_id)
            reply = self._answered(reply)
            if inner_id not in late:
                replies.append(reply)
            elif reply.has_error():
                log(INFO, "[fedaccel] node %s: a message of an earlier round ended with an error (%s); it "
                    "takes messages again", node, reply.error.reason)
            else:
                log(INFO, "[fedaccel] node %s answered a message of an earlier round (not used); it takes "
                    "messages again", node)
        if late:
            self._give_up(late)
        if self._waiting:
            replies.extend(self._push_waiting())
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        raise NotImplementedError("SerialNodes works under PromptGrid, through push_messages and pull_messages")

    # ------------------------------------------------------------ helpers
    def _push(self, messages: list[Message]) -> list[str]:
        if not messages:
            return []
        ids = [i for i in self._grid.push_messages(messages) if i]
        stored, now = set(ids), time.monotonic()
        for message in messages:
            message_id = message.metadata.message_id
            if message_id in stored:
                node = message.metadata.dst_node_id
                self._in_flight[node] = (message_id, now, message.metadata.message_type)
                self._node_of[message_id] = node
                self._told.discard(node)  # it took a message: a later wait is told again
        return ids

    def _push_waiting(self) -> list[Message]:
        """Push each waiting message whose node is free (the first one per
        node) and whose round has time left for it: at least the fastest of
        the node's last answers to messages of its type (a training
        message is not judged by evaluations, nor the other way round).
        One without is not sent: its reply, returned, is an error saying
        so, and the caller's round need not wait for it."""
        ready: dict[int, str] = {}
        for our_id, message in self._waiting.items():
            node = message.metadata.dst_node_id
            if node not in self._in_flight and node not in ready:
                ready[node] = our_id
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if left is not None and left <= 0:
            return []  # the round is over: they stay, to be dropped unsent
        not_sent = []
        for node, our_id in ready.items():
            message = self._waiting.pop(our_id)
            took = min(self._took.get((node, message.metadata.message_type), (0.0,)))
            if left is not None and left < took:
                log(INFO, "[fedaccel] node %s became free with %.1f s of this round left; it took %.1f s or more "
                    "to answer each of its last messages of this kind: this round's is not sent", node, left, took)
                message.metadata.__dict__["_message_id"] = our_id
                not_sent.append(Message(Error(ErrorCode.NODE_UNAVAILABLE, NOT_SENT), reply_to=message))
                continue
            for inner_id in self._push([message]):
                self._waited[inner_id] = (our_id, message)
                self._inner_of[our_id] = inner_id
        return not_sent

    def _answered(self, reply: Message) -> Message:
        """A reply pulled: its node is free again; a message that waited gets
        its id back, and its reply says it answers that id."""
        self._forget(reply.metadata.reply_to_message_id, reply)
        return reply

    def _forget(self, inner_id: str, reply: Message | None = None) -> None:
        """Message ``inner_id`` is no longer in flight (answered by ``reply``, or given up on)."""
        node = self._node_of.pop(inner_id, None)
        if node is not None and self._in_flight.get(node, ("",))[0] == inner_id:
            _, pushed_at, kind = self._in_flight.pop(node)
            if reply is not None and not reply.has_error():  # the node's own answer, not the SuperLink's
                self._took.setdefault((node, kind), deque(maxlen=self.RECENT)).append(time.monotonic() - pushed_at)
        waited = self._waited.pop(inner_id, None)
        if waited is not None:
            our_id, message = waited
            self._inner_of.pop(our_id, None)
            if reply is not None:
                message.metadata.__dict__["_message_id"] = our_id
                reply.metadata.__dict__["_reply_to_message_id"] = our_id

    def _give_up(self, late: set[str]) -> None:
        """Give up on the late messages in flight for ``give_up_after`` seconds or more."""
        now = time.monotonic()
        for node, (message_id, pushed_at, _) in list(self._in_flight.items()):
            if message_id in late and now - pushed_at >= self.give_up_after:
                self._forget(message_id)
                self._given_up[message_id] = node
                log(WARNING, "[fedaccel] node %s has not answered a message sent %.0f s ago: given up on, it "
                    "takes messages again (should that message still run, the two overwrite each other's "
                    "client state in Flower's simulation: raise round-timeout)", node, now - pushed_at)

    def _tell_waiting(self, node: int) -> None:
        if node not in self._told:
            self._told.add(node)
            log(WARNING, "[fedaccel] node %s has not answered its last message yet: its next one waits until "
                "it has (a node takes one message at a time; one still waiting when its round ends is not "
                "sent). Raise round-timeout if a node's work takes longer", node)
