"""Views of a Flower ``Grid`` that the strategies hand to Flower's own methods.

Written here because Flower offers no way to restrict a Grid to some nodes
(:class:`NodeSubset`: Flower's ``configure_train`` then builds one message per
chosen node), to change how often ``send_and_receive`` polls
(:class:`PromptGrid`), or to keep a node to one message at a time
(:class:`SerialNodes`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid


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
        pending = dict.fromkeys(m for m in self._grid.push_messages(messages) if m)  # ordered
        deadline = None if timeout is None else time.monotonic() + timeout
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
    """A Grid that sends a node its next message only once the node has
    answered the last one.

    A SuperNode takes its messages one at a time. Flower's simulation does
    not: it hands a node's next message to another worker while a message
    that outlived ``round-timeout`` still runs, each worker on its own copy
    of the node's ``Context``, and the one that ends last overwrites the
    other's ``context.state`` (``vce_api.worker``). On a cohort node
    (:mod:`fedaccel.cohort_nodes`) that state holds every client the node
    serves, so a late envelope would cost clients that were never late
    their state. Here a message whose reply did not come in time stays
    *outstanding*; each ``send_and_receive`` first collects the replies
    outstanding messages got since (or the SuperLink's error reply for
    one: node gone, message expired; both dropped, as late replies are),
    and a message for a node that still has one outstanding is not sent:
    it gets no reply, as a late one. After ``give_up_factor`` times the
    timeout it was sent with, an outstanding message is given up on (a
    reply lost for good must not keep a node out), with a warning.
    Written by hand: Flower's grids forget a message once
    ``send_and_receive`` has stopped waiting for it.
    """

    give_up_factor = 2.0

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self._outstanding: dict[str, tuple[int, float]] = {}  # message id -> (node, give up at)

    @property
    def busy_nodes(self) -> set[int]:
        """The nodes with a message outstanding."""
        return {node for node, _ in self._outstanding.values()}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self._collect_outstanding()
        busy = self.busy_nodes
        held = [m for m in messages if m.metadata.dst_node_id in busy]
        if held:
            log(WARNING, "[fedaccel] %s message(s) not sent to node(s) %s, which have not answered an "
                "earlier message yet (no reply within round-timeout): a node takes one message at a time; "
                "raise round-timeout if its work takes longer", len(held),
                ", ".join(str(n) for n in sorted({m.metadata.dst_node_id for m in held})))
        sent = [m for m in messages if m.metadata.dst_node_id not in busy]
        replies = list(self._grid.send_and_receive(sent, timeout=timeout)) if sent else []
        if timeout is not None:
            answered = {r.metadata.reply_to_message_id for r in replies}
            give_up_at = time.monotonic() + self.give_up_factor * timeout
            for m in sent:
                if m.metadata.message_id and m.metadata.message_id not in answered:
                    self._outstanding[m.metadata.message_id] = (m.metadata.dst_node_id, give_up_at)
        return replies

    def _collect_outstanding(self) -> None:
        """Drop the outstanding messages that got a reply since, or whose
        time to give up has come."""
        if not self._outstanding:
            return
        for reply in self._grid.pull_messages(list(self._outstanding)):
            found = self._outstanding.pop(reply.metadata.reply_to_message_id, None)
            if found is not None:
                log(INFO, "[fedaccel] node %s answered a message of an earlier round (not used); it gets "
                    "messages again", found[0])
        now = time.monotonic()
        for message_id, (node, give_up_at) in list(self._outstanding.items()):
            if now >= give_up_at:
                del self._outstanding[message_id]
                log(WARNING, "[fedaccel] node %s never answered a message (given up after %g times "
                    "round-timeout); it gets messages again (in Flower's simulation, should that message "
                    "still be running, the two overwrite each other's client state: raise round-timeout)",
                    node, self.give_up_factor)
