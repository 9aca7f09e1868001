"""Partition <-> node membership (``fedaccel/membership.py``,
``NodeMembership``) driven through a strategy's ``configure_train``: node ids
that appear during a run are asked which partition they hold."""

from __future__ import annotations

import logging
import re

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from fakes import NODES, StubGrid, arrays, build

pytestmark = pytest.mark.usefixtures("server_identity")


# --------------------------------------------------------------------------- #
# node ids that appear during a run (a SuperNode restarted without SuperNode
# authentication registers again under a new node id)
# --------------------------------------------------------------------------- #
class QueryGrid(StubGrid):
    """Online node ids that change between rounds; nodes answer ``query``
    messages with the partition they hold (``claims``: node -> (pid, n), the
    reason of the error a ClientApp that raised gives, an ``Error`` of
    Flower's own, or a list of those: one per query, in turn)."""

    def __init__(self, online, claims):
        super().__init__(online)
        self.claims = claims
        self.queried: list[int] = []

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for i, m in enumerate(messages):
            assert m.metadata.message_type == "query"
            m.metadata.__dict__["_message_id"] = f"q{len(self.queried)}-{i}"
            node = m.metadata.dst_node_id
            self.queried.append(node)
            claim = self.claims.get(node)
            if isinstance(claim, list):
                claim = claim.pop(0)
            if claim is None:
                continue  # no answer before the timeout
            if isinstance(claim, str):
                out.append(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, claim), reply_to=m))
            elif isinstance(claim, Error):
                reply = Message(claim, reply_to=m)
                if claim.code != ErrorCode.CLIENT_APP_CRASHED:  # Flower's own delivery errors come
                    reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # from the SuperLink
                out.append(reply)
            else:
                record = ConfigRecord({"partition-id": claim[0], "num-partitions": claim[1]})
                out.append(Message(RecordDict({"partition": record}), reply_to=m))
        return out


def test_restarted_node_with_a_new_id_takes_over_its_partition(caplog):
    strategy = build("fedcdr", **{"clients-per-round": 3})
    strategy.accepted_round.update({0: 1, 1: 1, 2: 1})  # every partition's round-1 reply was applied
    grid = QueryGrid([101, 103, 202], {202: (1, 3)})  # node 102 went offline, 202 is new
    # INFO level on flwr's logger: earlier tests (quiet runs) may have raised it
    with caplog.at_level(logging.INFO, logger="flwr"):
        msgs = list(strategy.configure_train(2, arrays(w=[0.0]), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [101, 103, 202]
    assert strategy.federation.node_of_partition == {0: 101, 1: 202, 2: 103}
    # The partition keeps its history: the new node is told which round of its
    # state the server applied, so a lost state is detected (a disk state is found).
    assert all(m.content["config"]["accepted-round"] == 1 for m in msgs)
    assert "partition 1 is now served by node 202 (node 102 went offline" in caplog.text
    list(strategy.configure_train(3, arrays(w=[0.0]), ConfigRecord(), grid))
    assert grid.queried == [202]  # asked once


def test_new_node_waits_until_the_partitions_old_node_is_offline():
    strategy = build("fedavg")
    grid = QueryGrid([101, 102, 103, 202], {202: (1, 3)})  # a crashed node stays online ~60 s
    msgs = list(strategy.configure_train(1, arrays(w=[0.0]), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [101, 102, 103]
    grid._node_ids = [101, 103, 202]
    msgs = list(strategy.configure_train(2, arrays(w=[0.0]), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [101, 103, 202]
    assert grid.queried == [202]


def test_new_nodes_that_do_not_fit_the_run_are_never_used(caplog):
    strategy = build("fedavg")
    grid = QueryGrid([101, 103, 301, 302, 303, 304],
                     {301: (1, 5), 302: (7, 3), 303: "ValueError: no data"})  # 304 never answers
    for server_round in (1, 2):
        msgs = list(strategy.configure_train(server_round, arrays(w=[0.0]), ConfigRecord(), grid))
        assert sorted(m.metadata.dst_node_id for m in msgs) == [101, 102, 103]
    assert strategy.federation.node_of_partition == NODES
    assert sorted(grid.queried) == [301, 302, 303, 304]  # asked once each
    assert "not a partition of this run" in caplog.text and "no data" in caplog.text


class _SilentGrid(StubGrid):
    """Online nodes that never answer a query (a ClientApp that does not start in time)."""

    def send_and_receive(self, messages, *, timeout=None):
        return []


def test_discovery_says_when_online_nodes_do_not_answer():
    from fedaccel.errors import FederationError
    from fedaccel.experiment import discover_federation

    with pytest.raises(FederationError, match=r"^2 online node\(s\) did not say which partition they hold "
                                              r"within 0 s \(0 did\).*raise round-timeout.*; in Flower's "
                                              r"simulation, 2 SuperNodes can be more than this machine answers "
                                              r"for in that time: set fewer \(fedaccel-federations size "
                                              r"local-simulation N\)$"):
        discover_federation(_SilentGrid([5, 6]), timeout=0.05, poll=0.01)


# Flower's errors for a message that did not get through, or a ClientApp process that died
# (the ones of codes 3, 4 and 5 name the SuperLink as their source: QueryGrid does so too)
CRASHED = Error(ErrorCode.CLIENT_APP_CRASHED, "ClientApp stopped responding.")
UNAVAILABLE = Error(ErrorCode.MESSAGE_UNAVAILABLE, "Reply message objects are unavailable.")
REPLY_UNAVAILABLE = Error(ErrorCode.REPLY_MESSAGE_UNAVAILABLE, "Reply message has expired.")
NODE_UNAVAILABLE = Error(ErrorCode.NODE_UNAVAILABLE, "Node Unavailable")


def test_discovery_asks_again_after_flowers_own_errors_and_warns(caplog):
    """Nodes whose answers were errors of Flower's own (the ClientApp process
    died, the message or reply did not get through: a busy machine), two each,
    are asked again, with a warning naming the node the message went to (not
    the SuperLink the error came from), and the run starts; the node that
    answered is not asked again."""
    from fedaccel.experiment import discover_federation

    caplog.set_level(logging.WARNING, logger="flwr")
    grid = QueryGrid([5, 6, 7], {5: (0, 3), 6: [CRASHED, UNAVAILABLE, (1, 3)],
                                 7: [REPLY_UNAVAILABLE, NODE_UNAVAILABLE, (2, 3)]})
    federation = discover_federation(grid, timeout=5, poll=0.01)
    assert federation.node_of_partition == {0: 5, 1: 6, 2: 7}
    assert grid.queried == [5, 6, 7, 6, 7, 6, 7]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"[fedaccel] node {node} did not report its partition ({error.reason}); asking it again "
                        f"({attempt} of 3)"
                        for attempt, errors in ((2, (CRASHED, REPLY_UNAVAILABLE)), (3, (UNAVAILABLE, NODE_UNAVAILABLE)))
                        for node, error in zip((6, 7), errors)]


@pytest.mark.parametrize("claims, says, asked", [
    *[([error] * 3 + [(1, 2)], rf"{re.escape(error.reason)} \(3 such answers\)$", 3)
      for error in (CRASHED, UNAVAILABLE, REPLY_UNAVAILABLE, NODE_UNAVAILABLE)],
    (["ValueError: no data", (1, 2)], r"ValueError: no data$", 1),  # the ClientApp ran and raised: at once
    ([CRASHED, "ValueError: no data", (1, 2)], r"ValueError: no data$", 2),  # its own line, no count
])
def test_discovery_stops_at_an_error_that_recurs_or_that_the_clientapp_raised(claims, says, asked):
    from fedaccel.errors import FederationError
    from fedaccel.experiment import discover_federation

    grid = QueryGrid([5, 6], {5: (0, 2), 6: claims})
    with pytest.raises(FederationError, match=r"^node 6 could not report its partition: " + says):
        discover_federation(grid, timeout=5, poll=0.01)
    assert grid.queried == [5] + [6] * asked


def test_discovery_says_when_nodes_are_missing():
    from fedaccel.errors import FederationError
    from fedaccel.experiment import discover_federation

    with pytest.raises(FederationError, match=r"only 0 of \? clients registered within 0 s; in Flower's "
                                              r"simulation, set num-supernodes"):
        discover_federation(_SilentGrid([]), timeout=0.05, poll=0.01)
