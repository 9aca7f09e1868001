"""Real networked clients on 127.0.0.1: a SuperLink with TLS and SuperNode
authentication, two SuperNodes, two-round runs of every algorithm through
them (FedAvg and FedCDR in the suite, the rest in the engine matrix), refused
clients; in the engine matrix too (minutes each), a SuperNode killed mid-run,
and one crashed and restarted. Every process is stopped.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time

import pytest

from fakes import kill_unfinished, selected_ids
from fedaccel.deployment import LocalDeployment
from fedaccel.local_run import run_local
from fedaccel.support import MATRIX, SUITE, engine_runs

pytestmark = [pytest.mark.slow, pytest.mark.deployment]

if shutil.which("ssh-keygen") is None or shutil.which("openssl") is None:  # pragma: no cover
    pytest.skip("needs ssh-keygen and openssl", allow_module_level=True)

SMALL = ("clients-per-round=2 local-epochs=1 accl-every=0 synthetic.max-samples=120 "
         "eval-every=1")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = LocalDeployment(tmp_path_factory.mktemp("deploy"), port=9391, clientapp_port=9394)
    try:
        dep.start(2)
        yield dep
    finally:
        dep.stop()
        assert dep.superlink is None and not dep.supernodes


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


RUNS = engine_runs("deployment")  # every registered algorithm (docs/support.md)
SUITE_ALGOS = [algo for algo, _, tier in RUNS if tier == SUITE]
MATRIX_ALGOS = [algo for algo, _, tier in RUNS if tier == MATRIX]


def two_rounds(algo: str) -> str:
    return f"algo='{algo}' num-server-rounds=2 run-name='{algo}' {SMALL}"


def check_two_rounds(deployment, algo: str, returncode: int, out: str) -> None:
    run_dir = deployment.results / algo
    # a ServerApp that raised still ends `flwr run --stream` with 0: its traceback is in the output's end
    assert returncode == 0, out[-6000:]
    assert f"results written to {run_dir}" in out, out[-6000:]
    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png", "final_model.npz"):
        assert (run_dir / name).is_file(), name
    metrics = rows(run_dir)
    assert [r["round"] for r in metrics] == [1, 2]
    assert all(r["clients"] == 2 and r["failures"] == 0 for r in metrics)
    # the same numbers as the fast runner with the same two partitions
    config = json.loads((run_dir / "config.json").read_text())
    run_config = {k: v for k, v in config.items() if k != "resolved"}
    fast = rows(run_local(run_config | {"results-dir": str(deployment.work / "fast")},
                          num_clients=2, quiet=True))
    assert_same_as_fast(metrics, fast, config["resolved"]["global-test-size"])


def assert_same_as_fast(metrics: list[dict], fast: list[dict], test_size: int) -> None:
    """The deployment's rows are the fast runner's: bytes exactly, accuracy to
    one prediction, loss to 1e-4."""
    for d, f in zip(metrics, fast, strict=True):
        assert d["bytes_up"] == f["bytes_up"] and d["bytes_down"] == f["bytes_down"]
        assert abs(d["accg"] - f["accg"]) <= 1.0 / test_size  # one prediction at most
        assert d["loss"] == pytest.approx(f["loss"], rel=1e-4)


@contextlib.contextmanager
def started_together(deployment, configs: dict[str, str]):
    """A run per ``configs`` value, all started at once: a deployment round is
    mostly waiting (each message starts a fresh ClientApp process, the
    ServerApp polls every 3 s), so concurrent runs share that wait."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        for key, config in configs.items():
            procs[key] = deployment.run_async(config)
        yield procs
    finally:
        kill_unfinished(procs.values())


COHORT_NODES = ("algo='scaffold' num-server-rounds=3 run-name='cohort-nodes' logical-clients=6 "
                "cohort-batching='auto' client-state='context' local-epochs=1 accl-every=0 "
                "synthetic.max-samples=120 eval-every=1 clients-per-round=4")


@pytest.fixture(scope="module")
def suite_runs(deployment, request):
    """The suite's runs through the deployment: two rounds of each suite
    algorithm and the cohort-node run, as far as their tests were selected."""
    configs = {algo: two_rounds(algo) for algo in SUITE_ALGOS
               if algo in selected_ids(request, "test_two_rounds_through_real_supernodes")}
    if selected_ids(request, "test_cohort_nodes_through_real_supernodes"):
        configs["cohort-nodes"] = COHORT_NODES
    with started_together(deployment, configs) as procs:
        yield procs


@pytest.fixture(scope="module")
def matrix_runs(deployment, request):
    wanted = selected_ids(request, "test_matrix_two_rounds_through_real_supernodes")
    with started_together(deployment, {algo: two_rounds(algo) for algo in MATRIX_ALGOS if algo in wanted}) as procs:
        yield procs


@pytest.mark.parametrize("algo", SUITE_ALGOS)
def test_two_rounds_through_real_supernodes(deployment, suite_runs, algo):
    out, _ = suite_runs[algo].communicate(timeout=900)
    check_two_rounds(deployment, algo, suite_runs[algo].returncode, out)


def test_cohort_nodes_through_real_supernodes(deployment, suite_runs):
    """SCAFFOLD (state on both sides) with 6 logical clients served by the two
    real SuperNodes (node k serves the clients p % 2 == k), 4 clients a round,
    each node training its share of a round as one batch: the envelopes cross
    TLS and SuperNode authentication, and the rows equal the fast runner's 6
    clients on 2 cohort nodes; the server reports 6 clients."""
    proc = suite_runs["cohort-nodes"]
    out, _ = proc.communicate(timeout=900)
    run_dir = deployment.results / "cohort-nodes"
    assert proc.returncode == 0 and f"results written to {run_dir}" in out, out[-3000:]
    assert "cohort nodes: each node trains its clients of a round as one batched model" in out, out[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resolved"]["num-clients"] == 6
    metrics = rows(run_dir)
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert all(r["clients"] == 4 and r["failures"] == 0 for r in metrics), metrics
    run_config = {k: v for k, v in config.items() if k != "resolved"}
    fast = rows(run_local(run_config | {"results-dir": str(deployment.work / "fast-cohort")},
                          num_clients=2, quiet=True))
    assert_same_as_fast(metrics, fast, config["resolved"]["global-test-size"])


@pytest.mark.engine_matrix
@pytest.mark.parametrize("algo", MATRIX_ALGOS)
def test_matrix_two_rounds_through_real_supernodes(deployment, matrix_runs, algo):
    out, _ = matrix_runs[algo].communicate(timeout=900)
    check_two_rounds(deployment, algo, matrix_runs[algo].returncode, out)


def test_unregistered_key_and_wrong_ca_are_refused(deployment, tmp_path):
    # A key that was never registered.
    deployment.start_supernode(5, 2, key=deployment.key(5))
    # A CA that did not sign the SuperLink's certificate.
    other = tmp_path / "other-ca"
    subprocess.run(["bash", "scripts/gen-certs.sh", str(other)], check=True, capture_output=True)
    deployment.register(6)
    deployment.start_supernode(6, 2, root_certificates=other / "ca.crt")
    def refused(index: int, *marks: str) -> bool:
        log = deployment.logs / f"supernode-{index}.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        return any(mark in text for mark in marks)

    try:
        deadline = time.monotonic() + 60
        while not (refused(5, "code: 2004") and refused(6, "CERTIFICATE_VERIFY_FAILED")):
            assert time.monotonic() < deadline, (
                (deployment.logs / "supernode-5.log").read_text(errors="replace")[-1500:]
                + (deployment.logs / "supernode-6.log").read_text(errors="replace")[-1500:])
            time.sleep(0.2)
        listing = json.loads(deployment.flwr("supernode", "list", "deployment", "--format", "json").stdout)
        statuses = sorted(n["status"] for n in listing["nodes"])
        # the two good SuperNodes online; key 6 registered but never let in; key 5 unknown
        assert statuses.count("online") == 2, listing
        assert len(listing["nodes"]) == 3, listing
    finally:
        for index in (5, 6):
            deployment._kill(deployment.supernodes.pop(index))


@pytest.mark.engine_matrix  # its own SuperLink and two SuperNodes: ~1 min
def test_a_device_with_a_corrupted_data_file_is_reported_and_the_run_goes_on(tmp_path):
    """A real SuperNode whose own data file (``data-path``) is damaged: its
    client replies with an error naming the node and the cause, the server
    logs it once, counts it in every round's failures and goes on with the
    other SuperNode."""
    bad = tmp_path / "device.npz"
    bad.write_bytes(b"PK\x03\x04 this is not a whole .npz file")
    dep = LocalDeployment(tmp_path / "deploy", port=9491, clientapp_port=9494)
    try:
        dep.start_superlink()
        for i in range(2):
            dep.register(i)
        dep.start_supernode(0, 2)
        dep.start_supernode(1, 2, node_config=f"data-path='{bad}'")
        proc = dep.run(two_rounds("fedavg"))
    finally:
        dep.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "results written to" in out, out[-3000:]
    assert f"(partition 1): data-path='{bad}' is corrupted" in out, out[-3000:]
    assert "Traceback" not in out
    metrics = rows(dep.results / "fedavg")
    assert [(r["clients"], r["failures"]) for r in metrics] == [(1, 1), (1, 1)]  # aggregated, failed


@pytest.mark.engine_matrix  # minutes: Flower notices a dead SuperNode after 35-60 s
def test_killed_supernode_does_not_hang_the_run(deployment):
    """Round timeout 20 s: after SuperNode 1 dies, rounds go on with the live one."""
    proc = deployment.run_async(
        f"algo='fedavg' num-server-rounds=3 round-timeout=20.0 run-name='killed' {SMALL}")
    run_dir = deployment.results / "killed"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").is_file():
        time.sleep(0.5)
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").read_text().strip():
        time.sleep(0.5)
    deployment.kill_supernode(1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    metrics = rows(run_dir)
    assert [r["round"] for r in metrics] == [1, 2, 3]
    assert metrics[0]["clients"] == 2
    assert all(r["clients"] == 1 and r["failures"] == 1 for r in metrics[1:])
    assert "results written to" in out


def count_rows(path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.engine_matrix  # minutes: Flower notices a dead SuperNode after 35-60 s
def test_disk_client_state_survives_a_supernode_crash_and_restart(tmp_path):
    """FedCDR on its own SuperLink and 2 SuperNodes, two runs at once: one with
    ``client-state='disk'``, one with ``'context'``. After round 1 SuperNode 1
    is killed (SIGKILL) and started again with the same key and node config.

    - The SuperLink refuses the key while the crashed session still counts as
      online (code 2004, up to ~60 s), then takes it back under the *same*
      node id (the registered key fixes it), so the running ServerApps keep
      sampling it and partition 1 trains again.
    - Disk state: partition 1 finds its state, ``state_lost`` stays 0.
    - Context state: partition 1 comes back empty, ``state_lost`` is 1 once.
    """
    dep = LocalDeployment(tmp_path / "deploy", port=9401, clientapp_port=9404)
    modes = ("disk", "context")
    rounds = 5
    procs = {}
    try:
        dep.start(2)
        for mode in modes:
            # round-timeout is only a safety net here: a round waiting on the
            # dead SuperNode ends when the SuperLink declares it offline.
            procs[mode] = dep.run_async(
                f"algo='fedcdr' num-server-rounds={rounds} round-timeout=120.0 "
                f"client-state='{mode}' state-dir='{tmp_path / 'state'}' run-name='restart-{mode}' "
                f"{SMALL}")
        files = {mode: dep.results / f"restart-{mode}" / "metrics.jsonl" for mode in modes}
        deadline = time.monotonic() + 300
        while not all(count_rows(f) >= 1 for f in files.values()):
            assert time.monotonic() < deadline, "round 1 did not finish"
            assert all(p.poll() is None for p in procs.values()), "a run stopped early"
            time.sleep(0.3)
        node_id = dep.node_ids(1)[0]
        dep.kill_supernode(1)
        at_kill = {mode: count_rows(f) for mode, f in files.items()}
        assert max(at_kill.values()) <= rounds - 3, at_kill  # rounds left after the restart

        # Restarted at once (as a supervisor would): refused while the crashed
        # session counts as online.
        refused = dep.start_supernode(1, 2)
        assert refused.wait(timeout=60) != 0
        assert "code: 2004" in (dep.logs / "supernode-1.log").read_text()
        while dep.node_status(node_id) == "online":
            assert time.monotonic() < deadline, "the SuperLink never declared SuperNode 1 offline"
            time.sleep(1)
        # The servers poll every 3 s: let them see the dead node's round fail
        # (node unavailable) before it is back, or that round waits for the timeout.
        time.sleep(5)
        assert dep.restart_supernode(1, 2) == node_id  # same key -> same node id
        superlink_log = (dep.logs / "superlink.log").read_text()
        assert superlink_log.count(f"Activated node_id={node_id}") == 2

        outs = {mode: proc.communicate(timeout=300)[0] for mode, proc in procs.items()}
        for mode in modes:
            assert procs[mode].returncode == 0, outs[mode][-3000:]
            assert "results written to" in outs[mode]
            metrics = rows(files[mode].parent)
            assert [r["round"] for r in metrics] == list(range(1, rounds + 1))
            assert sum(r["failures"] for r in metrics) >= 1  # rounds missed while it was down
            # Partition 1 trains again after the restart (same node id).
            assert metrics[-1]["clients"] == 2 and metrics[-1]["failures"] == 0, metrics
        disk, context = (rows(files[m].parent) for m in modes)
        assert [r["state_lost"] for r in disk] == [0] * rounds
        assert "lost its fedcdr state" not in outs["disk"]
        lost = [r["round"] for r in context if r["state_lost"]]
        assert len(lost) == 1 and lost[0] > at_kill["context"], context
        assert [r["state_lost"] for r in context if r["round"] != lost[0]] == [0] * (rounds - 1)
        assert "client 1 had lost its fedcdr state" in outs["context"]
        # ... and the client said so once, in the context run only.
        assert (dep.logs / "supernode-1.log").read_text().count("is gone (a SuperNode restart") == 1
        # The disk state lives under state-dir/run-<id>/client-<partition>, one
        # folder per version (docs/client-state.md); the last round's is pending.
        from fedaccel.clients.state import DiskState

        (run_dir,) = (tmp_path / "state").iterdir()
        for pid in (0, 1):
            store = DiskState(run_dir / f"client-{pid}")
            assert store.versions()[1] == rounds
            assert (run_dir / f"client-{pid}" / f"v{rounds}" / "dr.npz").is_file()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        dep.stop()
        assert dep.superlink is None and not dep.supernodes
