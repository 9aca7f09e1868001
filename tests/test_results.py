"""Tests for fedaccel.results (recording/summary/plots) and fedaccel.compare."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from fedaccel import compare
from fedaccel.results import STANDARD_KEYS, RunRecorder, curves_figure, load_run, plot_curves, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_rows(accs, bytes_up=1000, bytes_down=2000, seconds=0.5):
    """Rows for rounds 1..len(accs) with constant traffic/time."""
    return [
        {"round": i + 1, "accg": a, "loss": 1.0, "accl": None,
         "bytes_up": bytes_up, "bytes_down": bytes_down, "seconds": seconds}
        for i, a in enumerate(accs)
    ]


def write_run(run_dir, config, accs, target=0.5, **kw):
    rec = RunRecorder(run_dir, config, target_accuracy=target, num_rounds=len(accs), quiet=True)
    for row in make_rows(accs, **kw):
        rec.log_round(row)
    return rec.finish()


# --------------------------------------------------------------------------- #
# summarize
# --------------------------------------------------------------------------- #
def test_summarize_25_rows():
    accs = [i / 100 for i in range(1, 26)]  # 0.01 .. 0.25
    s = summarize(make_rows(accs), target_accuracy=0.1)
    assert s["final_accg"] == pytest.approx(0.25)
    assert s["best_accg"] == pytest.approx(0.25)
    # last 20 values: 0.06 .. 0.25 -> mean 0.155
    assert s["mean_last_20_accg"] == pytest.approx(0.155)
    assert s["rounds_to_target"] == 10
    assert s["num_rounds"] == 25
    assert s["total_mb"] == pytest.approx(25 * 3000 / 1e6)
    assert s["total_seconds"] == pytest.approx(12.5)
    assert s["final_accl"] is None
    assert s["target_accuracy"] == 0.1


def test_summarize_best_not_final_and_fewer_than_20():
    s = summarize(make_rows([0.2, 0.9, 0.4]), target_accuracy=None)
    assert s["final_accg"] == pytest.approx(0.4)
    assert s["best_accg"] == pytest.approx(0.9)
    assert s["mean_last_20_accg"] == pytest.approx(0.5)
    assert s["rounds_to_target"] is None


def test_summarize_ema_by_hand():
    s = summarize(make_rows([0.5, 0.7, 0.9]), target_accuracy=None)
    ema = 0.5
    ema = 0.9 * ema + 0.1 * 0.7  # 0.52
    ema = 0.9 * ema + 0.1 * 0.9  # 0.558
    assert ema == pytest.approx(0.558)
    assert s["ema_accg"] == pytest.approx(0.558)


def test_summarize_target_hit_and_miss():
    rows = make_rows([0.3, 0.6, 0.8, 0.7])
    assert summarize(rows, 0.6)["rounds_to_target"] == 2  # >= counts
    assert summarize(rows, 0.75)["rounds_to_target"] == 3
    assert summarize(rows, 0.95)["rounds_to_target"] is None
    assert summarize(rows, None)["rounds_to_target"] is None


def test_summarize_skips_none_accg_rows():
    rows = make_rows([0.4, None, 0.6, None])
    rows[1]["accl"] = 0.33
    s = summarize(rows, 0.5)
    assert s["final_accg"] == pytest.approx(0.6)
    assert s["best_accg"] == pytest.approx(0.6)
    assert s["mean_last_20_accg"] == pytest.approx(0.5)
    assert s["ema_accg"] == pytest.approx(0.9 * 0.4 + 0.1 * 0.6)
    assert s["rounds_to_target"] == 3
    assert s["num_rounds"] == 4
    assert s["final_accl"] == pytest.approx(0.33)


def test_summarize_no_accg_does_not_crash():
    for rows in ([], make_rows([None, None])):
        s = summarize(rows, 0.5)
        for k in ("final_accg", "best_accg", "mean_last_20_accg", "ema_accg", "rounds_to_target"):
            assert s[k] is None
        assert s["num_rounds"] == len(rows)


# --------------------------------------------------------------------------- #
# RunRecorder
# --------------------------------------------------------------------------- #
def test_recorder_writes_four_files(tmp_path, capsys):
    run_dir = tmp_path / "results" / "myrun"
    config = {"algo": "fedavg", "seed": 1, "lr": 0.1, "num-server-rounds": 3}
    rec = RunRecorder(run_dir, config, target_accuracy=0.5, num_rounds=3)
    # config.json is written immediately, sorted, indent 2
    text = (run_dir / "config.json").read_text()
    assert json.loads(text) == config
    assert text == json.dumps(config, sort_keys=True, indent=2) + "\n"

    rec.log_round({"round": 1, "accg": 0.4, "loss": 1.2, "accl": None,
                   "bytes_up": 1_230_000, "bytes_down": 1_250_000, "seconds": 0.21,
                   "train_loss": 1.5})
    rec.log_round({"round": 2, "accg": 0.55, "loss": float("nan"), "accl": 0.79,
                   "bytes_up": 1_230_000, "bytes_down": 1_250_000, "seconds": 0.2})
    rec.log_round({"round": 3, "accg": None, "bytes_up": 10, "bytes_down": 20, "seconds": 0.1})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("[fedaccel] round 1/3  accg 0.4000  loss 1.2000  "
                      "up 1.23 MB  down 1.25 MB  0.21 s")
    assert "accl 0.7900" in out[1] and "loss" not in out[1]
    assert "accg" not in out[2]

    summary = rec.finish()
    assert capsys.readouterr().out.strip() == (
        f"[fedaccel] results written to {run_dir.resolve()} "
        "(metrics.jsonl, summary.json, curves.png, config.json)")

    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "curves.png").read_bytes()[:8] == PNG_MAGIC

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(line) for line in lines]  # strict JSON: NaN became null
    for row in rows:
        assert set(STANDARD_KEYS) <= set(row)
    assert rows[0]["train_loss"] == 1.5
    assert rows[1]["loss"] is None
    assert rows[2]["accl"] is None and rows[2]["loss"] is None

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk == summary
    assert summary["final_accg"] == pytest.approx(0.55)
    assert summary["rounds_to_target"] == 2
    assert summary["final_accl"] == pytest.approx(0.79)
    assert summary["total_mb"] == pytest.approx((2 * 2_480_000 + 30) / 1e6)

    cfg, rows2, summ2 = load_run(run_dir)
    assert cfg == config and rows2 == rows and summ2 == summary


def test_progress_line_padding(tmp_path, capsys):
    rec = RunRecorder(tmp_path / "r", {"algo": "x"}, None, num_rounds=100)
    rec.log_round({"round": 12, "accg": 0.8123, "loss": 0.531, "accl": 0.79,
                   "bytes_up": 1_230_000, "bytes_down": 1_250_000, "seconds": 0.21})
    assert capsys.readouterr().out.strip() == (
        "[fedaccel] round  12/100  accg 0.8123  loss 0.5310  accl 0.7900  "
        "up 1.23 MB  down 1.25 MB  0.21 s"
    )
    rec.close()


@pytest.mark.parametrize("key", ["accg", "accl"])
def test_percentage_accuracy_rejected(tmp_path, key):
    rec = RunRecorder(tmp_path / "r", {"algo": "x"}, 0.5, num_rounds=1, quiet=True)
    row = {"round": 1, "accg": 0.5, "loss": 1.0, "accl": None,
           "bytes_up": 0, "bytes_down": 0, "seconds": 0.1}
    row[key] = 87.5
    with pytest.raises(ValueError, match="percentage"):
        rec.log_round(row)
    rec.close()
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == ""  # nothing written


def test_percentage_target_rejected(tmp_path):
    with pytest.raises(ValueError):
        RunRecorder(tmp_path / "r", {}, target_accuracy=80, num_rounds=1)


def test_load_run_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_run(missing)
    run_dir = tmp_path / "bad"
    write_run(run_dir, {"algo": "a"}, [0.1, 0.2])
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n{not json\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*line 2"):
        load_run(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"round": 1, "accg": 0.5}\n')
    (run_dir / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match="summary.json"):
        load_run(run_dir)
    # a crashed run (no summary) can still be loaded with require_summary=False
    _, rows, summary = load_run(run_dir, require_summary=False)
    assert rows == [{"round": 1, "accg": 0.5}] and summary["final_accg"] == 0.5


def test_plot_curves_empty_rows(tmp_path):
    path = tmp_path / "sub" / "c.png"
    plot_curves([], path, title="empty")
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("base, step", [(0.91, 0.0005), (0.91, 0.00001), (0.89995, 0.000001), (0.1135, 0.0001),
                                        (0.1135, 0.0), (0.0, 0.002), (0.99, 0.0000001)])
def test_every_label_of_the_curves_lies_inside_the_figure(base, step):
    """The curves' fixed margins (no constrained layout, which cost 0.14 s a
    run) keep every tick label, axis label and title inside the figure, and
    the right panel's off the left one, for the tick labels accuracy curves
    get ("0.9", "0.9125", a curve that flickers between two values such as
    "0.11350", one that moves by millionths), and a communication axis in
    the gigabytes (matplotlib's "1e6" offset)."""
    rows = [{"round": r, "accg": base + (r % 7) * step if r % 2 else base + r * step,
             "accl": base if r % 50 == 0 else None, "bytes_up": 3.3e9, "bytes_down": 3.3e9} for r in range(401)]
    fig = curves_figure(rows, title="fedavg (run-2026-12-06-210000-abcdef)")
    fig.draw_without_rendering()  # places the labels, as saving does
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox
    for ax in fig.axes:  # each axis with its drawn tick labels, its label and its offset ("1e6"), and the title
        for part, box in [("x axis", ax.xaxis.get_tightbbox(renderer)), ("y axis", ax.yaxis.get_tightbbox(renderer)),
                          ("title", ax.title.get_window_extent(renderer))]:
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, \
                (part, box, inside)
    left, right = fig.axes
    assert left.get_window_extent(renderer).x1 < right.yaxis.get_tightbbox(renderer).x0  # the panels apart
    box = fig.get_tightbbox(renderer)  # inches
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.get_figwidth() and box.y1 <= fig.get_figheight(), box


# --------------------------------------------------------------------------- #
# compare
# --------------------------------------------------------------------------- #
@pytest.mark.slow  # two real runs: the full suite
def test_compare_two_runs(tmp_path, capsys):
    a = tmp_path / "run_a"
    b = tmp_path / "run_b"
    write_run(a, {"algo": "fedavg", "seed": 0}, [0.2, 0.5, 0.875], target=0.5)
    write_run(b, {"algo": "scaffold", "seed": 0}, [0.3, 0.6, 0.65, 0.7], target=0.5,
              bytes_up=500_000, bytes_down=500_000)
    out = tmp_path / "cmp"
    md = compare.compare_runs([a, b], out)
    png = out / "comparison.png"
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == PNG_MAGIC
    assert (out / "comparison.md").read_text() == md

    lines = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in md.splitlines() if line.startswith("| run_")}
    # run, algo, final, best, mean last 20, rounds to target, total MB
    assert lines["run_a"] == ["run_a", "fedavg", "87.50", "87.50", "52.50", "2", "0.01"]
    assert lines["run_b"] == ["run_b", "scaffold", "70.00", "70.00", "56.25", "2", "4.00"]

    # --target overrides and recomputes rounds to target from the rows
    rc = compare.main([str(a), str(b), "--out", str(out), "--target", "0.8"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| run_a | fedavg | 87.50 | 87.50 | 52.50 | 3 | 0.01 |" in printed
    assert "| run_b | scaffold | 70.00 | 70.00 | 56.25 | - | 4.00 |" in printed
    assert "comparison.png" in printed

    # the output folder (or an earlier one) among the inputs is skipped
    md2 = compare.compare_runs([a, b, out], tmp_path / "cmp2")
    assert compare.compare_runs([a, out, tmp_path / "cmp2", b], out) == md2


def test_compare_labels_repeat_and_label_key(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, {"algo": "fedavg", "lr": 0.1}, [0.5])
    write_run(b, {"algo": "fedavg", "lr": 0.01}, [0.6])
    runs = compare.load_runs([a, b])
    compare.assign_run_labels(runs, None)
    assert [r.label for r in runs] == ["fedavg (a)", "fedavg (b)"]
    compare.assign_run_labels(runs, "lr")
    assert [r.label for r in runs] == ["0.1", "0.01"]


@pytest.mark.slow  # real runs over seeds: the full suite
def test_compare_group_seeds(tmp_path, capsys):
    finals = {0: 0.6, 1: 0.7, 2: 0.8}
    dirs = []
    for seed, final in finals.items():
        d = tmp_path / f"fedavg_s{seed}"
        write_run(d, {"algo": "fedavg", "seed": seed, "run-name": d.name,
                      "results-dir": str(tmp_path), "lr": 0.1},
                  [0.4, final], target=0.65)
        dirs.append(d)
    other = tmp_path / "fedprox_s0"
    write_run(other, {"algo": "fedprox", "seed": 0, "run-name": other.name,
                      "results-dir": str(tmp_path), "lr": 0.1}, [0.5, 0.9], target=0.65)
    dirs.append(other)

    out = tmp_path / "cmp"
    rc = compare.main([*map(str, dirs), "--out", str(out), "--group-seeds"])
    assert rc == 0
    md = (out / "comparison.md").read_text()
    assert md in capsys.readouterr().out

    vals = list(finals.values())
    m, s = statistics.fmean(vals), statistics.stdev(vals)  # 0.7, 0.1
    assert m == pytest.approx(0.7) and s == pytest.approx(0.1)
    fedavg_row = next(line for line in md.splitlines() if line.startswith("| fedavg |"))
    cells = [c.strip() for c in fedavg_row.strip("|").split("|")]
    assert cells[:3] == ["fedavg", "fedavg", "3"]
    assert cells[3] == "70.00 ± 10.00"  # final
    assert cells[4] == "70.00 ± 10.00"  # best
    # mean of last 20 per seed: (0.4+f)/2 -> 0.5, 0.55, 0.6 -> 55.00 ± 5.00
    assert cells[5] == "55.00 ± 5.00"
    # target 0.65: seeds 1 and 2 reach it at round 2
    assert cells[6] == "2.0 (2/3)"
    fedprox_row = next(line for line in md.splitlines() if line.startswith("| fedprox |"))
    assert "90.00 ± 0.00" in fedprox_row and "2.0 (1/1)" in fedprox_row
    assert (out / "comparison.png").read_bytes()[:8] == PNG_MAGIC

    groups = compare.group_by_seed(compare.load_runs(dirs))
    assert [len(g.runs) for g in groups] == [3, 1]
    assert groups[0].seeds == [0, 1, 2]


def test_compare_missing_dir_exit_2(tmp_path, capsys):
    good = tmp_path / "good"
    write_run(good, {"algo": "fedavg"}, [0.5])
    missing = tmp_path / "does_not_exist"
    rc = compare.main([str(good), str(missing), "--out", str(tmp_path / "cmp")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("fedaccel-compare: error:")
    assert "does_not_exist" in err and "Traceback" not in err


def test_compare_no_metrics_exit_2(tmp_path, capsys):
    d = tmp_path / "empty_run"
    RunRecorder(d, {"algo": "fedavg"}, 0.5, num_rounds=10, quiet=True).close()
    rc = compare.main([str(d), "--out", str(tmp_path / "cmp")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no metrics" in err and "empty_run" in err


def test_compare_percentage_target_exit_2(tmp_path, capsys):
    d = tmp_path / "r"
    write_run(d, {"algo": "fedavg"}, [0.5])
    assert compare.main([str(d), "--out", str(tmp_path / "cmp"), "--target", "80"]) == 2
    assert "percentage" in capsys.readouterr().err


def test_nan_accuracy_is_missing(tmp_path):
    rec = RunRecorder(tmp_path / "r", {}, None, num_rounds=1, quiet=True)
    rec.log_round({"round": 1, "accg": math.nan, "loss": None, "accl": None,
                   "bytes_up": 0, "bytes_down": 0, "seconds": 0.0})
    rec.close()
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text())["accg"] is None


def test_runs_of_two_machines_group_together_and_say_where_they_ran(tmp_path):
    """The resolved config records the run's environment (libraries, CPU
    dispatch, threads): the same seed gives the same bits only where it is the
    same. Two runs that differ only there (and in the seed) still group."""
    from fedaccel.torch_utils import environment

    here = environment(torch.device("cpu"))
    assert {"python", "torch", "numpy", "flwr", "torch-threads", "cpu-capability", "cpu"} <= set(here)
    assert here["torch"] == torch.__version__ and here["torch-threads"] == torch.get_num_threads()

    def config(seed, cpu):
        return {"algo": "fedavg", "seed": seed, "run-name": f"r{seed}",
                "resolved": {"seed": seed, "model": "mlp", "environment": {**here, "cpu": cpu}}}
    runs = [compare.RunInfo(tmp_path / f"r{seed}", config(seed, cpu), [], {})
            for seed, cpu in ((0, "AMD EPYC"), (1, "Intel Xeon"))]
    assert [g.seeds for g in compare.group_by_seed(runs)] == [[0, 1]]


def test_group_seeds_ignores_what_the_seed_draws(tmp_path):
    """Real runs record the partition sizes and test-set size their seed drew
    (Synthetic, Dirichlet): runs that differ only there and in the seed group;
    a setting in the resolved config (the model) still splits them."""
    def resolved(seed, sizes, model="mlp"):
        return {"algo": "fedavg", "seed": seed, "run-name": f"r{seed}{model}",
                "resolved": {"seed": seed, "run_name": f"r{seed}", "model": model,
                             "partition-sizes": sizes, "global-test-size": sum(sizes)}}
    runs = [compare.RunInfo(tmp_path / f"r{seed}", resolved(seed, sizes, model), [], {})
            for seed, sizes, model in ((0, [3, 5], "mlp"), (1, [4, 6], "mlp"), (2, [4, 6], "logreg"))]
    groups = compare.group_by_seed(runs)
    assert [g.seeds for g in groups] == [[0, 1], [2]]

    # a run recorded before config.json kept the model's input shape and class count groups with a newer one
    newer = resolved(3, [4, 6])
    newer["resolved"].update({"input-shape": [60], "num-classes": 10})
    groups = compare.group_by_seed(runs[:2] + [compare.RunInfo(tmp_path / "r3", newer, [], {})])
    assert [g.seeds for g in groups] == [[0, 1, 3]]


def record_unfinished(run_dir, accs, num_rounds, config=None, state="failed"):
    """A run that recorded ``accs`` and then ended early (``failed`` or
    ``stopped``), or is still running (``state=None``: the recorder is returned open)."""
    rec = RunRecorder(run_dir, {"algo": "fedavg", "seed": 0, "num-server-rounds": num_rounds, **(config or {})},
                      target_accuracy=0.5, num_rounds=num_rounds, quiet=True)
    for row in make_rows(accs):
        rec.log_round(row)
    if state is not None:
        rec.fail("CUDA out of memory" if state == "failed" else "", state=state)
    return rec


def test_compare_leaves_out_a_failed_run_and_says_which(tmp_path, capsys):
    """A run that failed at round 5 of 60 (no summary.json) is no final
    result: left out with one line naming it, its state and round; with
    --include-unfinished it is listed, marked in the table and the legend."""
    done = tmp_path / "fedavg-done"
    write_run(done, {"algo": "fedavg", "seed": 0}, [0.4, 0.6, 0.7])
    bad = tmp_path / "fedavg-failed"
    record_unfinished(bad, [0.3, 0.4, 0.5, 0.55, 0.5955], 60)
    out = tmp_path / "cmp"

    assert compare.main([str(done), str(bad), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "59.55" not in printed and "| fedavg-done | fedavg | 70.00 |" in printed
    said = [line for line in printed.splitlines() if "fedavg-failed" in line]
    assert len(said) == 1 and "failed, round 5 of 60" in said[0] and "left out" in said[0]
    assert "fedavg-failed" not in (out / "comparison.md").read_text().split("Note:")[0]  # in no table

    assert compare.main([str(done), str(bad), "--out", str(out), "--include-unfinished"]) == 0
    md = (out / "comparison.md").read_text()
    assert "| fedavg-failed [failed, round 5 of 60] | fedavg | 59.55 (unfinished) |" in md
    assert "| fedavg-done | fedavg | 70.00 |" in md
    runs = compare.load_runs([done, bad])
    compare.assign_run_labels(runs, None)
    assert [r.label for r in runs] == ["fedavg (fedavg-done)", "fedavg (fedavg-failed) [failed, round 5 of 60]"]

    # nothing finished: exit 2, one line naming the run
    capsys.readouterr()
    assert compare.main([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fedavg-failed (failed, round 5 of 60)" in err


def test_compare_reads_every_unfinished_state(tmp_path):
    """stopped, running (its writer alive), interrupted (its writer dead),
    a run started again over an old summary.json, a run from before
    status.json with or without its summary."""
    from dashboard_helpers import dead_pid, set_status

    record_unfinished(tmp_path / "stopped", [0.3, 0.4], 10, state="stopped")
    live = record_unfinished(tmp_path / "running", [0.3], 10, state=None)
    record_unfinished(tmp_path / "killed", [0.3, 0.4, 0.5], 10, state=None).close()
    set_status(tmp_path / "killed", pid=dead_pid())
    write_run(tmp_path / "again", {"algo": "fedavg", "seed": 0}, [0.5, 0.6])
    again = record_unfinished(tmp_path / "again", [0.2], 5, state=None)  # the old summary.json stays
    write_run(tmp_path / "old", {"algo": "fedavg", "seed": 0}, [0.5])
    write_run(tmp_path / "old-crashed", {"algo": "fedavg", "seed": 0, "num-server-rounds": 4}, [0.5])
    for name in ("old", "old-crashed"):
        (tmp_path / name / "status.json").unlink()
    (tmp_path / "old-crashed" / "summary.json").unlink()

    names = ["stopped", "running", "killed", "again", "old", "old-crashed"]
    runs = compare.load_runs([tmp_path / n for n in names])
    assert [r.progress if not r.finished else "finished" for r in runs] == [
        "stopped, round 2 of 10", "running, round 1 of 10", "interrupted, round 3 of 10",
        "running, round 1 of 5", "finished", "unfinished, round 1 of 4"]
    live.close()
    again.close()


def test_compare_reads_each_runs_status_once(tmp_path, monkeypatch):
    """A finished run, a running one and one from before status.json: each
    folder's status.json is read once (run_finished takes the status that
    run_state_of read), and the states are what they were."""
    import fedaccel.results as results

    write_run(tmp_path / "done", {"algo": "fedavg", "seed": 0}, [0.5, 0.6])
    live = record_unfinished(tmp_path / "running", [0.3], 10, state=None)
    write_run(tmp_path / "old", {"algo": "fedavg", "seed": 1}, [0.5])
    (tmp_path / "old" / "status.json").unlink()
    reads = []
    load_status = results.load_status

    def counted(run_dir):
        reads.append(Path(run_dir).name)
        return load_status(run_dir)

    monkeypatch.setattr(results, "load_status", counted)
    monkeypatch.setattr(compare, "load_status", counted)
    runs = compare.load_runs([tmp_path / n for n in ("done", "running", "old")])
    assert [r.progress if not r.finished else "finished" for r in runs] == [
        "finished", "running, round 1 of 10", "finished"]
    assert sorted(reads) == ["done", "old", "running"]
    live.close()


def test_group_seeds_counts_a_repeated_seed_once(tmp_path, capsys):
    """The same seed and settings run twice (the fast runner and `flwr run`)
    is one seed: n stays 1 and no spread of 0 is made up; the run set aside
    is named in one line, and still listed among the runs."""
    fast, flower = tmp_path / "fedavg-s0-fast", tmp_path / "fedavg-s0-flower"
    for d in (fast, flower):
        write_run(d, {"algo": "fedavg", "seed": 0, "lr": 0.1, "run-name": d.name}, [0.5, 0.8723])
    other = tmp_path / "fedavg-s1"
    write_run(other, {"algo": "fedavg", "seed": 1, "lr": 0.1, "run-name": other.name}, [0.5, 0.8523])
    runs = compare.load_runs([fast, flower])
    groups = compare.group_by_seed(runs)
    assert [g.seeds for g in groups] == [[0]] and groups[0].runs == [runs[0]]
    assert [(d.name, k.name) for d, k in groups[0].duplicates] == [(flower.name, fast.name)]
    assert compare.groups_table(groups)[1][0][2] == "1"  # seeds: not 2

    out = tmp_path / "cmp"
    assert compare.main([str(fast), str(flower), str(other), "--out", str(out), "--group-seeds"]) == 0
    md = (out / "comparison.md").read_text()
    assert md in capsys.readouterr().out
    cells = [c.strip() for c in next(line for line in md.splitlines() if line.startswith("| fedavg |"))
             .strip("|").split("|")]
    assert cells[2:4] == ["2", "86.23 ± 1.41"]  # seeds 0 and 1, each once
    said = [line for line in md.splitlines() if "fedavg-s0-flower" in line]
    assert len(said) == 2  # its row among the runs, and the line that sets it aside
    assert said[0].startswith("| fedavg-s0-flower |")
    assert "set aside" in said[1] and "seed 0" in said[1] and "fedavg-s0-fast" in said[1]


def test_runs_without_a_recorded_seed_are_not_taken_for_duplicates(tmp_path):
    """Two runs of the same settings that recorded no seed: nothing says they
    are one run, so both count (n = 2), as before seeds were deduplicated."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d, acc in zip(dirs, (0.8, 0.6)):
        write_run(d, {"algo": "fedavg", "lr": 0.1, "run-name": d.name}, [0.5, acc])
    groups = compare.group_by_seed(compare.load_runs(dirs))
    assert len(groups) == 1 and len(groups[0].runs) == 2 and not groups[0].duplicates


def test_group_seeds_leaves_unfinished_runs_out_of_the_groups(tmp_path):
    done = tmp_path / "s0"
    write_run(done, {"algo": "fedavg", "seed": 0, "num-server-rounds": 2}, [0.5, 0.8])
    bad = tmp_path / "s1"
    record_unfinished(bad, [0.3], 2, config={"seed": 1})
    runs = compare.load_runs([done, bad])
    groups = compare.group_by_seed(runs)
    assert [g.seeds for g in groups] == [[0]]
    assert compare.grouping_notes(runs, groups) == [f"not in any group: {bad} (failed, round 1 of 2)"]
