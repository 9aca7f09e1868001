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


@pytest.fixture
def results(tmp_path):
    """An empty results folder (the dashboard tests' root)."""
    root = tmp_path / "results"
    root.mkdir()
    return root


@pytest.fixture
def client(results):
    """The dashboard's app over ``results``, through FastAPI's TestClient."""
    import warnings

    from fedaccel.dashboard.app import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's note about httpx versions
        from fastapi.testclient import TestClient

    app = create_app([results])
    yield TestClient(app)
    app.state.launcher.shutdown()


@pytest.fixture
def sigint_ignored():
    """This process ignores SIGINT (as a script's background job does), and
    so do the processes it starts; restored afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)
