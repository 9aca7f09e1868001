"""``flwr run .`` through Flower's Ray simulation, for every algorithm.

Each test module run starts one private local SuperLink (its own FLWR_HOME
and ports, so a user's SuperLink is never touched) and stops it at the end.
Results must match the fast runner's for the same seed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fakes import kill_unfinished, selected_ids
from fedaccel.federations import simulation_overrides
from fedaccel.local_run import default_run_config, fuse, project_dir, run_local
from fedaccel.superlink import local_superlink_pids, stop_local_superlink
from fedaccel.support import MATRIX, engine_runs

pytestmark = pytest.mark.slow

CONTROL_PORT = "39293"
# Every registered algorithm's default config, plus SCAFFOLD with dropped
# stragglers (the client-state commit protocol rolls their state back
# identically under Ray). fedcdr and fedrkmgc keep client state across rounds:
# matching the fast runner over several rounds shows it survives in Ray's
# simulation too. The suite runs a few; the engine matrix the rest
# (fedaccel/support.py, docs/support.md).
VARIANTS = {"default": {}, "stragglers dropped": {"straggler-fraction": 0.34, "straggler-policy": "drop"}}


def case_id(algo: str, variant: str) -> str:
    return algo + ("" if variant == "default" else "-stragglers")


CASES = [pytest.param(algo, VARIANTS[variant], id=case_id(algo, variant),
                      marks=[pytest.mark.engine_matrix] if tier == MATRIX else [])
         for algo, variant, tier in engine_runs("simulation")]
NUM_CLIENTS = 6


def flwr_bin() -> str:
    return str(Path(sys.executable).parent / "flwr")


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39291",
        "FLWR_LOCAL_CONTROL_API_PORT": CONTROL_PORT,
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    subprocess.run([sys.executable, "-m", "fedaccel.federations", "install"], env=env,
                   check=True, capture_output=True)
    yield env
    stop_local_superlink(CONTROL_PORT)
    assert local_superlink_pids(CONTROL_PORT) == []


def overrides(algo: str, results_dir: Path, **extra) -> dict:
    return {
        "algo": algo, "num-server-rounds": 4, "clients-per-round": 3, "local-epochs": 1,
        "accl-every": 2, "synthetic.max-samples": 120, "results-dir": str(results_dir),
        "run-name": algo, **extra,
    }


def toml_value(value) -> str:
    return f"'{value}'" if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def flwr_args(run_config: dict, nodes: int | None = NUM_CLIENTS, federation: str = "local-simulation") -> list[str]:
    """``flwr run`` on ``federation``, with ``nodes`` simulated nodes (None: the profile's size and resources)."""
    text = " ".join(f"{k}={toml_value(v)}" for k, v in run_config.items())
    # the profile's own resources per client with the size ("num-supernodes=N" alone would
    # give every client Flower's default 2 CPUs: one Ray worker for all nodes on 2 cores)
    size = ["--federation-config", simulation_overrides(federation, nodes)] if nodes is not None else []
    return [flwr_bin(), "run", ".", federation, "--run-config", text, *size, "--stream"]


def flwr_run(env: dict, run_config: dict, timeout: float = 300, nodes: int | None = NUM_CLIENTS,
             federation: str = "local-simulation") -> subprocess.CompletedProcess:
    return subprocess.run(flwr_args(run_config, nodes, federation), cwd=project_dir(), env=env,
                          capture_output=True, text=True, timeout=timeout)


FLOAT64 = {"precision": "float64", "client-state": "context"}
COHORT_NODES = {"logical-clients": 12, "clients-per-round": 8, "client-state": "context"}


@pytest.fixture(scope="module")
def suite_runs(flwr_env, request, tmp_path_factory):
    """The suite's ``flwr run``s whose tests were selected: the first alone
    (it starts the module's SuperLink; two at once would both start one),
    then the others all at once, since a short simulated run is mostly
    Flower's and Ray's start-up and polling, which concurrent runs share
    (3 runs: 46 s together against 77 s one after another, on 2 cores).
    Maps a key to ``(return code, stdout and stderr, results folder)``; a
    test whose key is not here (the engine matrix's) runs its own."""
    root = tmp_path_factory.mktemp("sim-runs")
    wanted: dict[str, tuple[dict, int]] = {}
    cases = selected_ids(request, "test_flwr_run_matches_fast_runner")
    for algo, variant, tier in engine_runs("simulation"):
        key = case_id(algo, variant)
        if tier != MATRIX and key in cases:
            wanted[key] = (overrides(algo, root / key, **VARIANTS[variant]), NUM_CLIENTS)
    if selected_ids(request, "test_float64_runs_through_flowers_simulation"):
        wanted["float64"] = (overrides("scaffold", root / "float64", **FLOAT64), NUM_CLIENTS)
    if selected_ids(request, "test_cohort_nodes_in_flowers_simulation_match_the_fast_runner"):
        wanted["cohort-nodes"] = (overrides("scaffold", root / "cohort-nodes", **COHORT_NODES,
                                            **{"cohort-batching": "auto"}), 3)
    if selected_ids(request, "test_flwr_run_bad_config_is_a_failed_run_with_one_clear_line"):
        wanted["bad-config"] = ({"algo": "fedprx", "results-dir": str(root / "bad-config")}, NUM_CLIENTS)
    procs: dict[str, subprocess.Popen] = {}
    done: dict[str, tuple[int, str, Path]] = {}

    def start(key: str) -> None:
        config, nodes = wanted[key]
        procs[key] = subprocess.Popen(flwr_args(config, nodes), cwd=project_dir(), env=flwr_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(key: str, timeout: float) -> None:
        out = procs[key].communicate(timeout=timeout)[0]
        done[key] = (procs[key].returncode, out, Path(wanted[key][0]["results-dir"]))

    try:
        keys = list(wanted)
        for i, key in enumerate(keys):
            start(key)
            if i == 0:
                finish(key, 600)
        for key in keys[1:]:
            finish(key, 900)
        yield done
    finally:
        kill_unfinished(procs.values())


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo,extra", CASES)
def test_flwr_run_matches_fast_runner(flwr_env, suite_runs, request, tmp_path, algo, extra):
    key = request.node.callspec.id
    if key in suite_runs:
        returncode, out, sim_root = suite_runs[key]
    else:  # only the engine matrix's cases run on their own
        assert request.node.get_closest_marker("engine_matrix"), f"{key}: a suite case suite_runs did not start"
        proc = flwr_run(flwr_env, overrides(algo, tmp_path / "sim", **extra))
        returncode, out, sim_root = proc.returncode, proc.stdout + proc.stderr, tmp_path / "sim"
    assert returncode == 0, out[-3000:]
    sim_dir = sim_root / algo
    assert "results written to" in out and str(sim_dir) in out
    # --stream shows every round as it ends: accuracy, loss, MB, seconds
    rounds = re.findall(r"\[fedaccel\] round +(\d+)/4 +accg [\d.]+ +loss [\d.]+ .*up [\d.]+ MB +down [\d.]+ MB +[\d.]+ s", out)
    assert rounds == ["1", "2", "3", "4"], out[-3000:]
    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png"):
        assert (sim_dir / name).is_file(), name

    fast_dir = run_local(fuse(default_run_config(), overrides(algo, tmp_path / "fast", **extra)),
                         num_clients=NUM_CLIENTS, quiet=True)
    sim, fast = rows(sim_dir), rows(fast_dir)
    test_size = json.loads((sim_dir / "config.json").read_text())["resolved"]["global-test-size"]
    assert len(sim) == len(fast) == 4
    assert_same_rows(sim, fast, test_size)


def assert_same_rows(sim: list[dict], fast: list[dict], test_size: int) -> None:
    """Flower's rows equal the fast runner's: bytes exactly, accuracy to one
    prediction, loss to 1e-4 (a Ray worker's torch threads may round otherwise)."""
    assert len(sim) == len(fast)
    for s, f in zip(sim, fast):
        assert s["bytes_up"] == f["bytes_up"] and s["bytes_down"] == f["bytes_down"]
        assert abs(s["accg"] - f["accg"]) <= 1.0 / test_size  # one prediction at most
        assert s["loss"] == pytest.approx(f["loss"], rel=1e-4)
        assert (s["accl"] is None) == (f["accl"] is None)


def test_float64_runs_through_flowers_simulation(suite_runs, tmp_path):
    """``precision='float64'`` under flwr run: SCAFFOLD (state on both sides)
    keeps a float64 model, float64 arrays on the wire (about twice the
    float32 bytes) and the fast runner's rows."""
    returncode, out, sim_root = suite_runs["float64"]
    config = overrides("scaffold", sim_root, **FLOAT64)
    assert returncode == 0 and "results written to" in out, out[-3000:]
    sim_dir = sim_root / "scaffold"
    final = np.load(sim_dir / "final_model.npz")
    assert {final[k].dtype for k in final.files} == {np.dtype(np.float64)}
    fast_dir = run_local(fuse(default_run_config(), {**config, "results-dir": str(tmp_path / "fast")}),
                         num_clients=NUM_CLIENTS, quiet=True)
    fast32_dir = run_local(fuse(default_run_config(), {**config, "precision": "float32",
                                                       "results-dir": str(tmp_path / "fast32")}),
                           num_clients=NUM_CLIENTS, quiet=True)
    sim = rows(sim_dir)
    test_size = json.loads((sim_dir / "config.json").read_text())["resolved"]["global-test-size"]
    assert_same_rows(sim, rows(fast_dir), test_size)
    # twice the values' bytes (each array's .npy header stays the same size)
    assert all(1.9 * f["bytes_up"] < r["bytes_up"] < 2 * f["bytes_up"] for r, f in zip(sim, rows(fast32_dir)))


def test_cohort_nodes_in_flowers_simulation_match_the_fast_runner(suite_runs, tmp_path):
    """SCAFFOLD (state on both sides) with 12 logical clients on 3 simulated
    nodes, each node training its share of a round as one batch: the same
    rows as the fast runner's 12 clients on 3 cohort nodes (docs/cohort-batching.md)."""
    returncode, out, sim_root = suite_runs["cohort-nodes"]
    config = overrides("scaffold", sim_root, **COHORT_NODES, **{"cohort-batching": "auto"})
    assert returncode == 0 and "results written to" in out, out[-3000:]
    assert "cohort nodes: each node trains its clients of a round as one batched model" in out, out[-3000:]
    sim_dir = sim_root / "scaffold"
    fast_dir = run_local(fuse(default_run_config(), {**config, "results-dir": str(tmp_path / "fast")}),
                         num_clients=3, quiet=True)
    test_size = json.loads((sim_dir / "config.json").read_text())["resolved"]["global-test-size"]
    assert json.loads((sim_dir / "config.json").read_text())["resolved"]["num-clients"] == 12
    assert_same_rows(rows(sim_dir), rows(fast_dir), test_size)


@pytest.mark.engine_matrix  # starts a two-node Ray cluster and its own SuperLink: ~60 s
def test_cohort_nodes_on_a_multi_node_ray_cluster(tmp_path):
    """The ``ray-cluster`` profile on a two-node Ray cluster
    (``ray.cluster_utils.Cluster``, as two machines would be; RAY_ADDRESS set
    before the SuperLink starts, as docs/cohort-batching.md says; on one
    machine Ray would also find the running cluster by itself): two cohort
    nodes serve 12 clients of FedCDR, equal to the fast runner's; each Ray
    node (one CPU each) had its CPU taken by Flower's client actors while the
    run went on (a Ray of Flower's own would leave the cluster idle), so the
    run used the cluster, one cohort node per Ray node."""
    import ray
    from ray._private.state import available_resources_per_node  # Ray's own accounting, per node
    from ray.cluster_utils import Cluster

    home = tmp_path / "flwr-home"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39391",
           "FLWR_LOCAL_CONTROL_API_PORT": "39393", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_ADDRESS": cluster.address}
    busy: set[str] = set()  # Ray nodes seen with no CPU left
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        for command in (["install"], ["size", "ray-cluster", "2"]):  # the profile's 1 CPU per node kept
            subprocess.run([sys.executable, "-m", "fedaccel.federations", *command], env=env,
                           check=True, capture_output=True)
        config = overrides("fedcdr", tmp_path / "sim", **COHORT_NODES)
        text = " ".join(f"{k}={toml_value(v)}" for k, v in config.items())
        ray.init(address=cluster.address)
        proc = subprocess.Popen([flwr_bin(), "run", ".", "ray-cluster", "--run-config", text, "--stream"],
                                cwd=project_dir(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            busy |= {node for node, free in available_resources_per_node().items() if free.get("CPU", 0) == 0}
            time.sleep(0.2)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "results written to" in out, out[-3000:]
    finally:
        ray.shutdown()
        stop_local_superlink("39393")
        cluster.shutdown()
    assert local_superlink_pids("39393") == []
    assert len(busy) == 2, f"Ray nodes whose CPU Flower's actors took: {busy}"
    sim_dir = tmp_path / "sim" / "fedcdr"
    assert json.loads((sim_dir / "config.json").read_text())["resolved"]["num-clients"] == 12
    fast_dir = run_local(fuse(default_run_config(), {**config, "results-dir": str(tmp_path / "fast")}),
                         num_clients=2, quiet=True)
    test_size = json.loads((sim_dir / "config.json").read_text())["resolved"]["global-test-size"]
    assert_same_rows(rows(sim_dir), rows(fast_dir), test_size)


def run_log(env: dict, output: str, wanted: str, timeout: float = 60) -> str:
    """The run's log, re-read with `flwr log --show` until ``wanted`` is in it.

    A run that fails at once can end before `flwr run --stream` has printed
    its last lines, so the stream alone is not a reliable place to look.
    """
    match = re.search(r"run_id `(\d+)`|started run (\d+)", output)
    assert match, output[-2000:]
    run_id = match.group(1) or match.group(2)
    deadline = time.monotonic() + timeout
    text = output
    while wanted not in text and time.monotonic() < deadline:
        time.sleep(2)
        shown = subprocess.run([flwr_bin(), "log", run_id, "--show"], cwd=project_dir(), env=env,
                               capture_output=True, text=True, timeout=60)
        text = output + shown.stdout + shown.stderr
    return text


def run_status(env: dict, run_id: str, timeout: float = 60) -> str:
    """``flwr ls``'s status of a run, once it has finished."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run([flwr_bin(), "ls", "--run-id", run_id, "--format", "json"],
                               cwd=project_dir(), env=env, capture_output=True, text=True, timeout=60)
        status = json.loads(shown.stdout)["runs"][0]["status"]
        if status.startswith("finished") or time.monotonic() > deadline:
            return status
        time.sleep(1)


def test_flwr_run_bad_config_is_a_failed_run_with_one_clear_line(flwr_env, suite_runs):
    _, out, results_dir = suite_runs["bad-config"]
    wanted = ("Simulation stopped: [fedaccel] invalid run config: algo='fedprx': allowed: fedacg, "
              "fedadam, fedavg")
    log = run_log(flwr_env, out, wanted)
    assert wanted in log and "(did you mean 'fedprox'?)" in log
    assert "Traceback" not in log
    run_id = re.search(r"run_id `(\d+)`|started run (\d+)", out)
    assert run_status(flwr_env, run_id.group(1) or run_id.group(2)) == "finished:failed"
    assert not (results_dir / "fedprx").exists()


@pytest.mark.engine_matrix  # Flower starts 400 simulated SuperNodes: about a minute
def test_a_simulation_too_large_for_the_machine_says_what_to_change(flwr_env, tmp_path):
    """More simulated SuperNodes than answer within round-timeout: the run is
    finished:failed, and its one line says to set fewer SuperNodes in
    simulation (not only "start the missing SuperNodes")."""
    proc = flwr_run(flwr_env, {"round-timeout": 5.0, "results-dir": str(tmp_path)}, nodes=400, timeout=400)
    out = proc.stdout + proc.stderr
    log = run_log(flwr_env, out, "fedaccel-federations size local-simulation", timeout=180)
    assert re.search(r"Simulation stopped: \[fedaccel\] .*(did not say which partition|registered within)", log), \
        log[-3000:]
    assert "fedaccel-federations size local-simulation N" in log and "Traceback" not in log
    run_id = re.search(r"run_id `(\d+)`|started run (\d+)", out)
    assert run_status(flwr_env, run_id.group(1) or run_id.group(2)) == "finished:failed"


@pytest.mark.engine_matrix
def test_flwr_run_resumes_from_a_checkpoint_to_the_same_model(flwr_env, tmp_path):
    """FedCDR (server and client state) in Flower's simulation, clients on
    disk: resumed with its checkpoint's round-00002.toml from round 2, it ends
    with the model of the run that went through (docs/checkpoints.md)."""
    import numpy as np

    config = overrides("fedcdr", tmp_path, **{"client-state": "disk", "state-dir": str(tmp_path / "state"),
                                              "checkpoint-every": 2})
    proc = flwr_run(flwr_env, config)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    run_dir = tmp_path / "fedcdr"
    whole = dict(np.load(run_dir / "final_model.npz"))
    whole_rows = [{k: v for k, v in r.items() if k != "seconds"} for r in rows(run_dir)]
    (run_dir / "final_model.npz").unlink()
    resumed = subprocess.run(
        [flwr_bin(), "run", ".", "--run-config", str(run_dir / "checkpoints" / "round-00002.toml"),
         "--federation-config", simulation_overrides("local-simulation", NUM_CLIENTS), "--stream"],
        cwd=project_dir(), env=flwr_env, capture_output=True, text=True, timeout=300)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resuming after round 2 of 4" in out, out[-3000:]
    after = dict(np.load(run_dir / "final_model.npz"))
    assert all(np.array_equal(whole[k], after[k]) for k in whole)
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in rows(run_dir)] == whole_rows


@pytest.mark.engine_matrix  # ~30-60 s of Flower start-up: with the engine matrix
def test_flwr_run_sends_its_rows_to_mlflow(flwr_env, tmp_path):
    """tracker='mlflow' on Flower's simulation: the ServerApp's MLflow run
    holds every number of metrics.jsonl and the run config."""
    from tests.test_trackers import expected_scalars, mlflow_run

    proc = flwr_run(flwr_env, overrides("fedavg", tmp_path, tracker="mlflow"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    run_dir = tmp_path / "fedavg"
    _, run, history = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.data.params["num-server-rounds"] == "4"
    assert history == expected_scalars(rows(run_dir))
    assert f"metrics also in MLflow run {run.info.run_id}" in out


@pytest.mark.engine_matrix  # ~30-60 s of Flower start-up: with the engine matrix
def test_a_sweep_runs_its_cells_on_flower(flwr_env, tmp_path):
    """fedaccel-sweep --federation local-simulation: each cell a `flwr run`,
    one after another, results in the cells' folders, the report over them;
    a simulation whose size is not the study's num-clients is refused first."""
    import yaml

    study = {"name": "on-flower", "results-dir": str(tmp_path / "sweeps"), "num-clients": NUM_CLIENTS,
             "base": {"num-server-rounds": 2, "clients-per-round": 3, "local-epochs": 1, "accl-every": 0,
                      "synthetic": {"max-samples": 120}},
             "variants": [{"algo": "fedavg"}, {"algo": "fedprox"}], "seeds": [0]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    sweep = [sys.executable, "-m", "fedaccel.sweep", str(path), "--federation", "local-simulation"]
    refused = subprocess.run(sweep, env=flwr_env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"fedaccel-sweep: error: --federation local-simulation: its simulation has 20 SuperNodes, the study's "
        f"num-clients is {NUM_CLIENTS}: run fedaccel-federations size local-simulation {NUM_CLIENTS} "
        f"(or set num-clients: 20 in the study)")
    subprocess.run([sys.executable, "-m", "fedaccel.federations", "size", "local-simulation", str(NUM_CLIENTS)],
                   env=flwr_env, check=True, capture_output=True)
    done = subprocess.run(sweep, env=flwr_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "on Flower (local-simulation), one after another" in done.stderr
    cells = tmp_path / "sweeps" / "on-flower" / "cells"
    for name in ("algo=fedavg,seed=0", "algo=fedprox,seed=0"):
        assert len(rows(cells / name)) == 2
        assert json.loads((cells / name / "status.json").read_text())["engine"] == "flower"
        assert "results written to" in (cells / name / "console.log").read_text()
    assert (tmp_path / "sweeps" / "on-flower" / "report" / "groups.csv").is_file()
    # run again: both cells are finished, nothing runs
    again = subprocess.run(sweep, env=flwr_env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "2 already finished, 0 to run" in again.stderr


@pytest.mark.engine_matrix  # ~30-60 s of Flower start-up: with the engine matrix
def test_ctrl_c_of_a_sweep_stops_its_running_flower_cell(flwr_env, tmp_path):
    """SIGINT to a sweep whose cell runs on Flower (Ctrl-C, the dashboard's
    stop): the sweep asks Flower to stop that run (`flwr stop`) and exits
    130; Flower lists the run as finished, stopped, long before its rounds."""
    import signal

    import yaml

    from fedaccel.processes import SIGINT_STOPS_ENV

    study = {"name": "stopped", "results-dir": str(tmp_path / "sweeps"), "num-clients": NUM_CLIENTS,
             "base": {"num-server-rounds": 500, "clients-per-round": 3, "local-epochs": 1, "accl-every": 0,
                      "synthetic": {"max-samples": 120}},
             "variants": [{"algo": "fedavg"}], "seeds": [0]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    subprocess.run([sys.executable, "-m", "fedaccel.federations", "size", "local-simulation", str(NUM_CLIENTS)],
                   env=flwr_env, check=True, capture_output=True)
    # as the dashboard starts a sweep: in its own session, told that SIGINT stops it (a
    # test run that is itself a script's background job would pass SIGINT on as ignored)
    sweep = subprocess.Popen([sys.executable, "-m", "fedaccel.sweep", str(path), "--federation", "local-simulation"],
                             env={**flwr_env, SIGINT_STOPS_ENV: "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "sweeps" / "stopped" / "cells" / "algo=fedavg,seed=0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):  # round 1 is done
            assert sweep.poll() is None, sweep.communicate()
            assert time.monotonic() < deadline, "the Flower cell's first round"
            time.sleep(0.2)
        run_id = json.loads((metrics.parent / "status.json").read_text())["run_id"]
        os.killpg(sweep.pid, signal.SIGINT)
        _, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 130, err[-2000:]
    assert "fedaccel-sweep: stopped" in err
    listed = subprocess.run([flwr_bin(), "ls", "local-simulation", "--run-id", str(run_id), "--format", "json"],
                            cwd=project_dir(), env=flwr_env, capture_output=True, text=True, timeout=60)
    assert "stopped" in listed.stdout and "finished" in listed.stdout, listed.stdout
    assert metrics.read_text().count("\n") < 500
