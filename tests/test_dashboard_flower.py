"""The dashboard launching, listing and stopping runs on Flower's simulation.

A private local SuperLink (its own FLWR_HOME and ports), stopped at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from dashboard_helpers import POST, live_server, run_state, wait_for
from fedaccel.superlink import local_superlink_pids, stop_local_superlink

# a Flower simulation run end to end (~50 s): with the engine matrix (CI's second step),
# keeping plain `pytest` under its 12-minute budget
pytestmark = [pytest.mark.slow, pytest.mark.engine_matrix]

CONTROL_PORT = "39393"
SMALL = {"synthetic.max-samples": "120", "local-epochs": "1", "clients-per-round": "3", "accl-every": "0"}


@pytest.fixture(scope="module")
def flower_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    env = {"FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39391",
           "FLWR_LOCAL_CONTROL_API_PORT": CONTROL_PORT,
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)  # the dashboard's children (flwr run, flwr stop) inherit them
    subprocess.run([sys.executable, "-m", "fedaccel.federations", "install"], check=True, capture_output=True)
    yield home
    stop_local_superlink(CONTROL_PORT)
    mp.undo()
    assert local_superlink_pids(CONTROL_PORT) == []


def test_launch_on_flower_list_it_from_the_control_api_and_stop_it(flower_home, tmp_path):
    results = tmp_path / "results"
    with live_server([results]) as base:
        schema = httpx.get(f"{base}/api/schema", timeout=30).json()
        assert schema["default_connection"] == "local-simulation"
        body = {"values": {**SMALL, "num-server-rounds": "2", "run-name": "on-flower"}, "engine": "flower"}
        launched = httpx.post(f"{base}/api/launch", json=body, headers=POST, timeout=30).json()
        assert launched["argv"][1:4] == ["run", launched["argv"][2], "local-simulation"]
        done = wait_for(lambda: (r := run_state(base, "0/on-flower")) and r["state"] in ("finished", "failed") and r,
                        300, "the Flower run to finish")
        assert done["state"] == "finished", (results / "on-flower" / "console.log").read_text()[-2000:]
        status = json.loads((results / "on-flower" / "status.json").read_text())
        assert status["engine"] == "flower" and isinstance(status["run_id"], int)
        listed = httpx.get(f"{base}/api/flower", timeout=60).json()
        assert str(status["run_id"]) in [r["run-id"] for r in listed["runs"]], listed

        long = {"values": {**SMALL, "num-server-rounds": "500", "run-name": "long-flower"}, "engine": "flower"}
        httpx.post(f"{base}/api/launch", json=long, headers=POST, timeout=30).raise_for_status()
        wait_for(lambda: (r := run_state(base, "0/long-flower")) and r["round"] >= 1, 300, "its first round")
        stop = httpx.post(f"{base}/api/stop", json={"id": "0/long-flower"}, headers=POST, timeout=90).json()
        assert stop.get("ok"), stop
        run_id = json.loads((results / "long-flower" / "status.json").read_text())["run_id"]

        def flower_says_finished():
            runs = httpx.get(f"{base}/api/flower", timeout=60).json()["runs"]
            return next((r["status"] for r in runs if r["run-id"] == str(run_id) and "finished" in r["status"]), None)

        wait_for(flower_says_finished, 120, "Flower to list the run as finished")
        # its ServerApp process ends a moment after Flower lists the run as finished
        final = wait_for(lambda: (r := run_state(base, "0/long-flower")) and r["state"] != "running" and r,
                         60, "the run's ServerApp to end")
        assert final["state"] == "stopped" and final["round"] < 500
