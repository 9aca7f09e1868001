"""Start and stop runs from the dashboard: argument lists, never a shell.

A launched run is ``fedaccel-run`` (the fast runner) or ``flwr run`` on a
SuperLink connection of ``$FLWR_HOME/config.toml`` (local simulation, a Ray
cluster, a deployment), with the validated overrides as ``key=value``
tokens, ``run-name`` set so the dashboard knows its folder, and its console
captured to ``<run folder>/console.log``.

A launched study is ``fedaccel-sweep FILE --results-dir <first root>/sweeps``
(its console in ``<study folder>/console.log``); stopping it sends SIGINT to
its process group: no cell starts any more, the running cells record
``stopped``, and the same study launched again resumes it.

Stopping: a fast-runner run gets SIGINT (it records ``stopped`` in its
``status.json`` and exits 130); a Flower run is stopped through Flower's
Control API (``flwr stop RUN_ID CONNECTION``), whose id the ServerApp wrote
to ``status.json``; Flower kills the ServerApp, so the request is recorded in
``stop-requested.json`` and the run shows as stopped once its process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fedaccel.dashboard.runs import CONSOLE_FILE, LAUNCH_FILE, STOP_FILE, load_launch
from fedaccel.dashboard.schema import FormError, run_config_tokens
from fedaccel.dashboard.studies import STUDY_LAUNCH_FILE, sweep_process
from fedaccel.local_run import project_dir
from fedaccel.processes import SIGINT_STOPS_ENV, pid_alive, process_record
from fedaccel.results import load_status

ENGINES = ("fast", "flower")


@dataclass
class Launched:
    """A run this dashboard started."""

    run_dir: Path
    argv: list[str]
    process: subprocess.Popen
    stop_requested: bool = False


def flower_connections() -> tuple[list[str], str | None]:
    """The SuperLink connections of ``$FLWR_HOME/config.toml`` and the default."""
    try:
        from flwr.cli.flower_config import read_flower_config

        config, _ = read_flower_config()
    except Exception:  # no Flower config yet: nothing to offer
        return [], None
    superlink = config.get("superlink", {})
    names = sorted(k for k, v in superlink.items() if isinstance(v, dict))
    default = superlink.get("default")
    return names, default if default in names else None


def default_run_name(overrides: dict[str, Any]) -> str:
    from fedaccel.local_run import default_run_config

    cfg = {**default_run_config(), **overrides}
    return f"{cfg['algo']}-{cfg['dataset']}-seed{cfg['seed']}-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')[:-3]}"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _confirm_stop(run_dir: Path, run_id: int, connection: str | None, timeout: float = 300.0) -> None:
    """Wait until Flower lists ``run_id`` as finished, then record it."""
    from fedaccel.dashboard.flower_runs import flower_runs

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = flower_runs(connection).get("runs", [])
        status = next((r.get("status", "") for r in listed if r.get("run-id") == str(run_id)), "")
        if status.startswith("finished"):
            _write_json(run_dir / STOP_FILE, {"requested": time.time(), "via": "flwr stop", "confirmed": True,
                                              "flower-status": status})
            return
        time.sleep(1.0)


class Launcher:
    """Runs started here, by run folder."""

    def __init__(self, results_root: Path) -> None:
        self.results_root = results_root.resolve()
        self.launched: dict[Path, Launched] = {}
        self._lock = threading.Lock()

    def command(self, overrides: dict[str, Any], engine: str, num_clients: int,
                connection: str | None) -> tuple[list[str], Path, dict[str, Any]]:
        """The argument list that runs ``overrides``, the run's folder and
        the overrides it passes (with ``run-name`` and ``results-dir``)."""
        if engine not in ENGINES:
            raise FormError(f"engine={engine!r}: allowed: {', '.join(ENGINES)}", "engine")
        overrides = dict(overrides)
        if not overrides.get("run-name"):
            overrides["run-name"] = default_run_name(overrides)
        run_dir = self.results_root / str(overrides["run-name"])
        if run_dir.exists():
            raise FormError(f"run-name={overrides['run-name']!r}: {run_dir} exists already; "
                            "choose another run-name (or leave it empty)", "run-name")
        overrides["results-dir"] = str(self.results_root)
        tokens = run_config_tokens(overrides)
        if engine == "fast":
            return [sys.executable, "-m", "fedaccel.local_run", *tokens,
                    "--num-clients", str(num_clients)], run_dir, overrides
        names, default = flower_connections()
        connection = connection or default
        if connection not in names:
            raise FormError(f"connection={connection!r}: not a SuperLink connection of Flower's "
                            f"config.toml (there: {', '.join(names) or 'none'}); run "
                            "fedaccel-federations install", "connection")
        flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
        return [flwr, "run", str(project_dir()), connection, "--run-config", " ".join(tokens),
                "--stream"], run_dir, overrides

    def launch(self, overrides: dict[str, Any], engine: str = "fast", num_clients: int = 20,
               connection: str | None = None) -> Launched:
        connection = (connection or flower_connections()[1]) if engine == "flower" else None
        argv, run_dir, run_config = self.command(overrides, engine, num_clients, connection)
        run_dir.mkdir(parents=True)
        process = self._start(argv, run_dir)
        launch = {"argv": argv, "engine": engine, "run-config": run_config,
                  "num-clients": num_clients if engine == "fast" else None,
                  "connection": connection,
                  **process_record(process.pid), "started": time.time()}
        _write_json(run_dir / LAUNCH_FILE, launch)
        launched = Launched(run_dir=run_dir, argv=argv, process=process)
        with self._lock:
            self.launched[run_dir.resolve()] = launched
        return launched

    def stop(self, run_dir: Path) -> str:
        """Stop a running run; returns what was done, in words."""
        run_dir = run_dir.resolve()
        launched = self.launched.get(run_dir)
        launch = load_launch(run_dir) or {}
        status = load_status(run_dir) or {}
        engine = status.get("engine") or launch.get("engine")
        if engine == "flower":
            run_id = status.get("run_id")
            if run_id is None:
                raise FormError("this Flower run has not started its ServerApp yet (no run id); try again "
                                "in a few seconds")
            connection = launch.get("connection")
            argv = [shutil.which("flwr") or "flwr", "stop", str(run_id)] + ([connection] if connection else [])
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise FormError(f"flwr stop {run_id} failed: {(done.stderr or done.stdout).strip()[-300:]}")
            # Flower ends the ServerApp, which cannot say so itself: the request is
            # recorded here, and confirmed once Flower's Control API lists the run
            # as finished (then the dashboard shows it stopped, whatever its process does)
            _write_json(run_dir / STOP_FILE, {"requested": time.time(), "via": "flwr stop", "confirmed": False})
            threading.Thread(target=_confirm_stop, args=(run_dir, run_id, connection), daemon=True).start()
            return f"asked Flower's SuperLink to stop run {run_id}"
        if status and status.get("state") != "running":
            raise FormError(f"this run is not running (it is {status.get('state')})")
        if launched is not None and launched.process.poll() is None:
            if launched.stop_requested:
                raise FormError("already asked to stop: it stops at the end of the current step")
            launched.stop_requested = True
            _write_json(run_dir / STOP_FILE, {"requested": time.time(), "via": "SIGINT"})
            os.killpg(launched.process.pid, signal.SIGINT)
            return "sent SIGINT to the fast runner"
        # running by its status.json, or launched and not recording yet
        record = status or launch
        pid, host = record.get("pid"), record.get("host")
        if isinstance(pid, int) and host == socket.gethostname():
            if not pid_alive(pid, record.get("pid_start")):  # its pid may be another process's now
                raise FormError("the run's process is gone already")
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                raise FormError("the run's process is gone already") from None
            except PermissionError:
                raise FormError(f"process {pid} belongs to another user: stop it there") from None
            return f"sent SIGINT to process {pid}"
        raise FormError("this run is not running here (it finished, or runs on another host)")

    # ---------------------------------------------------------------- studies
    def study_command(self, study_file: str, workers: int | None, folder: Path | None = None
                      ) -> tuple[list[str], Path, int]:
        """The argument list that runs a study file, its folder and its cell
        count; the file and every cell checked as ``fedaccel-sweep`` checks
        them (:class:`FormError` with its message). New studies go to
        ``<first root>/sweeps``; ``folder``: an existing study's, whose
        unfinished cells are run (the file must still name that folder)."""
        from fedaccel.errors import USER_ERRORS
        from fedaccel.sweep import check_cells, check_plan, load_study

        if workers is not None and workers < 1:
            raise FormError(f"workers={workers}: must be a whole number >= 1", "workers")
        results = folder.parent if folder is not None else self.results_root / "sweeps"
        try:
            study, shared = load_study(study_file, str(results))
            if folder is not None and study.folder.resolve() != folder.resolve():
                raise FormError(f"{study_file} now names the study {study.name!r}, not {folder.name!r}: "
                                "launch it as a new study", "study")
            if sweep_process(study.folder) is not None:
                raise FormError(f"the study {study.name} is running already ({study.folder})", "study")
            check_plan(study, check_cells(study, shared), write=False)  # what the sweep would refuse
        except USER_ERRORS as err:
            raise FormError(str(err), "study") from None
        argv = [sys.executable, "-m", "fedaccel.sweep", str(study.file), "--results-dir", str(results)]
        return argv + (["--workers", str(workers)] if workers else []), study.folder, len(study.cells)

    def launch_study(self, study_file: str, workers: int | None = None,
                     folder: Path | None = None) -> tuple[Path, list[str]]:
        with self._lock:  # checked and started as one step: a double click starts one sweep
            argv, folder, _ = self.study_command(study_file, workers, folder)
            folder.mkdir(parents=True, exist_ok=True)
            process = self._start(argv, folder)
            _write_json(folder / STUDY_LAUNCH_FILE, {"argv": argv, "engine": "sweep", "study-file": study_file,
                                                     **process_record(process.pid), "started": time.time()})
        return folder, argv

    def stop_study(self, folder: Path) -> str:
        """SIGINT to the process group of the sweep that runs ``folder`` here."""
        process = sweep_process(folder)
        if process is None:
            raise FormError("this study is not running here (it finished, stopped, or runs on another host)")
        pid = process["pid"]
        try:
            if os.getpgid(pid) == pid:  # it leads its group (launched here, or a shell job): it and its workers
                os.killpg(pid, signal.SIGINT)
            else:  # started inside another group (a script): only the sweep, which ends its workers itself
                os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            raise FormError("the study's process is gone already") from None
        except PermissionError:
            raise FormError(f"the study's process {pid} belongs to another user: stop it there") from None
        return f"sent SIGINT to the sweep (process {pid}) and its workers"

    def _start(self, argv: list[str], folder: Path) -> subprocess.Popen:
        """Start ``argv`` in its own session, its output to ``folder/console.log``."""
        console = open(folder / CONSOLE_FILE, "w", encoding="utf-8")
        console.write("$ " + " ".join(argv) + "\n")
        console.flush()
        # its own session: no terminal's Ctrl-C reaches it, and the stop button's SIGINT must
        # stop it even where this dashboard inherited SIGINT ignored (a script's background job)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", SIGINT_STOPS_ENV: "1"}
        process = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=os.getcwd(), env=env, start_new_session=True)
        console.close()  # the child holds its own copy
        return process

    def shutdown(self) -> None:
        """Stop every run this dashboard started and still runs."""
        for launched in list(self.launched.values()):
            if launched.process.poll() is None:
                try:
                    os.killpg(launched.process.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
