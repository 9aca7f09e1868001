"""bench/round_breakdown.py times the pieces of a batched round and leaves
nothing patched behind."""

from __future__ import annotations

import pytest
from fakes import bench_script


@pytest.mark.slow  # a 6-round run: about 5 s
def test_it_times_each_piece_of_every_counted_round_and_restores_them(capsys):
    import fedaccel.experiment as experiment

    breakdown = bench_script("round_breakdown")
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in breakdown.timed_pieces()]
    round_end = experiment.Experiment.on_round_end
    assert breakdown.main(["scaffold", "--rounds", "6", "--clients", "6", "--per-round", "4"]) == 0
    out = capsys.readouterr().out
    assert "# scaffold: 4 of 6 clients a round, batched, the last 4 rounds:" in out
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.splitlines()
            if line.startswith("| ") and "piece" not in line}
    assert len(rows) == len(before)
    for label, (ms, calls) in rows.items():
        expected = 4.0 if "each one's" in label else 1.0  # once a round, or once per client
        assert float(calls.strip(" |")) == expected, (label, calls)
        assert float(ms) > 0, label
    assert all(getattr(owner, name) is original for owner, name, original in before)
    assert experiment.Experiment.on_round_end is round_end


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
