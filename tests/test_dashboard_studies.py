"""Studies (fedaccel-sweep folders) in the dashboard: listed with their state
and cells, a study page with fedaccel-compare's table over seeds and each
group's mean curve, launched from a study file (checked as fedaccel-sweep
checks it, with its messages) and stopped (no cell starts any more; the
same study launched again runs the rest)."""

from __future__ import annotations

import json
import os
import statistics
import sys

import httpx
import pytest

from dashboard_helpers import POST, dead_pid, live_server, record_run, wait_for
from fedaccel.compare import group_by_seed, groups_table, load_runs
from fedaccel.sweep import main as sweep_main

TINY = """name: {name}
num-clients: 4
base:
  num-server-rounds: {rounds}
  clients-per-round: 2
  local-epochs: 1
  accl-every: 0
  synthetic.max-samples: 60
variants:
  - {{algo: fedavg}}
  - {{algo: fedprox, fedprox.mu: 0.1}}
seeds: {seeds}
"""


def study_file(tmp_path, name="tiny", rounds=2, seeds="[0, 1]", extra=""):
    path = tmp_path / f"{name}.yaml"
    path.write_text(TINY.format(name=name, rounds=rounds, seeds=seeds) + extra)
    return path


def study_row(client, study_id):
    return next(s for s in client.get("/api/studies").json()["studies"] if s["id"] == study_id)


def write_plan(folder, cells, pid, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    plan = {"num-clients": 4, "cells": {c: {"num-server-rounds": 3} for c in cells}, "current": cells,
            "study-file": None, "pid": pid, "host": os.uname().nodename, **extra}
    (folder / "plan.json").write_text(json.dumps(plan))


# ----------------------------------------------------------------- reading
@pytest.mark.slow  # a real study: the full suite
def test_a_finished_study_shows_the_table_over_seeds_of_fedaccel_compare(tmp_path, results, client):
    assert sweep_main([str(study_file(tmp_path)), "--results-dir", str(results / "sweeps"), "--workers", "1"]) == 0
    [row] = client.get("/api/studies").json()["studies"]
    assert (row["id"], row["state"], row["cells"], row["finished"]) == ("0/sweeps/tiny", "finished", 4, 4)

    page = client.get("/api/study/0/sweeps/tiny").json()
    cells = sorted((results / "sweeps" / "tiny" / "cells").iterdir())
    groups = group_by_seed(load_runs(cells))
    assert page["groups_table"] == [list(part) for part in json.loads(json.dumps(groups_table(groups)))]
    assert [len(r) for r in page["groups_table"][1]] == [8, 8]  # fedavg and fedprox, over seeds 0 and 1
    assert "report" in page and "comparison.md" in page["report"]
    # each group's curve is the mean and std over its seeds, round by round
    for series, group in zip(page["series"], groups):
        assert series["label"] == group.label and series["rounds"] == [1, 2]
        for i, rnd in enumerate(series["rounds"]):
            accs = [next(r["accg"] for r in run.rows if r["round"] == rnd) for run in group.runs]
            assert series["mean"][i] == pytest.approx(statistics.fmean(accs))
            assert series["std"][i] == pytest.approx(statistics.stdev(accs))
    # every cell links to its run page
    for cell in page["cell_rows"]:
        assert cell["state"] == "finished"
        assert client.get(f"/api/run/{cell['id']}").json()["name"] == cell["name"]


def test_study_states_from_its_process_and_cells(results, client):
    running = results / "sweeps" / "running"
    write_plan(running, ["a", "b"], os.getpid())
    record_run(running / "cells", "a", 3, [0.3, 0.4, 0.5])
    row = study_row(client, "0/sweeps/running")
    assert (row["state"], row["finished"], row["counts"]) == ("running", 1, {"finished": 1, "pending": 1})
    cells = client.get("/api/study/0/sweeps/running").json()["cell_rows"]
    assert [(c["name"], c["state"], c["id"]) for c in cells] == [
        ("a", "finished", "0/sweeps/running/cells/a"), ("b", "pending", None)]

    stopped = results / "sweeps" / "stopped"
    write_plan(stopped, ["a", "b"], dead_pid())
    record_run(stopped / "cells", "a", 3, [0.3], finish=False).fail("stopped by the user", state="stopped")
    assert study_row(client, "0/sweeps/stopped")["state"] == "stopped"

    killed = results / "sweeps" / "killed"
    write_plan(killed, ["a"], dead_pid())
    assert study_row(client, "0/sweeps/killed")["state"] == "interrupted"

    done = results / "sweeps" / "done"
    write_plan(done, ["a"], dead_pid())
    record_run(done / "cells", "a", 1, [0.5])
    assert study_row(client, "0/sweeps/done")["state"] == "finished"
    # launched here, its sweep refused to start (no plan): failed, with the console's error
    early = results / "sweeps" / "early"
    early.mkdir()
    (early / "sweep-launch.json").write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename,
                                                          "study-file": "/x/early.yaml"}))
    (early / "console.log").write_text("$ python -m fedaccel.sweep /x/early.yaml\nfedaccel-sweep: error: "
                                       "/x/early.yaml: no such study file\n")
    row = study_row(client, "0/sweeps/early")
    assert (row["state"], row["cells"], row["study_file"]) == ("failed", 0, "/x/early.yaml")
    assert row["error"] == "fedaccel-sweep: error: /x/early.yaml: no such study file"
    assert client.get("/api/study/0/sweeps/early").json()["error"] == row["error"]
    # a study's cells are runs too; a study id that escapes the roots is not a study
    assert any(r["id"] == "0/sweeps/done/cells/a" for r in client.get("/api/runs").json()["runs"])
    assert client.get("/api/study/0/../../etc").status_code == 404


# ---------------------------------------------------------------- launching
def sweep_error(capsys, path, results) -> str:
    assert sweep_main([str(path), "--results-dir", str(results / "sweeps"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    return err.removeprefix("fedaccel-sweep: error: ")


@pytest.mark.parametrize("case", ["invalid cell", "missing file", "bad key"])
def test_launch_refuses_a_study_with_the_messages_of_fedaccel_sweep(tmp_path, results, client, capsys, case):
    if case == "missing file":
        path = tmp_path / "nope.yaml"
    elif case == "bad key":
        path = tmp_path / "bad.yaml"
        path.write_text("name: bad\ngird: {lr: [0.1]}\n")
    else:
        path = study_file(tmp_path, extra="grid:\n  lr: [0.1, -1.0]\n")
    wanted = sweep_error(capsys, path, results)
    got = client.post("/api/study/validate", json={"file": str(path)}, headers=POST)
    assert got.status_code == 400 and got.json() == {"error": wanted, "key": "study"}
    assert client.post("/api/study/launch", json={"file": str(path)}, headers=POST).json()["error"] == wanted
    assert not (results / "sweeps" / "tiny").exists()
    bad_workers = client.post("/api/study/validate", json={"file": str(path), "workers": "0"}, headers=POST)
    assert bad_workers.json()["key"] == "workers"


def test_the_project_study_files_are_offered_and_valid(client):
    from fedaccel.local_run import project_dir

    listed = client.get("/api/studies").json()["files"]
    shipped = sorted((project_dir() / "configs" / "studies").glob("*.yaml"))
    assert [f["file"] for f in listed] == [str(p) for p in shipped] and len(shipped) >= 3
    fedprox_mu = next(f["file"] for f in listed if f["name"] == "configs/studies/fedprox-mu.yaml")
    checked = client.post("/api/study/validate", json={"file": fedprox_mu, "workers": 2}, headers=POST).json()
    assert checked["cells"] == 12 and checked["argv"][1:4] == ["-m", "fedaccel.sweep", fedprox_mu]
    assert checked["argv"][-2:] == ["--workers", "2"]


@pytest.mark.slow  # a fresh interpreter runs it
def test_launch_a_study_and_watch_it_finish(tmp_path, results):
    path = study_file(tmp_path, seeds="[0]")
    with live_server([results]) as base:
        started = httpx.post(f"{base}/api/study/launch", json={"file": str(path), "workers": 1}, headers=POST,
                             timeout=60).json()
        assert started["id"] == "0/sweeps/tiny" and started["argv"][0] == sys.executable

        def finished():
            rows = httpx.get(f"{base}/api/studies", timeout=30).json()["studies"]
            return next((s for s in rows if s["id"] == "0/sweeps/tiny" and s["state"] == "finished"), None)

        row = wait_for(finished, 120, "the launched study to finish")
        assert row["finished"] == row["cells"] == 2
        page = httpx.get(f"{base}/api/study/0/sweeps/tiny", timeout=30).json()
        assert any("report:" in line for line in page["log"])  # the sweep's console, captured
        assert len(page["groups_table"][1]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_stop_a_running_study_then_run_the_rest(tmp_path, results, workers):
    """Stopped mid-cell: the sweep exits, its running cells record stopped,
    no other cell starts; launched again, the study finishes every cell."""
    path = study_file(tmp_path, rounds=400, seeds="[0]")
    with live_server([results]) as base:
        httpx.post(f"{base}/api/study/launch", json={"file": str(path), "workers": workers}, headers=POST,
                   timeout=60).raise_for_status()
        cells = results / "sweeps" / "tiny" / "cells"

        def cell_rounds():
            runs = httpx.get(f"{base}/api/runs", timeout=30).json()["runs"]
            return [r for r in runs if r["id"].startswith("0/sweeps/tiny/cells/") and r["round"] >= 2]

        wait_for(cell_rounds, 120, "a cell to record rounds")
        stop = httpx.post(f"{base}/api/study/stop", json={"id": "0/sweeps/tiny"}, headers=POST, timeout=60)
        assert stop.json()["ok"], stop.text

        def ended():
            row = next(s for s in httpx.get(f"{base}/api/studies", timeout=30).json()["studies"]
                       if s["id"] == "0/sweeps/tiny")
            return row if row["state"] != "running" else None

        row = wait_for(ended, 60, "the study to stop")
        assert row["state"] == "stopped" and row["finished"] == 0, row
        states = {p.name: json.loads((p / "status.json").read_text())["state"] for p in cells.iterdir()
                  if (p / "status.json").is_file()}
        assert "stopped" in states.values() and "running" not in states.values(), states
        page = httpx.get(f"{base}/api/study/0/sweeps/tiny", timeout=30).json()
        assert "fedaccel-sweep: stopped (interrupt)" in "\n".join(page["log"])

        path.write_text(TINY.format(name="tiny", rounds=400, seeds="[0]").replace("400", "2"))
        # the study changed under no finished cell: launched again, it runs the rest
        httpx.post(f"{base}/api/study/launch", json={"file": str(path), "workers": workers}, headers=POST,
                   timeout=60).raise_for_status()
        wait_for(lambda: (r := next(s for s in httpx.get(f"{base}/api/studies", timeout=30).json()["studies"]
                                    if s["id"] == "0/sweeps/tiny"))["state"] == "finished" and r,
                 120, "the relaunched study to finish")


def test_a_reused_pid_is_not_the_study_process(results, client):
    """A plan naming a live pid with another start time (the sweep died, the
    pid now belongs to some other process) is not running: Stop has nothing
    to signal."""
    from fedaccel.processes import process_start

    folder = results / "sweeps" / "old"
    write_plan(folder, ["a"], os.getpid(), pid_start=(process_start(os.getpid()) or 0) + 1)
    assert study_row(client, "0/sweeps/old")["state"] == "interrupted"
    stop = client.post("/api/study/stop", json={"id": "0/sweeps/old"}, headers=POST)
    assert stop.status_code == 409 and "not running here" in stop.json()["error"]


def test_run_the_rest_uses_the_studys_own_file_and_folder(tmp_path, results, client):
    path = study_file(tmp_path)
    elsewhere = results / "elsewhere"
    assert sweep_main([str(path), "--results-dir", str(elsewhere), "--workers", "1", "--dry-run"]) == 0
    write_plan(elsewhere / "tiny", ["a"], dead_pid(), **{"study-file": str(path)})
    checked = client.post("/api/study/validate", json={"id": "0/elsewhere/tiny"}, headers=POST).json()
    assert checked["folder"] == str(elsewhere / "tiny") and checked["argv"][-2:] == ["--results-dir", str(elsewhere)]
    # the file now names another study: not run into this folder
    path.write_text(path.read_text().replace("name: tiny", "name: other"))
    refused = client.post("/api/study/validate", json={"id": "0/elsewhere/tiny"}, headers=POST).json()
    assert refused["error"].endswith("now names the study 'other', not 'tiny': launch it as a new study")
