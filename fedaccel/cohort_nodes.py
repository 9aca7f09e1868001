"""Cohort nodes: logical clients served in slices by Flower's nodes.

In Flower every client is a node: a simulated SuperNode, one ClientApp call
per message. For the small models of federated benchmarks that makes a
round of 100 clients 100 ClientApp calls, each paying Flower's and Ray's
per-message cost, while one process could train the whole slice as one
batched model (:mod:`fedaccel.clients.cohort`). With ``logical-clients = N``
the run has ``N`` clients (data partitions ``0..N-1``) and the federation's
``W`` nodes serve them: node ``k`` (its ``partition-id``) serves the clients
``p`` with ``p % W == k``, always the same ones, so a client's
``context.state`` stays on its node.

Server side, :class:`CohortNodes` is a Grid view that shows every logical
client as a node of its own (id ``LOGICAL_NODE_BASE + p``): the strategies,
the membership and the commit protocol above it work per client exactly as
on a federation of ``N`` nodes. ``send_and_receive`` packs the messages of
a round that go to one node into one *envelope* (message type
``train.cohort`` / ``evaluate.cohort``; a record the messages share, such
as the global model, travels once) and unpacks the node's one reply into a
reply per client. An envelope that gets no reply in time is every one of
its clients' lost reply; an envelope's error reply is each of its clients'
error reply. Queries to logical clients are answered here, from the slot
each node reported (:func:`fedaccel.membership.query_partitions`).

Client side, the ClientApp unpacks an envelope into one message and one
:class:`~flwr.app.Context` per client (:func:`logical_messages`,
:func:`client_state` / :func:`keep_client_state`) and handles them as the
fast runner does: the round's slice trains as one batch.

Written by hand: Flower has no notion of several clients behind one node.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.app.metadata import Metadata
from flwr.common import log
from flwr.serverapp import Grid

from fedaccel.client_errors import COHORT_ACTION  # envelopes are "train.cohort" and "evaluate.cohort"
from fedaccel.contract import ContractError
from fedaccel.errors import FederationError
from fedaccel.grids import GridView
from fedaccel.membership import TRANSIENT_ATTEMPTS, TransientAnswer, query_partitions

LOGICAL_NODE_BASE = 1 << 62  # logical client p shows as node LOGICAL_NODE_BASE + p
INDEX = "cohort"  # the envelope's index record
REPLY_INDEX = "cohort-replies"  # the reply envelope's index record
STATE_PREFIX = "client-"  # a logical client's records in its node's context.state: client-<p>/<key>


def logical_node_id(partition_id: int) -> int:
    return LOGICAL_NODE_BASE + partition_id


def partition_of_logical_node(node_id: int) -> int:
    return node_id - LOGICAL_NODE_BASE


# ----------------------------------------------------------------- envelopes
def pack_envelope(messages: list[Message], num_clients: int) -> RecordDict:
    """One RecordDict carrying ``messages`` (to logical clients): each
    message's records under ``<i>/<name>``, a record object that several
    messages share stored once (the global model), and an index."""
    content, stored, names, refs, targets = RecordDict(), {}, [], [], []
    for i, message in enumerate(messages):
        for name, record in message.content.items():
            key = f"{i}/{name}"
            names.append(key)
            if id(record) in stored:
                refs.append(key)
                targets.append(stored[id(record)])
            else:
                stored[id(record)] = key
                content[key] = record
    content[INDEX] = ConfigRecord({
        "partitions": [partition_of_logical_node(m.metadata.dst_node_id) for m in messages],
        "num-partitions": num_clients, "names": names, "refs": refs, "targets": targets})
    return content


def logical_messages(envelope: Message) -> list[tuple[int, int, Message]]:
    """``(partition id, num-partitions, message)`` for every client of an
    envelope: the message it would have got as a node of its own (type
    ``train`` or ``evaluate``, its own node id), to reply to as usual."""
    index = envelope.content[INDEX]
    partitions = [int(p) for p in index["partitions"]]
    if len(set(partitions)) < len(partitions):
        # one state per client and envelope: CohortNodes sends a second message in another
        repeated = sorted(p for p in set(partitions) if partitions.count(p) > 1)
        raise ContractError(f"a cohort envelope carries two messages for client {repeated[0]} (each client's "
                            "messages of one send go in envelopes of their own); is the server another "
                            "fedaccel version?")
    refs = dict(zip(index.get("refs", []), index.get("targets", [])))
    contents = [RecordDict() for _ in index["partitions"]]
    for key in index.get("names", []):
        i, name = key.split("/", 1)
        contents[int(i)][name] = envelope.content[refs.get(key, key)]
    md = envelope.metadata
    category = md.message_type.split(".", 1)[0]
    out = []
    for pid, content in zip(index["partitions"], contents):
        metadata = Metadata(run_id=md.run_id, message_id=f"{md.message_id}/{pid}", src_node_id=md.src_node_id,
                            dst_node_id=logical_node_id(int(pid)), reply_to_message_id="",
                            group_id=md.group_id, created_at=md.created_at, ttl=md.ttl,
                            message_type=category)
        out.append((int(pid), int(index["num-partitions"]), Message(content=content, metadata=metadata)))
    return out


def pack_replies(replies: list[Message], note: str = "") -> RecordDict:
    """The node's one reply: each client's reply records under ``<i>/<name>``,
    or its error (code and reason) in the index; ``note``: a line for the
    server's log (how the node trained its slice)."""
    content, names, errors, codes, reasons = RecordDict(), [], [], [], []
    for i, reply in enumerate(replies):
        if reply.has_error():
            errors.append(i)
            codes.append(int(reply.error.code))
            reasons.append(str(reply.error.reason))
            continue
        for name, record in reply.content.items():
            names.append(f"{i}/{name}")
            content[f"{i}/{name}"] = record
    content[REPLY_INDEX] = ConfigRecord({"count": len(replies), "names": names, "errors": errors,
                                         "codes": codes, "reasons": reasons, "note": note})
    return content


def unpack_replies(content: RecordDict, messages: list[Message]) -> list[Message]:
    """The replies to ``messages`` (the logical messages of one envelope, in
    its order) from the node's reply envelope."""
    index = content[REPLY_INDEX]
    if int(index["count"]) != len(messages):
        raise ValueError(f"a cohort node answered {index['count']} of {len(messages)} clients")
    errors = {int(i): (int(c), str(r)) for i, c, r in
              zip(index.get("errors", []), index.get("codes", []), index.get("reasons", []))}
    records: list[RecordDict] = [RecordDict() for _ in messages]
    for key in index.get("names", []):
        i, name = key.split("/", 1)
        records[int(i)][name] = content[key]
    return [Message(Error(*errors[i]), reply_to=m) if i in errors else Message(records[i], reply_to=m)
            for i, m in enumerate(messages)]


# ------------------------------------------------------- client state on a node
def client_state(node_state: RecordDict, partition_id: int) -> RecordDict:
    """Logical client ``partition_id``'s ``context.state``: its records in its
    node's ``context.state`` (``client-<p>/<key>``), as a RecordDict of their own."""
    prefix = f"{STATE_PREFIX}{partition_id}/"
    return RecordDict({k[len(prefix):]: v for k, v in node_state.items() if k.startswith(prefix)})


def client_states(node_state: RecordDict, partition_ids: Iterable[int]) -> dict[int, RecordDict]:
    """:func:`client_state` of each of these clients, read in one pass over
    the node's records (a pass per client costs the square of the slice:
    0.06 s an envelope at 500 clients a node)."""
    out = {int(pid): RecordDict() for pid in partition_ids}
    for key, record in node_state.items():
        pid, name = _owner(key)
        if pid in out:
            out[pid][name] = record
    return out


def keep_client_state(node_state: RecordDict, partition_id: int, state: RecordDict) -> None:
    """Store ``state`` as logical client ``partition_id``'s records in its node's state."""
    prefix = f"{STATE_PREFIX}{partition_id}/"
    for key in [k for k in node_state.keys() if k.startswith(prefix)]:
        del node_state[key]
    for key, record in state.items():
        node_state[prefix + key] = record


def keep_client_states(node_state: RecordDict, states: dict[int, RecordDict]) -> None:
    """:func:`keep_client_state` for each client of ``states`` (partition id
    -> its state), in one pass over the node's records."""
    for key in [key for key in node_state.keys() if _owner(key)[0] in states]:
        del node_state[key]
    for pid, state in states.items():
        for key, record in state.items():
            node_state[f"{STATE_PREFIX}{pid}/{key}"] = record


def _owner(key: str) -> tuple[int | None, str]:
    """``(p, name)`` for a node record ``client-<p>/<name>``, else ``(None, key)``."""
    if key.startswith(STATE_PREFIX):
        head, sep, name = key[len(STATE_PREFIX):].partition("/")
        if sep and head.isascii() and head.isdigit() and str(int(head)) == head:
            return int(head), name
    return None, key


# ------------------------------------------------------------- server side
class CohortNodes(GridView):
    """A Grid whose nodes are ``num_clients`` logical clients, served by the
    nodes of ``grid`` (node ``k`` of ``W`` serves the clients ``p % W == k``;
    ``k`` and ``W`` are the node's ``partition-id`` and ``num-partitions``).

    Only ``send_and_receive`` is offered (what Flower's strategies and this
    project's server use): the logical messages of one call are sent as one
    envelope per node and message type, and a node's reply envelope becomes
    a reply per client. A node that has not answered which slot it serves,
    or that is offline, leaves its clients without a reply (as an offline
    node would). ``query_timeout``: how long a node has to say which slot it
    serves. ``announce``: where each distinct line the nodes send about how
    they train goes (the fast runner: stderr); None, the server's log.
    """

    trains_cohorts = True  # each node trains its slice of a round as one batch

    def __init__(self, grid: Grid, num_clients: int, query_timeout: float,
                 announce: Callable[[str], None] | None = None) -> None:
        super().__init__(grid)
        self.num_clients = num_clients
        self.query_timeout = query_timeout
        self._slot: dict[int, int] = {}  # node id -> the slot k it serves
        self._node_of_slot: dict[int, int] = {}
        self._num_nodes: int | None = None  # W, as the nodes report it
        self._ignored: set[int] = set()
        self._transient: dict[int, int] = {}  # node -> Flower-side error answers before the first round
        self._started = False  # discovery is over (close_discovery, or a training round was sent)
        self._notes: set[str] = set()  # what the nodes said about how they train (logged once each)
        self._announce = announce  # where those lines go (None: the server's log, at INFO)

    @property
    def num_nodes(self) -> int | None:
        return self._num_nodes

    def close_discovery(self) -> None:
        """The run's nodes are known: a node that appears from now on is a
        restarted SuperNode (followed), not a configuration error (refused)."""
        self._started = True

    def _follow_nodes(self) -> list[int]:
        """Ask nodes not seen before which slot they serve; returns the online node ids.

        Before the first round a wrong answer stops the run (two nodes with one
        partition-id, differing num-partitions). Later a node that appears is a
        SuperNode restarted under a new node id (no SuperNode authentication):
        it takes its slot over once the slot's old node is offline, as
        :class:`fedaccel.membership.NodeMembership` does for one client per
        node; a node that cannot say which slot it serves is not used."""
        online = list(self._grid.get_node_ids())
        new = [n for n in online if n not in self._slot and n not in self._ignored]
        if new:
            answers = query_partitions(self._grid, new, self.query_timeout)
            if self._started:  # asked once: a node that does not answer is not asked again every round
                answers.update({n: f"no answer within {self.query_timeout:g} s" for n in new if n not in answers})
            for node, answer in answers.items():
                problem = None
                if isinstance(answer, TransientAnswer) and not self._started:
                    # before the first round, Flower's own errors are asked again, as discover_federation does
                    self._transient[node] = self._transient.get(node, 0) + 1
                    if self._transient[node] < TRANSIENT_ATTEMPTS:
                        log(WARNING, "[fedaccel] node %s did not say which clients it serves (%s); asking it "
                            "again (%s of %s)", node, answer, self._transient[node] + 1, TRANSIENT_ATTEMPTS)
                        continue
                    answer = f"{answer} ({self._transient[node]} such answers)"
                if isinstance(answer, str):
                    problem = f"node {node} could not report which clients it serves: {answer}"
                elif self._num_nodes is not None and answer[1] != self._num_nodes:
                    problem = (f"nodes disagree on num-partitions ({answer[1]} vs {self._num_nodes}); "
                               "give every node the same num-partitions")
                # a second node for a slot whose node is online: refused at discovery, later a restart
                duplicate = problem is None and self._node_of_slot.get(answer[0]) in online
                if not self._started and (problem or duplicate):
                    raise FederationError(problem or f"two nodes claim partition-id={answer[0]}; each needs its own")
                if problem:
                    log(WARNING, "[fedaccel] %s; it is not used", problem)
                    self._ignored.add(node)
                    continue
                slot, num_nodes = answer
                if self._num_nodes is None:
                    self._num_nodes = num_nodes
                    log(INFO, "[fedaccel] %s logical clients on %s cohort nodes (node k serves the clients "
                        "p with p %% %s == k; logical-clients)", self.num_clients, num_nodes, num_nodes)
                    if num_nodes > self.num_clients:
                        log(WARNING, "[fedaccel] %s cohort nodes for %s logical clients: the nodes with "
                            "partition-id >= %s serve no client; use at most %s nodes", num_nodes,
                            self.num_clients, self.num_clients, self.num_clients)
                self._slot[node] = slot
                if not duplicate:
                    self._node_of_slot[slot] = node
                else:
                    log(INFO, "[fedaccel] node %s joined during the run with partition-id=%s; it serves that "
                        "slot's clients once node %s is offline", node, slot, self._node_of_slot[slot])
        online_set = set(online)
        for node, slot in self._slot.items():  # restarted nodes take their slot over
            current = self._node_of_slot.get(slot)
            if node != current and node in online_set and current not in online_set:
                self._node_of_slot[slot] = node
                log(INFO, "[fedaccel] cohort node slot %s is now served by node %s (node %s went offline)",
                    slot, node, current)
        return online

    def get_node_ids(self) -> Iterable[int]:
        online = set(self._follow_nodes())
        if self._num_nodes is None:
            return []
        return [logical_node_id(p) for p in range(self.num_clients)
                if self._node_of_slot.get(p % self._num_nodes) in online]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("CohortNodes sends logical messages through send_and_receive only")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("CohortNodes sends logical messages through send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self._follow_nodes()
        self._started = self._started or any(m.metadata.message_type == MessageType.TRAIN for m in messages)
        replies: list[Message] = []
        groups: dict[tuple[int, str, int], list[Message]] = {}
        clients_of: dict[tuple[int, str, int], set[int]] = {}
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # ids as a Grid gives them on push
            pid = partition_of_logical_node(message.metadata.dst_node_id)
            if not 0 <= pid < self.num_clients:
                replies.append(Message(Error(0, f"unknown node {message.metadata.dst_node_id}"), reply_to=message))
            elif message.metadata.message_type == MessageType.QUERY:
                record = ConfigRecord({"partition-id": pid, "num-partitions": self.num_clients})
                replies.append(Message(RecordDict({"partition": record}), reply_to=message))
            elif self._num_nodes and pid % self._num_nodes in self._node_of_slot:
                node = self._node_of_slot[pid % self._num_nodes]
                # a client's second message of this send goes in a further envelope (SerialNodes
                # sends it after the first's reply): one envelope reads and keeps each client's state once
                nth = 0
                while pid in clients_of.get((node, message.metadata.message_type, nth), ()):
                    nth += 1
                key = (node, message.metadata.message_type, nth)
                groups.setdefault(key, []).append(message)
                clients_of.setdefault(key, set()).add(pid)
            # else: no node serves this client now; it gets no reply, as an offline node
        envelopes = []
        for (node, message_type, _), group in groups.items():
            first = group[0].metadata
            envelopes.append((Message(pack_envelope(group, self.num_clients), node,
                                      f"{message_type}.{COHORT_ACTION}", ttl=first.ttl, group_id=first.group_id),
                              group))
        if not envelopes:
            return replies

        # matched by message id: the SuperLink's own error replies (node unavailable, reply
        # expired) come from node 1, not from the node the envelope went to
        answers = {r.metadata.reply_to_message_id: r
                   for r in self._grid.send_and_receive([e for e, _ in envelopes], timeout=timeout)}
        for envelope, group in envelopes:
            answer = answers.get(envelope.metadata.message_id)
            if answer is None:
                continue  # lost or late: none of its clients replied
            if answer.has_error():
                replies.extend(Message(Error(answer.error.code, answer.error.reason), reply_to=m) for m in group)
                continue
            try:
                replies.extend(unpack_replies(answer.content, group))
                self._log_note(answer.content)
            except (KeyError, ValueError, TypeError) as err:  # another fedaccel version on that node?
                reason = f"node {envelope.metadata.dst_node_id}: a malformed cohort reply ({err})"
                replies.extend(Message(Error(0, reason), reply_to=m) for m in group)
        return replies

    def _log_note(self, content: RecordDict) -> None:
        """What a node says about how it trains its slice (batched, or why
        not), in the server's log once per distinct line."""
        note = str(content[REPLY_INDEX].get("note", ""))
        if note and note not in self._notes:
            self._notes.add(note)
            if self._announce is not None:
                self._announce(note)
            else:
                log(INFO, "[fedaccel] cohort nodes: %s", note)
