"""Client error replies, as the server reports them: once each, with who and why.

A client's error reply is logged once per run as one line naming the node, its
partition and the cause (:meth:`ClientErrorLog.report`); a round in which
every client failed stops with those causes (:meth:`ClientErrorLog.causes`);
at the end of a run, the errors that recurred are counted
(:meth:`ClientErrorLog.report_repeats`).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from logging import DEBUG, ERROR, WARNING

from flwr.app import Context, Error, Message
from flwr.common import log
from flwr.common.constant import ErrorCode

from fedaccel.contract import ContractError
from fedaccel.errors import USER_ERRORS

# a cohort node's envelopes are "train.cohort" and "evaluate.cohort" messages (fedaccel.cohort_nodes,
# which imports it from here: its error replies and logs are this module's)
COHORT_ACTION = "cohort"


def exception_reply(message: Message, err: BaseException) -> Message:
    """The error reply Flower's engines give for an exception raised in the
    ClientApp (code 2), its reason the exception's own line (``RuntimeError:
    boom``): the fast runner's, and one client's of a cohort node's slice."""
    reason = "".join(traceback.format_exception_only(type(err), err)).strip()
    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)


def node_label(context: Context, message: Message | None = None) -> str:
    """``node <node id> (partition <partition-id>)``, as the server's log shows
    it; for a cohort node's envelope (a ``<type>.cohort`` ``message``, whose
    node's ``partition-id`` is the slot of the clients it serves, not a
    client's partition) ``cohort node <node id> (slot <partition-id>)``."""
    where = context.node_config.get("partition-id", "?")
    if message is not None and message.metadata.message_type.endswith("." + COHORT_ACTION):
        return f"cohort node {context.node_id} (slot {where})"
    return f"node {context.node_id} (partition {where})"


_RAISED: set[str] = set()  # the exceptions this process has logged with their traceback


def log_raised(label: str, err: BaseException) -> None:
    """Log a client's exception (a bug, not a user error) with its traceback,
    the first time this process sees that error (``label`` names the node);
    later at DEBUG. What a SuperNode does for a ClientApp exception, for the
    fast runner's and the cohort nodes' clients, batched or not. A user
    error (or a message of another version's contract) is never logged so: its
    reply's one line says it."""
    if isinstance(err, (*USER_ERRORS, ContractError)):
        return
    reason = "".join(traceback.format_exception_only(type(err), err)).strip()
    log(DEBUG if reason in _RAISED else ERROR, "[fedaccel] %s raised", label, exc_info=err)
    _RAISED.add(reason)


def last_line(reason: str | None) -> str:
    """The last line of an error reason (Flower's reasons end with the exception)."""
    lines = (reason or "").strip().splitlines()
    return lines[-1] if lines else "no reason given"


# How Flower's engines word an exception raised in a ClientApp:
# a SuperNode "<class 'RuntimeError'>:<'disk on fire'>", the Ray simulation
# "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException
# ClientAppException occurred. Message: disk on fire'>" (the type is lost).
_FLOWER_REASON = re.compile(r"^<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>$", re.DOTALL)
_RAY_WRAPPER = "Exception ClientAppException occurred. Message: "


def exception_cause(reason: str | None) -> str:
    """One line for an exception Flower turned into an error reply, worded as
    the fast runner words it (``RuntimeError: disk on fire``) on every engine;
    the Ray simulation does not pass the type on, so there it is the message alone."""
    match = _FLOWER_REASON.match((reason or "").strip())
    if not match:
        return last_line(reason)
    kind, text = match.group(1), match.group(2).strip()
    if text.startswith(_RAY_WRAPPER):
        kind, text = "", text[len(_RAY_WRAPPER):]
    text = last_line(text)
    return f"{kind}: {text}" if kind else text


class ClientErrorLog:
    """The error replies seen in a run: ``"node N (partition P): cause"`` ->
    the rounds it came in.

    ``partition_of_node`` gives the current node -> partition map (it changes
    when a partition moves to a restarted node); ``num_rounds`` is the run's.
    """

    def __init__(self, partition_of_node: Callable[[], dict[int, int]], num_rounds: int) -> None:
        self.partition_of_node = partition_of_node
        self.num_rounds = num_rounds
        # over the whole run, carried over a resume (the strategy's client_error_rounds)
        self.seen: dict[str, set[int]] = {}
        # logged by this process: a resumed run logs an error it had before once more,
        # since that line went to the console of the process that was stopped
        self.logged: set[str] = set()

    def who_and_cause(self, reply: Message) -> tuple[str, str]:
        """``(who, cause)`` of an error reply; ``who`` is ``node N (partition P)``.

        The ClientApp's replies for user errors read ``node N (partition P):
        cause`` (fedaccel/apps/client_app.py); for any other error (an exception Flower
        turned into a reply, with a traceback on the node) the cause is the
        reason's last line and the partition is the one the server knows.
        """
        node = reply.metadata.src_node_id
        text = last_line(reply.error.reason)
        if text.startswith(f"node {node} (partition ") and "): " in text:
            who, cause = text.split("): ", 1)
            return who + ")", cause
        return f"node {node} (partition {self.partition_of_node().get(node, '?')})", exception_cause(reply.error.reason)

    def report(self, server_round: int, replies: list[Message], phase: str = "") -> int:
        """Log each error reply's node and cause at WARNING, once per run (and
        process) for each distinct line (the rounds it recurs in are kept in
        :attr:`seen`); returns how many lines were logged."""
        new = 0
        for m in replies:
            if not m.has_error():
                continue
            line = ": ".join(self.who_and_cause(m))
            if line not in self.logged:
                new += 1
                self.logged.add(line)
                log(WARNING, "[fedaccel] client failed in round %s%s: %s", server_round, phase, line)
            self.seen.setdefault(line, set()).add(server_round)
        return new

    def causes(self, replies: list[Message], most: int = 5) -> list[str]:
        """The distinct causes of the error replies, each with the clients it
        hit (``node N (partition P) and 2 other clients: cause``), at most ``most``."""
        by_cause: dict[str, list[str]] = {}
        for m in replies:
            if m.has_error():
                who, cause = self.who_and_cause(m)
                by_cause.setdefault(cause, []).append(who)
        out = []
        for cause, whos in by_cause.items():
            others = len(whos) - 1
            who = whos[0] if not others else f"{whos[0]} and {others} other client{'s' * (others > 1)}"
            out.append(f"{who}: {cause}")
        if len(out) > most:
            out = out[:most] + [f"{len(out) - most} other causes (see the warnings above)"]
        return out

    def report_repeats(self) -> None:
        """At the end of a run: in how many rounds each reported client error recurred."""
        for line, rounds in self.seen.items():
            if len(rounds) > 1:
                where = "reported once above" if line in self.logged else "before the run was resumed"
                log(WARNING, "[fedaccel] client failed in %s of %s rounds (%s, first in round %s): %s",
                    len(rounds), self.num_rounds, where, min(rounds), line)
