"""Test doubles shared by the strategy tests (imported as ``from fakes import ...``)."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.serverapp import Grid


class StubGrid(Grid):
    """A Grid that only knows its node ids: strategies build their messages
    against it and the tests deliver replies by hand."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def set_run(self, run):  # pragma: no cover - unused
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover - unused
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover - unused
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover - unused
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover - unused
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - unused
        raise NotImplementedError
