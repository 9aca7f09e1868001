"""Send a run's per-round metrics and its config where users already look:
TensorBoard or MLflow (``tracker = "tensorboard" | "mlflow"``).

The run folder (``metrics.jsonl``, ``config.json``) stays the record every
fedaccel tool reads; a tracker is a copy of the same rows, written by
:class:`fedaccel.results.RunRecorder` as each round is recorded. Both
libraries are optional extras (``pip install 'fedaccel[tensorboard]'``,
``'fedaccel[mlflow]'``); a run that asks for a missing one is refused before
any work (:func:`require_tracker`).

- **tensorboard**: :class:`torch.utils.tensorboard.SummaryWriter` writes the
  event files into the run folder (``tracker-uri = ""``) or into
  ``<tracker-uri>/<run name>``, so ``tensorboard --logdir results`` shows every
  run by its folder name. One scalar per metric and round (step = round), the
  config as text. A resumed run opens the writer with ``purge_step`` at its
  first new round: TensorBoard hides whatever the killed run had logged after
  its checkpoint, so every round appears once.
- **mlflow**: one MLflow run per fedaccel run, in the experiment
  ``$MLFLOW_EXPERIMENT_NAME`` (default ``fedaccel``), at the tracking URI
  ``tracker-uri``, else ``$MLFLOW_TRACKING_URI``, else
  ``sqlite:///<results folder>/.mlflow/mlflow.db`` (artifacts in
  ``.mlflow/artifacts``; the results folder is the one that holds the run
  folder, ``results-dir``; hidden, so ``results/*`` still globs run folders
  only); params = the run config, metrics per round
  (step = round), ``config.json`` as an artifact, and the end state as the
  MLflow run status (FINISHED, FAILED, KILLED). Its id is kept in the run
  folder (``tracker.json``): a resumed run continues the same MLflow run and
  logs only rounds past the last one it holds (the rounds between the
  checkpoint and the crash are recomputed bit-identical).

Several runs at once (a sweep's cells) share one SQLite store: every MLflow
call of a run holds a file lock next to the database (``mlflow.db.lock``),
so two runs never create its tables or write at the same time.

A tracker that cannot be opened refuses the run (one line naming
``tracker-uri``); one that fails mid-run (a tracking server gone) prints one line and is
dropped; the run goes on and its own files stay complete.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import numbers
import os
import time
import urllib.error
import urllib.request
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

from fedaccel.config import config_error

#: ``tracker`` values; the package each needs and the extra that installs it.
TRACKERS = ("none", "tensorboard", "mlflow")
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny")}
TRACKER_FILE = "tracker.json"
MLFLOW_EXPERIMENT = "fedaccel"
MLFLOW_STORE = ".mlflow"  # the default store's folder in the results folder
PROBE_TIMEOUT = 5.0  # seconds an MLflow tracking server has to answer before a run starts
#: What the MLflow run's status says for each of the run's end states.
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class Tracker(Protocol):
    """What :class:`fedaccel.results.RunRecorder` calls."""

    name: str
    where: str  # how to see the run there, printed with the results folder

    def log_round(self, row: dict) -> None: ...

    def close(self, state: str) -> None: ...


def require_tracker(tracker: str, tracker_uri: str = "") -> None:
    """Refuse (one :class:`~fedaccel.config.ConfigError` line), before the run
    does any work, a tracker whose package is not installed, and an MLflow
    tracking server that does not answer (MLflow itself would retry for
    minutes)."""
    if tracker == "none":
        return
    module, package = _PACKAGES[tracker]
    if importlib.util.find_spec(module) is None:
        raise config_error("tracker", tracker, f"needs the {package} package, which is not installed: "
                           f"pip install 'fedaccel[{tracker}]' (or pip install {package}), or set tracker='none'")
    uri = mlflow_uri(tracker_uri) if tracker == "mlflow" else ""
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT).close()
        except urllib.error.HTTPError:
            pass  # it answers (a proxy without /health): MLflow's own calls will tell
        except (OSError, ValueError, http.client.HTTPException) as err:  # HTTPException: not HTTP there
            reason = getattr(err, "reason", err)
            raise config_error("tracker-uri", tracker_uri, f"the MLflow tracking server at {uri} does not answer "
                               f"({reason}); start it (mlflow server), fix tracker-uri or $MLFLOW_TRACKING_URI, "
                               "or leave both empty for a SQLite store next to the runs") from None


def mlflow_uri(tracker_uri: str) -> str:
    """The tracking URI MLflow gets: ``tracker-uri``, else
    ``$MLFLOW_TRACKING_URI``, else "" (a SQLite store next to the runs)."""
    return tracker_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""


def round_metrics(row: dict) -> dict[str, float]:
    """The numbers of one ``metrics.jsonl`` row (``round`` and missing
    values left out), by their names in ``metrics.jsonl``."""
    return {key: float(value) for key, value in row.items()
            if key != "round" and isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value)}


def open_tracker(tracker: str, tracker_uri: str, run_dir: Path, config: dict,
                 rows_before: list[dict]) -> Tracker | None:
    """The tracker the run config names (None for ``none``), opened for the
    run in ``run_dir``; ``rows_before`` are the rounds a resumed run starts
    with."""
    if tracker == "none":
        return None
    require_tracker(tracker)
    if tracker == "tensorboard":
        log_dir = Path(tracker_uri).expanduser() / run_dir.name if tracker_uri else run_dir
        try:
            return TensorBoardTracker(log_dir, config, rows_before)
        except OSError as err:
            raise config_error("tracker-uri", tracker_uri, f"cannot write TensorBoard's files to {log_dir} "
                               f"({err.strerror or err}); give a writable folder, or leave it empty for the "
                               "run folder") from None
    uri = mlflow_uri(tracker_uri)
    try:
        return MlflowTracker(uri, run_dir, config, rows_before)
    except Exception as err:  # any failure of MLflow's: its store, its server, its URI
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        first = first if len(first) <= 200 else first[:200] + "..."
        raise config_error("tracker-uri", tracker_uri, f"could not open an MLflow run at {uri or 'the default store'} "
                           f"({type(err).__name__}: {first}); give a reachable tracking URI "
                           "(or leave it empty for a SQLite store next to the runs), or set tracker='none'") from None


class TensorBoardTracker:
    """Event files for TensorBoard: scalars per round, the config as text."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, config: dict, rows_before: list[dict]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        resumed_events = bool(rows_before) and any(log_dir.glob("events.out.tfevents.*"))
        first_round = rows_before[-1]["round"] + 1 if rows_before else 1
        # purge_step: TensorBoard hides what an earlier writer logged at steps >= it
        # a run in a folder that holds another run's events (a sweep cell run again) hides them all
        earlier = any(log_dir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_round if earlier else None)
        self.last_round = first_round - 1
        self.log_dir = log_dir
        root = log_dir.parent.resolve()  # the results folder, or tracker-uri: every run beside this one
        self.where = f"TensorBoard: tensorboard --logdir {root}"
        if not resumed_events:
            self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)
            for row in rows_before:  # a resumed run that had no tracker before
                self.log_round(row)
        self.writer.flush()

    def log_round(self, row: dict) -> None:
        for key, value in round_metrics(row).items():
            self.writer.add_scalar(key, value, global_step=row["round"])
        self.writer.flush()
        self.last_round = row["round"]

    def close(self, state: str) -> None:
        self.writer.add_text("state", state, global_step=self.last_round)  # a resumed run's end is later
        self.writer.close()


class MlflowTracker:
    """One MLflow run per fedaccel run, through :class:`mlflow.MlflowClient`
    (not the fluent API's process-wide active run)."""

    name = "mlflow"

    def __init__(self, uri: str, run_dir: Path, config: dict, rows_before: list[dict]) -> None:
        from mlflow import MlflowClient

        artifacts = None
        if not uri:  # next to the run folders, where the run is recorded
            store = run_dir.resolve().parent / MLFLOW_STORE
            store.mkdir(exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
            artifacts = (store / "artifacts").as_uri()
        self.uri = uri
        self._lock = _sqlite_lock(uri)
        with self._lock:
            self.client = MlflowClient(uri)
            self._open(run_dir, config, rows_before, artifacts)
        self.where = (f"MLflow run {self.run_id}: mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite:")
                      else f"MLflow run {self.run_id} at {uri}")

    def _open(self, run_dir: Path, config: dict, rows_before: list[dict], artifacts: str | None) -> None:
        from mlflow.entities import Param

        uri = self.uri
        saved = _read_tracker_file(run_dir)
        self.last_logged = 0
        if rows_before and saved.get("tracker") == "mlflow" and saved.get("uri") == uri:
            self.run_id = saved["run_id"]
            history = self.client.get_metric_history(self.run_id, "seconds")
            self.last_logged = max((m.step for m in history), default=0)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or MLFLOW_EXPERIMENT
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                try:
                    experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
                except Exception:  # another run created it meanwhile (a tracking server is not locked)
                    experiment = self.client.get_experiment_by_name(name)
                    if experiment is None:
                        raise
            if experiment is not None:
                experiment_id = experiment.experiment_id
            self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                                 tags={"fedaccel.run_dir": str(run_dir)}).info.run_id
            params = [Param(key, str(value)) for key, value in sorted(config.items()) if key != "resolved"]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])
            self.client.log_dict(self.run_id, config, "config.json")
            _write_tracker_file(run_dir, {"tracker": "mlflow", "uri": uri, "run_id": self.run_id})
        for row in rows_before:
            self._log_round(row)

    def log_round(self, row: dict) -> None:
        with self._lock:
            self._log_round(row)

    def _log_round(self, row: dict) -> None:
        if row["round"] <= self.last_logged:
            return  # logged by the run before it was resumed, with the same numbers
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, value, now, row["round"]) for key, value in round_metrics(row).items()])
        self.last_logged = row["round"]

    def close(self, state: str) -> None:
        with self._lock:
            self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[state])


def _sqlite_lock(uri: str) -> Any:
    """A lock file beside a SQLite store (runs in parallel share it), else none."""
    if not uri.startswith("sqlite:///"):
        return nullcontext()
    from filelock import FileLock  # a dependency of torch

    return FileLock(uri[len("sqlite:///"):] + ".lock")


def _read_tracker_file(run_dir: Path) -> dict[str, Any]:
    try:
        saved = json.loads((run_dir / TRACKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _write_tracker_file(run_dir: Path, content: dict[str, Any]) -> None:
    tmp = run_dir / f".{TRACKER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / TRACKER_FILE)
