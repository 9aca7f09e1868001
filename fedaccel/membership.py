"""Which node serves which data partition, and following a partition to a new node.

The server learns at discovery which partition each node holds (one ``query``
message per node, :func:`query_partitions`). The partitions are fixed for the
run; the node serving one may change when a SuperNode restarts without
SuperNode authentication (:class:`NodeMembership`).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedaccel.client_errors import exception_cause

# Flower's error replies for a message that did not get through, or a
# ClientApp process that died, as opposed to one that ran and raised: asking
# again can succeed (a busy SuperLink or SuperNode, a reply whose upload
# expired, a node that restarted).
TRANSIENT_ERROR_CODES = frozenset({ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
                                   ErrorCode.NODE_UNAVAILABLE, ErrorCode.CLIENT_APP_CRASHED})


TRANSIENT_ATTEMPTS = 3  # discovery asks a node at most this often while its answers are transient errors


class TransientAnswer(str):
    """The cause of an error reply with a code of :data:`TRANSIENT_ERROR_CODES`
    (a ``str`` like any other failed answer of :func:`query_partitions`)."""


@dataclass(frozen=True)
class Federation:
    """What the server learned about the clients: partition id <-> node id.

    The partitions are fixed for the run; the node serving one may change
    (:meth:`NodeMembership.follow_restarted_nodes` updates the dict in place).
    """

    node_of_partition: dict[int, int]

    @property
    def num_clients(self) -> int:
        return len(self.node_of_partition)

    @property
    def partition_of_node(self) -> dict[int, int]:
        return {node: pid for pid, node in self.node_of_partition.items()}


def query_partitions(grid: Grid, node_ids: list[int], timeout: float) -> dict[int, tuple[int, int] | str]:
    """Ask nodes which data partition they hold (one ``query`` message each).

    Returns ``{node: (partition-id, num-partitions)}``, or the error's last line
    for a node whose reply was an error (a :class:`TransientAnswer` where
    Flower says the message or reply did not get through, or the ClientApp
    died); nodes that did not reply within ``timeout`` seconds are missing
    from the result.
    """
    messages = [Message(RecordDict({"config": ConfigRecord()}), node, MessageType.QUERY)
                for node in node_ids]
    found: dict[int, tuple[int, int] | str] = {}
    replies = grid.send_and_receive(messages, timeout=timeout)
    # the node each message went to (the grid gave each its id when it sent it): Flower's own
    # errors for a message that did not get through name the SuperLink as their source
    asked = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}
    for reply in replies:
        node = asked.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        if reply.has_error():
            cause = exception_cause(reply.error.reason)
            found[node] = TransientAnswer(cause) if reply.error.code in TRANSIENT_ERROR_CODES else cause
            continue
        rec = reply.content.config_records["partition"]
        found[node] = (int(rec["partition-id"]), int(rec["num-partitions"]))
    return found


class NodeMembership:
    """Keeps a :class:`Federation` current while a run goes on.

    ``query_timeout``: how long a node that appeared during the run has to say
    which partition it holds.
    """

    def __init__(self, federation: Federation, query_timeout: float) -> None:
        self.federation = federation
        self.query_timeout = query_timeout
        # Node ids seen after discovery: claims waiting for the partition's old
        # node to go offline (node -> partition id), and nodes that will not be used.
        self._pending: dict[int, int] = {}
        self._ignored: set[int] = set()

    def follow_restarted_nodes(self, grid: Grid) -> None:
        """Hand a partition to a node id that appeared after discovery.

        A SuperNode started without SuperNode authentication registers itself
        with a fresh key on every start, so after a restart it holds the same
        partition under a new node id, and the old id stays offline for good.
        (With authentication the registered key fixes the node id and nothing
        changes here.) Each new online node is asked once which partition it
        holds; it takes over that partition as soon as the partition's old node
        is offline (a crashed SuperNode counts as online for up to ~60 s). A
        node that claims a partition whose node stays online, that reports
        another ``num-partitions``, or that does not answer is never used.
        """
        online = list(grid.get_node_ids())
        known = self.federation.partition_of_node
        new = [n for n in online
               if n not in known and n not in self._pending and n not in self._ignored]
        if new:
            timeout = self.query_timeout
            found = query_partitions(grid, new, timeout)
            for node in new:
                answer = found.get(node, f"no answer within {timeout:g} s")
                if isinstance(answer, str):
                    log(WARNING, "node %s joined during the run but could not report its "
                        "partition (%s); it is not used", node, answer)
                    self._ignored.add(node)
                elif answer[1] != self.federation.num_clients or answer[0] not in self.federation.node_of_partition:
                    log(WARNING, "node %s joined during the run with partition-id=%s "
                        "num-partitions=%s, which is not a partition of this run (%s clients); "
                        "it is not used", node, answer[0], answer[1], self.federation.num_clients)
                    self._ignored.add(node)
                else:
                    self._pending[node] = answer[0]
                    log(INFO, "[fedaccel] node %s joined during the run with partition %s; it "
                        "takes the partition over once node %s is offline", node, answer[0],
                        self.federation.node_of_partition[answer[0]])
        online_set = set(online)
        for node, pid in sorted(self._pending.items()):
            old = self.federation.node_of_partition[pid]
            if node not in online_set or old in online_set:
                continue  # wait: the new node went away, or the old one is still online
            self.federation.node_of_partition[pid] = node
            del self._pending[node]
            log(INFO, "[fedaccel] partition %s is now served by node %s (node %s went offline; "
                "a restarted SuperNode without SuperNode authentication gets a new node id)",
                pid, node, old)
