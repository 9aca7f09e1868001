"""bench/overhead.py compares like with like: its bare PyTorch loop and the
fast runner train the same clients the same way and end at the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fakes import bench_script

ROOT = Path(__file__).resolve().parents[1]


def _overhead():
    return bench_script("overhead")


@pytest.mark.parametrize("algo, mode", [("fedavg", "fast"), ("fedcdr", "cohort"), ("scaffold", "cohort"), ("feddc", "cohort"),
                                        pytest.param("fedcdr", "fast", marks=pytest.mark.slow),
                                        pytest.param("fedpm", "fast", marks=pytest.mark.slow)])
@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_bare_loop_and_fast_runner_reach_the_same_model(tmp_path, algo, mode):
    overhead = _overhead()
    ov = overhead.overrides("mlp-synthetic", algo, rounds=3, clients=20, run_dir=tmp_path, name=algo,
                            mode=mode)
    assert ov["cohort-batching"] == ("on" if mode == "cohort" else "off")
    bare = overhead.bare_run(ov, 20)
    fast = overhead.fast_run(ov, 20)
    assert len(bare["round_seconds"]) == len(fast["round_seconds"]) == 3
    with np.load(Path(fast["folder"]) / "final_model.npz") as final:
        assert sorted(final.files) == sorted(bare["final"])
        for key, want in bare["final"].items():
            np.testing.assert_allclose(final[key], want.numpy(), rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("argv, wanted", [
    (["--device", "gpu0"], "--device gpu0: not a torch device; use cpu or cuda[:N]"),
    (["--device", "cuda", "--modes", "bare", "ray"], "--device cuda: "),
])
def test_a_wrong_device_is_one_line_before_any_run(tmp_path, capsys, argv, wanted):
    """``--device``: a name torch does not know, a GPU this machine lacks, or a
    GPU with the Ray modes, gets one line and exit code 2 before anything runs."""
    with pytest.raises(SystemExit) as stop:
        _overhead().main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and wanted in err.splitlines()[-1] and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("algo", ["fedavg", "scaffold"])
def test_no_steps_mode_takes_out_the_steps_and_nothing_else(tmp_path, algo):
    """Mode ``no-steps`` (the framework's floor under a batched round): the
    same batched run, every message and reply included, with the model left
    where it started: after 3 rounds it is the model after 1 (to float32
    rounding of the weighted mean), while the real run's moves; the
    module's trainer is restored after. SCAFFOLD too (its batched end reads
    a zero grad_sum when the trainer never asked for its step tensors)."""
    import fedaccel.clients.cohort as cohort

    overhead = _overhead()
    trainer = cohort.train_stacked

    def final(run) -> dict:
        with np.load(Path(run["folder"]) / "final_model.npz") as f:
            return {k: f[k] for k in f.files}

    runs = {}
    for name, rounds in (("one", 1), ("three", 3)):
        ov = overhead.overrides("mlp-synthetic", algo, rounds=rounds, clients=20, run_dir=tmp_path, name=name,
                                mode="no-steps")
        assert ov["cohort-batching"] == "on"
        runs[name] = overhead.no_steps_run(ov, 20)
        assert cohort.train_stacked is trainer
    assert len(runs["three"]["round_seconds"]) == 3
    one, three = final(runs["one"]), final(runs["three"])
    for key in one:
        np.testing.assert_allclose(three[key], one[key], rtol=1e-6, atol=1e-7, err_msg=key)
    real = final(overhead.fast_run({**ov, "run-name": "real"}, 20))
    assert max(float(np.abs(real[k] - three[k]).max()) for k in real) > 1e-3


@pytest.mark.slow  # a real child run (7 s)
def test_profile_writes_each_runs_profile_and_marks_its_row(tmp_path):
    """``--profile``: each child run writes its cProfile (by cumulative and by
    own time, and the raw ``.prof`` beside it for pstats) to
    ``<out>/profiles/``; its record says ``profiled`` and the table labels
    the row, so inflated timings are never read as a measurement."""
    import pstats

    overhead = _overhead()
    assert overhead.main(["--workloads", "mlp-synthetic", "--algos", "fedavg", "--modes", "cohort",
                          "--clients", "20", "--rounds", "2", "--profile", "--out", str(tmp_path)]) == 0
    profiles = sorted((tmp_path / "profiles").iterdir())
    assert [p.suffix for p in profiles] == [".prof", ".txt"] and profiles[0].stem == profiles[1].stem
    text = profiles[1].read_text()
    assert "cumulative time" in text and "internal time" in text and "fit_cohort" in text
    assert any(name == "fit_cohort" for _, _, name in pstats.Stats(str(profiles[0])).stats)
    import json
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r.get("profiled") for r in records] == [True]
    assert "under cProfile" in (tmp_path / "table.md").read_text()


def test_the_table_shows_each_runs_median_of_a_repeated_cell(tmp_path):
    """With ``--repeat`` a cell's median of medians hides its spread: the
    table lists every run's median and the slowest over the fastest."""
    import json

    overhead = _overhead()
    base = {"workload": "mlp-synthetic", "algo": "fedpm", "clients": 100, "per_round": 100, "rounds": 20,
            "device": "cpu", "startup_s": 3.0, "peak_rss_mb": 400.0, "round_seconds": [], "wall_s": 1.0}
    runs = [dict(base, mode="cohort", median_round_s=s) for s in (0.135, 0.101, 0.131)]
    combined = overhead.combine_runs(runs)
    single = dict(base, mode="bare", median_round_s=0.7)
    retired = dict(combined, workload="a-workload-no-longer-measured")  # old records stay in results.jsonl
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in (combined, single, retired)) + "\n")
    overhead.write_table(tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert combined["median_round_s"] == 0.131
    # the bare loop measured once: no run-by-run ratios
    assert "| mlp-synthetic | fedpm | 100 | cohort | 0.135, 0.101, 0.131 | 1.34 | - |" in table
    assert "| bare |" not in table.split("Each run of the cells")[1]  # measured once: no spread row
    assert "no-longer-measured" not in table


def test_the_table_gives_each_repetition_s_ratio_to_the_bare_run_beside_it(tmp_path):
    """With ``--repeat`` the runs of one repetition follow one another: each
    cohort run is compared with the bare run of its own repetition (0.70 /
    0.070 = 10x, 0.50 / 0.100 = 5x, 0.90 / 0.075 = 12x), not with the bare
    loop's median of medians; a cell whose latest record comes from another
    invocation than the bare loop's is not paired."""
    import json

    overhead = _overhead()
    base = {"workload": "mlp-synthetic", "algo": "scaffold", "clients": 100, "per_round": 100, "rounds": 20,
            "device": "cpu", "startup_s": 3.0, "peak_rss_mb": 400.0, "round_seconds": [], "wall_s": 1.0}
    bare = overhead.combine_runs([dict(base, mode="bare", median_round_s=s) for s in (0.70, 0.50, 0.90)])
    cohort = overhead.combine_runs([dict(base, mode="cohort", median_round_s=s) for s in (0.070, 0.100, 0.075)])
    fast = overhead.combine_runs([dict(base, mode="fast", median_round_s=s) for s in (0.8, 0.6, 0.9)])
    for rec, invocation in ((bare, "today"), (cohort, "today"), (fast, "another day")):
        rec["invocation"] = invocation
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in (bare, cohort, fast)) + "\n")
    overhead.write_table(tmp_path)
    spread = (tmp_path / "table.md").read_text().split("Each run of the cells")[1]
    assert "| scaffold | 100 | cohort | 0.070, 0.100, 0.075 | 1.43 | 10.0x, 5.0x, 12.0x (median 10.0x) |" in spread
    assert "| scaffold | 100 | bare | 0.700, 0.500, 0.900 | 1.80 | - |" in spread
    # measured in another invocation than the bare loop: its runs are no repetitions of the bare loop's
    assert "| scaffold | 100 | fast | 0.800, 0.600, 0.900 | 1.50 | - |" in spread
    assert overhead.paired_ratios([0.7, 0.5], [0.07]) == "-"  # not one bare run per run


def test_a_ratio_between_two_invocations_is_marked_in_the_main_table(tmp_path):
    """The main table pairs each mode's latest record with the bare loop's:
    a cohort cell measured in the bare loop's invocation gives a plain ratio,
    one from another invocation (another time, maybe another machine) or
    without an invocation id is marked and explained under the table."""
    import json

    overhead = _overhead()
    base = {"workload": "mlp-synthetic", "algo": "fedpm", "clients": 100, "per_round": 100, "rounds": 20,
            "device": "cpu", "startup_s": 3.0, "peak_rss_mb": 400.0, "round_seconds": [], "wall_s": 1.0}
    records = [dict(base, mode="bare", median_round_s=0.6, invocation="today"),
               dict(base, mode="cohort", median_round_s=0.06, invocation="today"),
               dict(base, mode="fast", median_round_s=0.75, invocation="another day"),
               dict(base, mode="no-steps", median_round_s=0.03)]  # a record from before the ids
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    overhead.write_table(tmp_path)
    table = (tmp_path / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| mlp-synthetic | fedpm |"))
    assert "| 1.25x* | 0.10x | - | - | 0.05x* |" in row
    assert "\\* The cell and the bare loop of this row come from different invocations" in table
    records[2]["invocation"] = records[3]["invocation"] = "today"
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    overhead.write_table(tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "x*" not in table and "different invocations" not in table
    for record in records:  # neither the bare loop nor the cell carries an id: not known to be one invocation
        record.pop("invocation")
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    overhead.write_table(tmp_path)
    assert "| 1.25x* | 0.10x* | - | - | 0.05x* |" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize("algo, changes", [("fedavg", {}), ("fedavg", {"momentum": 0.9, "weight-decay": 1e-3}),
                                           ("scaffold", {"momentum": 0.5, "weight-decay": 1e-2}),
                                           ("fedcdr", {"weight-decay": 1e-2}),
                                           ("feddc", {"momentum": 0.5, "weight-decay": 1e-2}),
                                           pytest.param("fedpm", {"weight-decay": 1e-2}, marks=pytest.mark.slow)])
def test_the_tuned_bare_loop_is_the_bare_loop_bit_for_bit(tmp_path, algo, changes):
    """Mode ``tuned`` (the bare loop with batches gathered once per epoch and
    the SGD update as foreach arithmetic) takes the same steps with the same
    arithmetic as ``torch.optim.SGD`` (weight decay, then momentum), so it
    ends at the bare loop's model to the bit: its speed is the loop's, not
    less work."""
    overhead = _overhead()
    ov = {**overhead.overrides("mlp-synthetic", algo, rounds=2, clients=12, run_dir=tmp_path, name=algo,
                               mode="bare"), **changes}
    bare, tuned = overhead.bare_run(ov, 12), overhead.tuned_run(ov, 12)
    assert list(bare["final"]) == list(tuned["final"])
    for key, want in bare["final"].items():
        assert np.array_equal(tuned["final"][key].numpy(), want.numpy()), key


def test_the_table_gives_the_batched_round_against_the_tuned_loop(tmp_path):
    """The main table's ``cohort/tuned`` column: the batched round's time
    over the tuned bare loop's (0.045 / 0.225 = 0.20x), beside ``cohort/bare``;
    the spread table pairs each cohort run with the tuned run of its
    repetition too."""
    import json

    overhead = _overhead()
    base = {"workload": "mlp-synthetic", "algo": "fedavg", "clients": 100, "per_round": 100, "rounds": 20,
            "device": "cpu", "startup_s": 3.0, "peak_rss_mb": 400.0, "round_seconds": [], "wall_s": 1.0,
            "invocation": "today"}
    records = [overhead.combine_runs([dict(base, mode=mode, median_round_s=s) for s in runs])
               for mode, runs in (("bare", (0.4, 0.5)), ("tuned", (0.2, 0.25)), ("cohort", (0.04, 0.05)))]
    for rec in records:
        rec["invocation"] = "today"
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    overhead.write_table(tmp_path)
    table = (tmp_path / "table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| workload | algo | per round |"))
    row = next(line for line in table.splitlines() if line.startswith("| mlp-synthetic | fedavg |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(names)
    assert cells[names.index("cohort/tuned")] == "0.20x"  # 0.045 / 0.225
    assert cells[names.index("tuned/bare")] == "0.50x"
    assert cells[names.index("bare, tuned s/round")] == "0.225"
    spread = table.split("Each run of the cells")[1]
    assert "| fedavg | 100 | cohort | 0.040, 0.050 | 1.25 | 10.0x, 10.0x (median 10.0x) | 5.0x, 5.0x (median 5.0x) |" \
        in spread
