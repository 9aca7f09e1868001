"""SIGINT stops a run: reliably, and also where it was inherited as ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedaccel.local_run import default_run_config, fuse, run_local
from fedaccel.processes import SIGINT_STOPS_ENV, raise_if_stop_requested, stop_on_sigint
from fedaccel.results import RunRecorder

from dashboard_helpers import wait_for


def small_config(tmp_path: Path, name: str, **extra) -> dict:
    return fuse(default_run_config(), {
        "algo": "fedavg", "num-server-rounds": 6, "clients-per-round": 3, "local-epochs": 1,
        "synthetic.max-samples": 120, "results-dir": str(tmp_path), "run-name": name, **extra})


@pytest.fixture
def sigint(request):
    """SIGINT's handler as the test sets it, restored afterwards."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_sigint_raises_and_is_remembered_until_the_block_ends(sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with stop_on_sigint():
        raise_if_stop_requested()  # nothing asked yet
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # the flag outlives a swallowed exception
            raise_if_stop_requested()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    raise_if_stop_requested()  # cleared on the way out


def test_nested_blocks_keep_the_outer_handler_and_flag(sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with stop_on_sigint():
        outer = signal.getsignal(signal.SIGINT)
        with stop_on_sigint():
            assert signal.getsignal(signal.SIGINT) is outer
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                pass  # swallowed, as Python does in a finalizer
        with pytest.raises(KeyboardInterrupt):  # the inner block did not clear the request
            raise_if_stop_requested()


def test_inherited_ignore_is_kept_unless_the_starter_asks(sigint, monkeypatch):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    monkeypatch.delenv(SIGINT_STOPS_ENV, raising=False)
    with stop_on_sigint():  # a script's background job: Ctrl-C in its terminal must not stop it
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        raise_if_stop_requested()
    monkeypatch.setenv(SIGINT_STOPS_ENV, "1")
    with stop_on_sigint():  # the dashboard launched it in its own session: SIGINT is its stop button
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_swallowed_interrupt_still_stops_the_run_after_its_round(tmp_path, monkeypatch, sigint):
    """A KeyboardInterrupt lost inside the run (Python drops exceptions in
    finalizers and some callbacks) must not leave it running: it stops at the
    end of the round with status 'stopped' and the rounds it finished."""
    original = RunRecorder.log_round

    def log_round_then_interrupt_swallowed(self, row):
        original(self, row)
        if row["round"] == 2:
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                pass

    monkeypatch.setattr(RunRecorder, "log_round", log_round_then_interrupt_swallowed)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt), stop_on_sigint():
        run_local(small_config(tmp_path, "lost"), num_clients=6, quiet=True)
    status = json.loads((tmp_path / "lost" / "status.json").read_text())
    rows = (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines()
    assert status["state"] == "stopped" and status["round"] == len(rows) == 2


@pytest.mark.slow  # a fresh interpreter runs it
def test_fedaccel_run_started_with_sigint_ignored_stops_when_its_starter_asked(tmp_path):
    """The dashboard's case: started by a process that ignores SIGINT (a
    script's background job), in its own session, with the environment
    saying SIGINT stops it."""
    keys = {"num-server-rounds": 500, "clients-per-round": 3, "results-dir": str(tmp_path), "run-name": "ignored"}
    argv = [sys.executable, "-m", "fedaccel.local_run", "--num-clients", "6", "--quiet",
            *(f"{k}={json.dumps(v)}" for k, v in keys.items())]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, SIGINT_STOPS_ENV: "1"}, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    metrics = tmp_path / "ignored" / "metrics.jsonl"
    try:
        wait_for(lambda: proc.poll() is not None or (metrics.is_file() and metrics.read_text().count("\n") >= 1),
                 120, "round 1")
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "fedaccel-run: stopped" in err
    assert json.loads((tmp_path / "ignored" / "status.json").read_text())["state"] == "stopped"
