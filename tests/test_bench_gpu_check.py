"""bench/gpu_check.py: the prepared GPU run (steps, budget, kit) works, here on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import bench_script

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    return bench_script("gpu_check")


def test_steps_run_in_order_of_worth_and_go_to_the_device_asked_for(tmp_path):
    gpu_check = _gpu_check()
    steps = gpu_check.step_commands(tmp_path, sys.executable, "cuda")
    assert [name for name, *_ in steps] == ["env", "pytest", "equivalence", "overhead-100", "overhead-10",
                                            "cnn-1000", "overhead-fmnist", "profile-cnn-1000"]
    for name, cmd, limit, needs_fmnist in steps:
        assert 0 < limit <= 420, name  # each step well inside one 10-minute device call
        if "overhead.py" in " ".join(cmd):
            assert cmd[cmd.index("--device") + 1] == "cuda" and "ray" not in cmd, name
        assert needs_fmnist == (name in ("cnn-1000", "overhead-fmnist", "profile-cnn-1000")), name
    cnn = dict((name, cmd) for name, cmd, *_ in steps)["cnn-1000"]
    assert cnn[cnn.index("--clients") + 1] == cnn[cnn.index("--per-round") + 1] == "1000"


def test_a_spent_budget_skips_every_step_and_says_so(tmp_path):
    gpu_check = _gpu_check()
    assert gpu_check.run(tmp_path / "kit", tmp_path / "out", budget=0, only=None, device="cpu") == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][:3] == ["env", "pytest", "equivalence"]
    assert all(r["status"] == "skipped" and r["reason"] for r in rows)
    assert "done in" in (tmp_path / "out" / "log.txt").read_text()


@pytest.mark.slow  # the GPU kit tool, end to end: the full suite runs it
def test_a_budget_shorter_than_a_minute_still_runs_a_step(tmp_path):
    """``--budget 30 --only env``: the step runs (it once needed a full minute
    left, so a budget of exactly 60 s skipped it)."""
    gpu_check = _gpu_check()
    gpu_check.run(tmp_path / "kit", tmp_path / "out", budget=30, only=["env"], device="cpu")
    rows = [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["env"]
    assert rows[0]["status"] in ("passed", "cut at the budget"), rows


@pytest.mark.slow  # the GPU kit tool, end to end: the full suite runs it
def test_a_step_that_overruns_is_stopped_with_the_processes_it_started(tmp_path):
    """bench/overhead.py measures in child processes: a step stopped at its
    limit takes its children with it, and the budget's cut is not a failure."""
    import os
    import time

    gpu_check = _gpu_check()
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with open(tmp_path / "log.txt", "w") as log:
        t0 = time.monotonic()
        assert gpu_check.run_step([sys.executable, "-c", script], dict(os.environ), log, limit=3) == "timed out"
        assert time.monotonic() - t0 < 30
        assert gpu_check.run_step([sys.executable, "-c", "pass"], dict(os.environ), log, limit=30) == "passed"
        assert gpu_check.run_step([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), log,
                                  limit=30) == "failed (exit 3)"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") and \
            "Z" not in open(f"/proc/{child}/stat").read().split()[2]:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"


def test_an_unknown_step_is_refused_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "run", "--only", "warmup"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "--only warmup: unknown step; the steps are env, pytest, equivalence" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # the GPU kit tool, end to end: the full suite runs it
def test_the_equivalence_step_measures_batched_against_per_client(tmp_path):
    """On the CPU the batched MLP round is within float32 rounding of the
    per-client round; the step writes one row per (algorithm, model, TF32)."""
    gpu_check = _gpu_check()
    row = gpu_check.round_difference("fedcdr", "mlp", "cpu", False, {"fedcdr.eta": 0.5})
    assert row["clients"] == 7 and 0 <= row["max_abs_diff"] < 1e-5 and row["max_rel_diff"] < 1e-4


@pytest.mark.slow  # a real run of three steps in fresh interpreters (about 30 s)
def test_a_dry_run_on_the_cpu_passes_its_first_steps(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "run", "--device", "cpu",
                           "--out", str(tmp_path), "--only", "env", "equivalence"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] and "matmul_allow_tf32" in env
    rows = json.loads((tmp_path / "equivalence.json").read_text())
    assert {(r["algo"], r["model"]) for r in rows} == {("fedavg", "mlp"), ("scaffold", "mlp"), ("feddc", "mlp"),
                                                       ("fedcdr", "mlp"), ("fedpm", "mlp"), ("fedavg", "cnn")}
    assert {r["tf32"] for r in rows} == {True, False}
    scaffold = [r for r in rows if r["algo"] == "scaffold"]
    assert {r["changes"].get("scaffold.cv-update", "default") for r in scaffold} == {"default", "option-ii"}
    assert all(0 <= r["max_abs_diff"] < 1e-5 for r in rows if r["model"] == "mlp")  # float32 rounding, measured
