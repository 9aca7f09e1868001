"""Shared by the dashboard tests: recorded run folders and a live server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

from fedaccel.results import RunRecorder

POST = {"X-Fedaccel": "1"}


def record_run(root: Path, name: str, rounds: int, accs: list[float], finish: bool = True,
               algo: str = "fedavg", seed: int = 0, **config) -> RunRecorder:
    """A run folder as RunRecorder writes it, with the given accuracies."""
    cfg = {"algo": algo, "dataset": "synthetic", "seed": seed, "num-server-rounds": rounds,
           "target-accuracy": 0.5, "run-name": name, "results-dir": str(root), **config}
    rec = RunRecorder(root / name, cfg, 0.5, rounds, quiet=True)
    for r, acc in enumerate(accs, 1):
        rec.log_round({"round": r, "accg": acc, "loss": 1.0 - acc, "accl": None,
                       "bytes_up": 1000 * r, "bytes_down": 2000, "seconds": 0.5})
    if finish:
        rec.finish()
    return rec


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def set_status(run_dir: Path, **changes) -> None:
    path = run_dir / "status.json"
    status = json.loads(path.read_text())
    status.update(changes)
    path.write_text(json.dumps(status))


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll ``condition`` until it returns something truthy (returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(roots: list[Path], token: str | None = None, poll_seconds: float = 0.2) -> Iterator[str]:
    """The dashboard served by uvicorn in a thread; yields its base URL."""
    import uvicorn

    from fedaccel.dashboard.app import create_app

    app = create_app(roots, token=token, poll_seconds=poll_seconds)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: server.started, 30, "the dashboard to start")
    try:
        yield base
    finally:
        app.state.launcher.shutdown()
        for launched in app.state.launcher.launched.values():
            try:
                launched.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launched.process.kill()
        server.should_exit = True
        thread.join(timeout=30)


def run_state(base: str, run_id: str) -> dict | None:
    runs = httpx.get(f"{base}/api/runs", timeout=30).json()["runs"]
    return next((r for r in runs if r["id"] == run_id), None)
