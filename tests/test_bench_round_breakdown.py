"""bench/round_breakdown.py times the pieces of a batched round and leaves
nothing patched behind."""

from __future__ import annotations

import re

import pytest
from fakes import bench_script


@pytest.mark.slow  # a 6-round run: about 5 s
def test_it_times_each_piece_of_every_counted_round_and_restores_them(capsys):
    import fedaccel.experiment as experiment

    import fedaccel.clients.scaffold as scaffold
    import fedaccel.strategies.base as strategy_base

    breakdown = bench_script("round_breakdown")
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in breakdown.timed_pieces()]
    released = strategy_base.release_reply_arrays
    assert "open_round" not in vars(scaffold.ScaffoldSolver)  # inherited: timed on the subclass, then removed
    round_end = experiment.Experiment.on_round_end
    also = ["fedaccel.strategies.base:release_reply_arrays", "fedaccel.clients.scaffold:ScaffoldSolver.open_round"]
    assert breakdown.main(["scaffold", "--rounds", "6", "--clients", "6", "--per-round", "4", "--also", *also]) == 0
    out = capsys.readouterr().out
    assert "# scaffold: 4 of 6 clients a round, batched, the last 4 rounds:" in out
    assert re.search(r"; \d+ minor page faults a round \(median\)\n", out)  # the process's, over the counted rounds
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.splitlines()
            if line.startswith("| ") and "piece" not in line}
    assert len(rows) == len(before) + 2 and set(also) <= set(rows)
    for label, (ms, calls) in rows.items():
        expected = 4.0 if "each one's" in label or "open_round" in label else 1.0  # once a round, or per client
        assert float(calls.strip(" |")) == expected, (label, calls)
        assert float(ms) > 0, label
    assert all(getattr(owner, name) is original for owner, name, original in before)
    assert strategy_base.release_reply_arrays is released
    assert "open_round" not in vars(scaffold.ScaffoldSolver)
    assert experiment.Experiment.on_round_end is round_end


@pytest.mark.parametrize("spec, says", [
    ("fedaccel.nope:thing", "--also fedaccel.nope:thing: cannot import fedaccel.nope"),
    ("fedaccel.clients.foof", "--also fedaccel.clients.foof: expected MODULE:FUNCTION or MODULE:CLASS.METHOD"),
    ("fedaccel.clients.foof:nope", "--also fedaccel.clients.foof:nope: nope is not a function or method of"),
    ("fedaccel.clients.foof:Nope.step", "--also fedaccel.clients.foof:Nope.step: fedaccel.clients.foof has no class Nope"),
    ("fedaccel.models.nets:MLP.batched_forward", "static and class methods are not timed"),
    ("fedaccel.clients.cohort:train_stacked", "--also: a piece is named twice"),
])
def test_a_piece_it_cannot_time_is_one_line_before_any_run(spec, says, capsys, monkeypatch):
    import fedaccel.local_run as local_run

    breakdown = bench_script("round_breakdown")
    monkeypatch.setattr(local_run, "run_local", lambda *a, **k: pytest.fail("no run for a bad --also"))
    with pytest.raises(SystemExit) as exit_:
        breakdown.main(["fedavg", "--also", spec])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("round_breakdown.py: error: ") and says in last, last


def test_a_run_that_fails_leaves_nothing_patched(monkeypatch):
    import fedaccel.experiment as experiment
    import fedaccel.local_run as local_run

    breakdown = bench_script("round_breakdown")
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in breakdown.timed_pieces()]
    round_end = experiment.Experiment.on_round_end

    def failing_run(cfg, clients, quiet=False):
        raise RuntimeError("the run failed")

    monkeypatch.setattr(local_run, "run_local", failing_run)
    with pytest.raises(RuntimeError, match="the run failed"):
        breakdown.main(["fedavg", "--rounds", "3", "--clients", "2", "--per-round", "2"])
    assert all(getattr(owner, name) is original for owner, name, original in before)
    assert experiment.Experiment.on_round_end is round_end


@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_an_unknown_algorithm_is_one_line_through_the_real_command():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "round_breakdown.py"
    proc = subprocess.run([sys.executable, str(script), "nope", "--rounds", "3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "round_breakdown.py: error: invalid run config: algo='nope': allowed: fedacg,"), proc.stderr
