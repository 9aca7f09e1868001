"""Real networked clients on 127.0.0.1: a SuperLink with TLS and SuperNode
authentication, two SuperNodes, runs of FedAvg and FedCDR through them, a
refused client, and a SuperNode killed mid-run. Every process is stopped.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from fedaccel.deployment import LocalDeployment

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


@pytest.mark.parametrize("algo", ["fedavg", "fedcdr"])
def test_two_rounds_through_real_supernodes(deployment, algo):
    proc = deployment.run(f"algo='{algo}' num-server-rounds=2 run-name='{algo}' {SMALL}")
    out = proc.stdout + proc.stderr
    run_dir = deployment.results / algo
    assert proc.returncode == 0, out[-3000:]
    assert f"results written to {run_dir}" in out
    for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png", "final_model.npz"):
        assert (run_dir / name).is_file(), name
    metrics = rows(run_dir)
    assert [r["round"] for r in metrics] == [1, 2]
    assert all(r["clients"] == 2 and r["failures"] == 0 for r in metrics)
    assert metrics[-1]["accg"] > 0.2


def test_unregistered_key_and_wrong_ca_are_refused(deployment, tmp_path):
    # A key that was never registered.
    deployment.start_supernode(5, 2, key=deployment.key(5))
    # A CA that did not sign the SuperLink's certificate.
    import subprocess
    other = tmp_path / "other-ca"
    subprocess.run(["bash", "scripts/gen-certs.sh", str(other)], check=True, capture_output=True)
    deployment.register(6)
    deployment.start_supernode(6, 2, root_certificates=other / "ca.crt")
    try:
        time.sleep(8)
        listing = deployment.flwr("supernode", "list", "deployment", "--format", "json").stdout
        online = listing.count('"online"')
        assert online <= 2, listing  # only the two good SuperNodes are online
        log5 = (deployment.logs / "supernode-5.log").read_text()
        log6 = (deployment.logs / "supernode-6.log").read_text()
        assert "2004" in log5 or "not registered" in log5.lower() or "unauthenticated" in log5.lower(), log5[-2000:]
        assert "CERTIFICATE_VERIFY_FAILED" in log6 or "certificate" in log6.lower(), log6[-2000:]
    finally:
        for index in (5, 6):
            deployment._kill(deployment.supernodes.pop(index))


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
