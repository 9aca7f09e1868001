"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def server_identity(monkeypatch):
    """Message() reads the sender's identity from the process, as the
    ServerApp process sets it under flwr run; tests that build messages by
    hand use this (``pytestmark = pytest.mark.usefixtures("server_identity")``)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)
