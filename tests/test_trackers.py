"""``tracker = "tensorboard" | "mlflow"`` (fedaccel/trackers.py): the same
per-round metrics and the config as ``metrics.jsonl``/``config.json``, read
back with each library's own reader; a resumed run shows every round once; a
tracker that fails mid-run is dropped and the run goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedaccel.local_run import default_run_config, fuse, main as run_main, resume_config, run_local
from fedaccel.results import RunRecorder, load_rows
from fedaccel.trackers import TRACKER_FILE, MlflowTracker, TensorBoardTracker, round_metrics

NUM_CLIENTS = 6


def small_config(tmp_path: Path, name: str, **extra) -> dict:
    return fuse(default_run_config(), {
        "algo": "scaffold", "num-server-rounds": 4, "clients-per-round": 3, "local-epochs": 1,
        "accl-every": 2, "synthetic.max-samples": 120, "results-dir": str(tmp_path), "run-name": name, **extra})


# ------------------------------------------------------------------ readers
def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_text(log_dir: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def mlflow_run(run_dir: Path):
    """(client, run, {metric: [(step, value)]}) of the MLflow run of ``run_dir``."""
    from mlflow import MlflowClient

    saved = json.loads((run_dir / TRACKER_FILE).read_text())
    client = MlflowClient(saved["uri"])
    run = client.get_run(saved["run_id"])
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    return client, run, history


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in round_metrics(row).items():
            out.setdefault(key, []).append((row["round"], value))
    return out


def assert_same_numbers(got: dict, wanted: dict) -> None:
    """TensorBoard stores float32: equal to float32 rounding; MLflow float64: exact."""
    assert sorted(got) == sorted(wanted)
    for key in wanted:
        assert [s for s, _ in got[key]] == [s for s, _ in wanted[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in wanted[key]], rel=1e-6), key


# ------------------------------------------------------------------ units
ROWS = [{"round": 1, "accg": 0.5, "loss": 1.25, "accl": None, "bytes_up": 10, "bytes_down": 20, "seconds": 0.5},
        {"round": 2, "accg": 0.75, "loss": 0.5, "accl": 0.625, "bytes_up": 10, "bytes_down": 20, "seconds": 0.25,
         "note": "text is not a metric"}]


def test_round_metrics_keeps_the_numbers_of_a_row():
    assert round_metrics(ROWS[1]) == {"accg": 0.75, "loss": 0.5, "accl": 0.625, "bytes_up": 10.0,
                                      "bytes_down": 20.0, "seconds": 0.25}
    assert "accl" not in round_metrics(ROWS[0])  # None: not evaluated that round
    assert round_metrics({"round": 3, "loss": float("nan"), "ok": True}) == {}


def test_tensorboard_tracker_writes_every_round_and_the_config(tmp_path):
    config = {"algo": "fedavg", "lr": 0.05}
    tracker = TensorBoardTracker(tmp_path, config, rows_before=[])
    for row in ROWS:
        tracker.log_round(row)
    tracker.close("finished")
    assert tensorboard_scalars(tmp_path) == {
        "accg": [(1, 0.5), (2, 0.75)], "loss": [(1, 1.25), (2, 0.5)], "accl": [(2, 0.625)],
        "bytes_up": [(1, 10.0), (2, 10.0)], "bytes_down": [(1, 20.0), (2, 20.0)], "seconds": [(1, 0.5), (2, 0.25)]}
    [text] = tensorboard_text(tmp_path, "config")
    assert json.loads(text.strip("`").removeprefix("json")) == config
    assert tensorboard_text(tmp_path, "state") == ["finished"]


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory) -> Path:
    """One results folder (one MLflow SQLite store) for several runs."""
    return tmp_path_factory.mktemp("results")


@pytest.mark.slow  # MLflow itself (seconds to import): the full suite; TensorBoard stays quick
@pytest.mark.parametrize("state,status", [("finished", "FINISHED"), ("failed", "FAILED"), ("stopped", "KILLED")])
def test_mlflow_tracker_logs_params_metrics_config_and_end_state(tmp_path, shared_results, state, status):
    run_dir = shared_results / f"run-{state}"
    run_dir.mkdir()
    config = {"algo": "fedavg", "lr": 0.05, "resolved": {"partition-sizes": [1, 2, 3]}}
    tracker = MlflowTracker("", run_dir, config, rows_before=[])
    for row in ROWS:
        tracker.log_round(row)
    tracker.close(state)
    client, run, history = mlflow_run(run_dir)
    assert json.loads((run_dir / TRACKER_FILE).read_text())["uri"] == f"sqlite:///{shared_results / '.mlflow' / 'mlflow.db'}"
    assert run.info.run_name == f"run-{state}" and run.info.status == status
    assert run.data.params == {"algo": "fedavg", "lr": "0.05"}
    assert history == expected_scalars(ROWS)
    assert client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)) \
        and json.loads((tmp_path / "config.json").read_text()) == config


class BrokenTracker:
    name, where = "broken", "nowhere"

    def __init__(self):
        self.rounds = []

    def log_round(self, row):
        if row["round"] == 2:
            raise ConnectionError("tracking server gone")
        self.rounds.append(row["round"])

    def close(self, state):
        raise AssertionError("a dropped tracker is not called again")


def test_a_tracker_that_fails_is_dropped_with_one_line_and_the_run_goes_on(tmp_path, capsys):
    tracker = BrokenTracker()
    rec = RunRecorder(tmp_path, {"algo": "fedavg"}, None, num_rounds=3, quiet=True, tracker=tracker)
    for r in (1, 2, 3):
        rec.log_round({"round": r, "accg": 0.5})
    rec.finish()
    out = capsys.readouterr().out
    assert tracker.rounds == [1]
    assert [row["round"] for row in load_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    [line] = [line for line in out.splitlines() if "warning" in line]
    assert line == ("[fedaccel] warning: tracker broken failed after round 2 (ConnectionError: tracking server "
                    "gone); it gets no more metrics, the run and metrics.jsonl go on")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "finished"


# ------------------------------------------------------------------ end to end (fast runner)
@pytest.mark.parametrize("tracker", ["tensorboard", pytest.param("mlflow", marks=pytest.mark.slow)])
def test_a_run_sends_the_rows_of_metrics_jsonl_to_the_tracker(tmp_path, capsys, tracker):
    run_dir = run_local(small_config(tmp_path, tracker, tracker=tracker), num_clients=NUM_CLIENTS, quiet=True)
    rows = load_rows(run_dir / "metrics.jsonl")
    assert len(rows) == 4
    out = capsys.readouterr().out
    # the results folder holds run folders only (fedaccel-compare results/*): MLflow's store is hidden
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [tracker]
    if tracker == "tensorboard":
        assert_same_numbers(tensorboard_scalars(run_dir), expected_scalars(rows))
        assert f"[fedaccel] metrics also in TensorBoard: tensorboard --logdir {tmp_path.resolve()}" in out
    else:
        _, run, history = mlflow_run(run_dir)
        assert history == expected_scalars(rows)  # float64 both sides: exact
        assert run.info.status == "FINISHED" and run.data.params["algo"] == "scaffold"
        assert f"[fedaccel] metrics also in MLflow run {run.info.run_id}: mlflow ui --backend-store-uri " in out


def test_tensorboard_tracker_uri_is_a_log_root_for_many_runs(tmp_path):
    root = tmp_path / "tb"
    for name in ("a", "b"):
        run_local(small_config(tmp_path / "results", name, **{"tracker": "tensorboard", "tracker-uri": str(root),
                                                               "num-server-rounds": 2}),
                  num_clients=NUM_CLIENTS, quiet=True)
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]
    assert [s for s, _ in tensorboard_scalars(root / "b")["accg"]] == [1, 2]
    assert not list((tmp_path / "results" / "a").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("tracker", ["tensorboard", pytest.param("mlflow", marks=pytest.mark.slow)])
def test_a_killed_and_resumed_run_shows_every_round_once(tmp_path, monkeypatch, tracker):
    """Checkpoint after round 5, killed in round 8 (rounds 6 and 7 already
    sent), resumed: the tracker shows rounds 1..10 once each, with the
    resumed run's numbers (bit-identical, but for the time per round)."""
    from tests.test_checkpoint import config, run_killed_in_round

    run_config = config(tmp_path, "fedavg", "cut", **{"checkpoint-every": 5, "tracker": tracker})
    run_killed_in_round(monkeypatch, run_config, kill_round=8)
    run_dir = tmp_path / "cut"
    if tracker == "mlflow":
        _, run, history = mlflow_run(run_dir)
        assert run.info.status == "FAILED" and [s for s, _ in history["accg"]] == list(range(1, 8))
        first_id = run.info.run_id
    resumed = run_local(*resume_config(str(run_dir), {}, None), quiet=True)
    rows = load_rows(resumed / "metrics.jsonl")
    wanted = expected_scalars(rows)
    if tracker == "tensorboard":
        assert_same_numbers(tensorboard_scalars(run_dir), wanted)
    else:  # the same MLflow run, continued
        _, run, history = mlflow_run(run_dir)
        assert run.info.run_id == first_id and run.info.status == "FINISHED"
        wanted["seconds"] = history["seconds"]  # rounds 6, 7: the killed run's timing
        assert history == wanted


# ------------------------------------------------------------------ mistakes
def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


SMALL = ["num-server-rounds=1", "clients-per-round=2", "local-epochs=1", "accl-every=0",
         "synthetic.max-samples=60", "--num-clients", "3"]


def test_an_unknown_tracker_is_refused_with_the_choices(tmp_path, capsys):
    assert run_main([f"results-dir='{tmp_path}'", "tracker='wandb'", *SMALL]) == 2
    assert "tracker='wandb': allowed: none, tensorboard, mlflow" in one_error_line(capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("tracker,package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow-skinny")])
def test_a_tracker_whose_package_is_missing_is_refused_before_any_work(tmp_path, capsys, monkeypatch, tracker,
                                                                       package):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    assert run_main([f"results-dir='{tmp_path}'", f"tracker='{tracker}'", *SMALL]) == 2
    assert (f"tracker='{tracker}': needs the {package} package, which is not installed: "
            f"pip install 'fedaccel[{tracker}]'") in one_error_line(capsys)
    assert not any(tmp_path.iterdir())


def test_an_mlflow_server_that_does_not_answer_is_refused_at_once(tmp_path, capsys):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    assert run_main([f"results-dir='{tmp_path}'", "tracker='mlflow'", f"tracker-uri='{uri}'", *SMALL]) == 2
    line = one_error_line(capsys)
    assert f"tracker-uri='{uri}': the MLflow tracking server at {uri} does not answer" in line
    assert not any(tmp_path.iterdir())


PARALLEL_RUN = """
import sys
from pathlib import Path
from fedaccel.trackers import MlflowTracker
run_dir = Path(sys.argv[1])
run_dir.mkdir()
tracker = MlflowTracker("", run_dir, {"algo": "fedavg"}, rows_before=[])
for r in range(1, 6):
    tracker.log_round({"round": r, "accg": r / 10, "seconds": 0.1})
tracker.close("finished")
"""


@pytest.mark.slow
def test_runs_in_parallel_share_one_new_mlflow_store(tmp_path):
    """A sweep's cells start at once against a store nobody created yet:
    without the lock beside it two of them race to create its tables."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", PARALLEL_RUN, str(tmp_path / f"cell{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    for i in range(3):
        _, run, history = mlflow_run(tmp_path / f"cell{i}")
        assert run.info.status == "FINISHED" and [s for s, _ in history["accg"]] == [1, 2, 3, 4, 5]


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert run_main([f"results-dir='{tmp_path / 'out'}'", "tracker='tensorboard'", f"tracker-uri='{blocker}'",
                     *SMALL]) == 2
    assert f"tracker-uri='{blocker}': cannot write TensorBoard's files to {blocker}/" in one_error_line(capsys)
