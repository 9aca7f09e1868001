"""A Grid that runs the ClientApp in this process: the fast local runner.

Flower ships two Grids: the gRPC one (SuperLink) and the in-memory one its
Ray simulation drives through a LinkState, with 0.1 s polling. Neither runs a
ClientApp synchronously in one process, so this Grid is written here by hand.
It delivers each message to ``client_app(message, context)`` directly, keeps
one :class:`~flwr.app.Context` (with its persistent ``state``) per simulated
node, and turns client exceptions into error replies as Flower does. The same
ServerApp and ClientApp objects run unchanged on it.

Given a ``cohort_trainer``, the training messages of a round are handed to it
together (the ClientApp's ``train`` for all of them at once, batched), and
every other message goes to the ClientApp one by one.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedaccel.checkpoint import (disk_state_files, record_dict_bytes, record_dict_from_bytes,
                                 restore_disk_state_files)
from fedaccel.client_errors import exception_reply, log_raised, node_label
from fedaccel.clients.stacked_state import StackedClientStates, StackedStateRecord
from fedaccel.clients.state import state_run_dir
from fedaccel.torch_utils import derive_seed

CLIENT_APP_RAISED_EXCEPTION = ErrorCode.CLIENT_APP_RAISED_EXCEPTION  # 2, as Flower's engines reply
SUPERLINK_NODE_ID = 1  # the server's node id, as in Flower


@contextmanager
def task_identity(run_id: int) -> Iterator[None]:
    """The ServerApp's identity for this process while the block runs.

    ``Message()`` reads the sender's identity from Flower's process-wide
    ``TaskIdentity``, which a ServerApp process sets once under ``flwr run``.
    The fast runner runs inside the caller's process, so it sets the identity
    for the run and puts the caller's back afterwards instead of overwriting it.
    """
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # noqa: SLF001
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 0
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # noqa: SLF001


class LocalGrid(Grid):
    """In-process Grid over ``num_clients`` simulated nodes.

    Node ids are derived from ``seed`` (Flower's are random), partition ids
    are ``0..num_clients-1`` as in ``flwr run``'s simulation.
    """

    def __init__(self, client_app: ClientApp, run_config: dict, num_clients: int,
                 seed: int = 0, run_id: int | None = None,
                 cohort_trainer: Callable[[list[tuple[Message, Context]]], list[Message]] | None = None) -> None:
        # A fresh run id per grid, as Flower gives each run: disk client state
        # is keyed by it, so two runs never share state.
        run_id = run_id if run_id is not None else secrets.randbits(62) + 1
        self.client_app = client_app
        self.run_config = dict(run_config)
        self.cohort_trainer = cohort_trainer
        self._run = Run.create_empty(run_id)
        self._pending: dict[str, Message] = {}
        self._replies: dict[str, Message] = {}
        self.contexts: dict[int, Context] = {}
        # every client's state (client-state='context') as rows of one store
        self.client_states = StackedClientStates(num_clients)
        for pid in range(num_clients):
            node_id = derive_seed(seed, "node", pid) or pid + 1
            self.contexts[node_id] = Context(
                run_id=run_id,
                node_id=node_id,
                node_config={"partition-id": pid, "num-partitions": num_clients},
                state=StackedStateRecord(self.client_states, pid),
                run_config=dict(run_config),
            )

    def serve(self, server_app: Any, context: Context) -> None:
        """Run ``server_app`` on this grid, with the process's task identity set
        to this run for as long as it runs (:func:`task_identity`)."""
        with task_identity(self.run.run_id):
            server_app(self, context)

    # ----------------------------------------------------------- Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            self._pending[message_id] = message
            ids.append(message_id)
        return ids

    # ------------------------------------------------ clients' state (checkpoints)
    @property
    def client_store(self) -> "LocalGrid":
        """This grid holds every client's state where the server can save it
        (:class:`fedaccel.experiment.ClientStore`); Flower's grids do not."""
        return self

    def _disk_state_dir(self) -> Path:
        return state_run_dir(str(self.run_config.get("state-dir", "")), self.run.run_id)

    def client_state_files(self) -> dict[str, bytes]:
        """Every client's state as files: ``context/<partition>.pb`` (its
        ``context.state``, Flower's protobuf) and ``disk/<path>`` (the files
        of ``client-state='disk'``, relative to this run's state folder)."""
        files = {}
        for c in self.contexts.values():
            saved = c.state.saved() if isinstance(c.state, StackedStateRecord) else c.state
            if len(saved):
                files[f"context/{c.node_config['partition-id']}.pb"] = record_dict_bytes(saved)
        files.update(disk_state_files(self._disk_state_dir()))
        return files

    def restore_client_state_files(self, files: dict[str, bytes]) -> None:
        """Put back what :meth:`client_state_files` saved (replacing any state)."""
        by_partition = {int(c.node_config["partition-id"]): c for c in self.contexts.values()}
        for context in by_partition.values():
            if isinstance(context.state, StackedStateRecord):
                context.state.restore(RecordDict())
            else:
                context.state = RecordDict()
        for name, data in files.items():
            if name.startswith("context/"):
                context = by_partition[int(name.removeprefix("context/").removesuffix(".pb"))]
                if isinstance(context.state, StackedStateRecord):
                    context.state.restore(record_dict_from_bytes(data))
                else:
                    context.state = record_dict_from_bytes(data)
        restore_disk_state_files(self._disk_state_dir(), files)

    @property
    def trains_cohorts(self) -> bool:
        """Whether a round's training messages are trained as one batch."""
        return self.cohort_trainer is not None

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        message_ids = list(message_ids)
        if self.cohort_trainer is not None:
            self._deliver_cohort([i for i in message_ids if i in self._pending
                                  and self._pending[i].metadata.message_type == MessageType.TRAIN
                                  and self._pending[i].metadata.dst_node_id in self.contexts])
        out = []
        for message_id in message_ids:
            if message_id in self._pending:
                self._replies[message_id] = self.deliver(self._pending.pop(message_id))
            if message_id in self._replies:
                out.append(self._replies.pop(message_id))
        return out

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    # ------------------------------------------------------------ helpers
    def _deliver_cohort(self, message_ids: list[str]) -> None:
        """The training messages ``message_ids``, trained together; an
        exception (a bug, raised for all of them) becomes every one's error
        reply, as :meth:`deliver` does for one message."""
        if not message_ids:
            return
        messages = [self._pending.pop(i) for i in message_ids]
        items = [(m, self.contexts[m.metadata.dst_node_id]) for m in messages]
        try:
            replies = self.cohort_trainer(items)
        except Exception as err:  # a client failure is a reply, as in Flower (which logs it)
            log_raised(f"a cohort of {len(messages)} clients", err)
            replies = [exception_reply(m, err) for m in messages]
        for message_id, reply in zip(message_ids, replies):
            self._replies[message_id] = reply

    def deliver(self, message: Message) -> Message:
        context = self.contexts.get(message.metadata.dst_node_id)
        if context is None:
            return Message(Error(CLIENT_APP_RAISED_EXCEPTION,
                                 f"unknown node {message.metadata.dst_node_id}"), reply_to=message)
        try:
            reply = self.client_app(message, context)
        except Exception as err:  # a client failure is a reply, as in Flower (which logs it)
            log_raised(node_label(context, message), err)
            return exception_reply(message, err)
        return reply
