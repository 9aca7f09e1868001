"""fedaccel-dashboard's endpoints: runs, a run's page, live events, compare,
the launch form (schema, validation, launch, stop) and its guards.

Real-browser tests are in test_dashboard_browser.py.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import httpx
import pytest

from dashboard_helpers import POST, dead_pid, live_server, record_run, run_state, set_status, wait_for
from fedaccel import compare
from fedaccel.local_run import default_run_config
from fedaccel.registry import algorithm_names, all_algorithms

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's note about httpx versions
    from fastapi.testclient import TestClient

from fedaccel.dashboard.app import create_app
from fedaccel.dashboard.schema import form_schema


def by_id(client, run_id):
    return next(r for r in client.get("/api/runs").json()["runs"] if r["id"] == run_id)


# ----------------------------------------------------------------- the runs
def test_runs_states_progress_and_eta(client, results):
    record_run(results, "done", 3, [0.4, 0.5, 0.6])
    live = record_run(results, "live", 10, [0.3, 0.4], finish=False)  # this process is its writer
    record_run(results, "killed", 10, [0.3], finish=False)
    set_status(results / "killed", pid=dead_pid())
    failed = record_run(results, "failed", 10, [0.3], finish=False)
    failed.fail("invalid run config: lr=-1: must be > 0")
    sweep_cell = results / "study" / "cells"
    record_run(sweep_cell, "cell-0", 2, [0.2, 0.3])

    done = by_id(client, "0/done")
    assert (done["state"], done["round"], done["rounds"], done["accuracy"]) == ("finished", 3, 3, 0.6)
    assert done["eta_seconds"] is None and done["seconds_per_round"] == 0.5
    running = by_id(client, "0/live")
    assert (running["state"], running["round"], running["rounds"]) == ("running", 2, 10)
    assert running["eta_seconds"] == pytest.approx(8 * 0.5)
    assert by_id(client, "0/killed")["state"] == "interrupted"
    bad = by_id(client, "0/failed")
    assert bad["state"] == "failed" and bad["error"] == "invalid run config: lr=-1: must be > 0"
    assert by_id(client, "0/study/cells/cell-0")["state"] == "finished"  # sweeps' cells are listed too
    live.close()


def test_run_page_has_rows_config_summary_and_log(client, results):
    record_run(results, "a", 3, [0.4, 0.5, 0.6], lr=0.1)
    page = client.get("/api/run/0/a").json()
    assert [r["round"] for r in page["rows"]] == [1, 2, 3]
    assert page["config"]["lr"] == 0.1
    assert page["summary"]["final_accg"] == 0.6
    assert page["cumulative_mb"] == pytest.approx([0.003, 0.007, 0.012])
    assert page["log"][-1].startswith("[fedaccel] round 3/3  accg 0.6000")  # as fedaccel-run prints it


@pytest.mark.parametrize("run_id", ["0/nope", "1/a", "0/../a", "x/a", "0/", "0/a/../../results/a"])
def test_unknown_or_escaping_run_ids_are_404(client, results, run_id):
    record_run(results, "a", 1, [0.4])
    response = client.get(f"/api/run/{run_id}")
    assert response.status_code == 404 and "no run" in response.json()["error"]


def test_events_push_a_new_round_without_a_reload(results):
    rec = record_run(results, "live", 5, [0.3], finish=False)
    with live_server([results]) as base:
        with httpx.stream("GET", f"{base}/api/events", timeout=30) as stream:
            events = stream.iter_lines()

            def next_runs():
                kind = None
                for line in events:
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: ") and kind == "runs":  # (a "studies" event follows each)
                        return {r["id"]: r for r in json.loads(line[6:])}

            assert next_runs()["0/live"]["round"] == 1
            rec.log_round({"round": 2, "accg": 0.45})
            assert next_runs()["0/live"]["round"] == 2
    rec.close()


# ------------------------------------------------------------------ compare
@pytest.mark.slow  # a whole run behind the dashboard: the full suite
def test_compare_tables_are_fedaccel_compares(client, results, tmp_path):
    for seed, accs in ((0, [0.4, 0.6]), (1, [0.5, 0.7])):
        record_run(results, f"avg-{seed}", 2, accs, seed=seed)
    record_run(results, "prox-0", 2, [0.3, 0.65], algo="fedprox")
    ids = ["0/avg-0", "0/avg-1", "0/prox-0"]
    got = client.post("/api/compare", json={"ids": ids, "group_seeds": True}, headers=POST).json()
    runs = compare.load_runs([results / "avg-0", results / "avg-1", results / "prox-0"])
    compare.assign_run_labels(runs, None)
    assert got["runs_table"] == [list(x) for x in compare.runs_table(runs)]
    header, rows = got["groups_table"]
    assert [row[:3] for row in rows] == [["fedavg", "fedavg", "2"], ["fedprox", "fedprox", "1"]]
    assert rows[0][3] == "65.00 ± 7.07"  # final accuracy, mean ± std over the two seeds
    markdown = compare.compare_runs([results / i.split("/")[1] for i in ids], tmp_path / "cmp", group_seeds=True)
    assert "| " + " | ".join(rows[0]) + " |" in markdown  # the CLI prints the same cells
    assert [s["label"] for s in got["series"]] == ["fedavg (avg-0)", "fedavg (avg-1)", "fedprox"]
    bad = client.post("/api/compare", json={"ids": ["0/none"]}, headers=POST)
    assert bad.status_code == 400 and "pick one or more" in bad.json()["error"]


def test_the_compare_view_counts_a_seed_once_and_says_who_is_left_out_of_the_groups(client, results):
    """The grouped view is fedaccel-compare's: a second run of seed 0 is set
    aside and a failed run joins no group, each named in the note; the
    failed run is still in the runs table, marked."""
    for name, seed, accs in (("avg-0", 0, [0.4, 0.6]), ("avg-1", 1, [0.5, 0.7]), ("avg-0-again", 0, [0.4, 0.6])):
        record_run(results, name, 2, accs, seed=seed)
    record_run(results, "avg-2", 4, [0.3, 0.5], seed=2, finish=False)
    set_status(results / "avg-2", state="failed", error="every client failed")
    got = client.post("/api/compare", json={"ids": ["0/avg-0", "0/avg-1", "0/avg-0-again", "0/avg-2"],
                                            "group_seeds": True}, headers=POST).json()
    _, rows = got["groups_table"]
    assert [row[:3] for row in rows] == [["fedavg", "fedavg", "2"]]  # seeds 0 and 1, each once
    assert "set aside" in got["note"] and "avg-0-again" in got["note"]
    assert "not in any group" in got["note"] and "avg-2 (failed, round 2 of 4)" in got["note"]
    assert any("avg-2 [failed, round 2 of 4]" in " ".join(row) for row in got["runs_table"][1])


# -------------------------------------------------------------- launch form
def test_form_schema_is_every_key_with_registry_choices_and_docs_help():
    schema = form_schema()
    fields = {f["key"]: f for f in schema["fields"]}
    assert set(fields) == set(default_run_config()) - {"results-dir", "resume"}
    assert fields["algo"]["choices"] == list(algorithm_names())
    assert fields["dataset"]["kind"] == "choice" and "fashion-mnist" in fields["dataset"]["choices"]
    assert (fields["lr"]["kind"], fields["lr"]["default"]) == ("float", 0.05)
    assert (fields["num-server-rounds"]["kind"], fields["synthetic.iid"]["kind"]) == ("int", "bool")
    assert "learning rate" in fields["lr"]["help"]
    for name, spec in all_algorithms().items():
        own = [k for k, f in fields.items() if f["group"] == f"algo:{spec.prefix}"]
        assert all(k.startswith(spec.prefix + ".") for k in own), name
    assert fields["fedprox.mu"]["group"] == "algo:fedprox" and fields["gc.mode"]["group"] == "gc"


def cli_error(capsys, *tokens: str) -> str:
    """fedaccel-run's one error line for ``tokens`` (a config error, exit 2,
    or a data error, exit 3)."""
    from fedaccel.local_run import main

    assert main(list(tokens)) in (2, 3)
    return capsys.readouterr().err.strip().removeprefix("fedaccel-run: error: ")


@pytest.mark.parametrize("values, key, cli", [
    ({"lr": "-1"}, "lr", ["lr=-1"]),
    ({"clients-per-round": "2.0"}, "clients-per-round", ["clients-per-round=2.0"]),
    ({"algo": "fedavg", "fedprox.mu": "0.5"}, "fedprox.mu", ["fedprox.mu=0.5"]),
    ({"algo": "fedavgg"}, "algo", ["algo='fedavgg'"]),
    ({"lrr": "0.1"}, "lrr", ["lrr=0.1"]),
    ({"clients-per-round": "50"}, "clients-per-round", ["clients-per-round=50"]),
    ({"num-server-rounds": "ten"}, "num-server-rounds", ["num-server-rounds=ten"]),
    ({"logical-clients": "8", "clients-per-round": "30"}, "clients-per-round",
     ["logical-clients=8", "clients-per-round=30"]),
    ({"cohort-batching": "on", "algo": "fedpm", "fedpm.refresh-every": "1"}, "cohort-batching",
     ["cohort-batching='on'", "algo='fedpm'", "fedpm.refresh-every=1", "--check"]),
    # Check also loads the data and builds the model, as --check does
    ({"model": "cnn"}, "model", ["model='cnn'", "--check"]),
    ({"dataset": "mnist", "data-dir": "/nonexistent/fedaccel-data"}, "data-dir",
     ["dataset='mnist'", "data-dir='/nonexistent/fedaccel-data'", "--check"]),
    ({"dataset": "digits", "partition": "label-sorted"}, "num_clients",
     ["dataset='digits'", "partition='label-sorted'", "--num-clients", "100", "--check"]),
    ({"dataset": "digits"}, "num_clients", ["dataset='digits'", "--num-clients", "1500", "--check"]),
])
def test_invalid_values_get_fedaccel_runs_message(client, capsys, values, key, cli):
    body = {"values": values}
    if "--num-clients" in cli:  # the form's clients field
        body["num_clients"] = int(cli[cli.index("--num-clients") + 1])
    response = client.post("/api/validate", json=body, headers=POST)
    assert response.status_code == 400
    assert response.json() == {"error": cli_error(capsys, *cli), "key": key}


@pytest.mark.parametrize("values, key, wanted", [
    ({"cohort-batching": "on"}, "cohort-batching", "batched cohorts run in the fast runner"),
    ({"algo": "scaffold", "checkpoint-every": "5"}, "checkpoint-every", "algo='scaffold'"),
    ({"cohort-batching": "on", "logical-clients": "4", "algo": "fedpm", "fedpm.refresh-every": "1"},
     "cohort-batching", "cannot be batched: fedpm.refresh-every=1"),
    ({"logical-clients": "8", "clients-per-round": "30"}, "clients-per-round", "exceeds the 8 logical clients"),
])
def test_a_flwr_run_form_is_refused_as_its_server_would_before_asking_a_node(client, values, key, wanted):
    """With the Flower engine the form gets the lines a flwr run's server
    gives from the config alone (refuse_on_flower, refuse_unbatchable)."""
    response = client.post("/api/validate", json={"values": values, "engine": "flower"}, headers=POST)
    assert response.status_code == 400
    got = response.json()
    assert got["key"] == key and wanted in got["error"]


def test_valid_form_gives_the_command_as_an_argument_list(client, results):
    values = {"algo": "fedprox", "fedprox.mu": "0.5", "lr": "0.05", "momentum": "0",
              "run-name": "a b; rm -rf x", "synthetic.iid": False}
    got = client.post("/api/validate", json={"values": values, "num_clients": 12}, headers=POST).json()
    assert got["overrides"] == {"algo": "fedprox", "fedprox.mu": 0.5, "run-name": "a b; rm -rf x"}
    assert got["argv"] == [sys.executable, "-m", "fedaccel.local_run", 'algo="fedprox"', "fedprox.mu=0.5",
                           'run-name="a b; rm -rf x"', f'results-dir="{results}"', "--num-clients", "12"]
    flower = client.post("/api/validate", json={"values": {"algo": "fedcdr"}, "engine": "flower",
                                                "connection": "no-such"}, headers=POST).json()
    assert flower["key"] == "connection" and "fedaccel-federations install" in flower["error"]
    clash = client.post("/api/validate", json={"values": {"results-dir": "/tmp"}}, headers=POST).json()
    assert clash["key"] == "results-dir"


@pytest.mark.slow  # a fresh interpreter runs it
def test_launch_runs_it_and_the_runs_list_follows_it_to_the_end(results):
    with live_server([results]) as base:
        body = {"values": {"num-server-rounds": "3", "clients-per-round": "4", "run-name": "launched"},
                "num_clients": 8}
        launched = httpx.post(f"{base}/api/launch", json=body, headers=POST, timeout=30).json()
        assert launched["id"] == "0/launched"
        assert run_state(base, "0/launched")["state"] in ("starting", "running", "finished")
        done = wait_for(lambda: (r := run_state(base, "0/launched")) and r["state"] == "finished" and r,
                        120, "the launched run to finish")
        assert (done["round"], done["rounds"]) == (3, 3)
        config = json.loads((results / "launched" / "config.json").read_text())
        assert (config["clients-per-round"], config["resolved"]["num-clients"]) == (4, 8)
        console = (results / "launched" / "console.log").read_text()
        assert "[fedaccel] round 3/3" in console and "results written to" in console
        again = httpx.post(f"{base}/api/launch", json=body, headers=POST, timeout=30).json()
        assert again["key"] == "run-name" and "exists already" in again["error"]


@pytest.mark.slow  # a fresh interpreter runs it
def test_stop_ends_a_fast_run_and_both_sides_say_stopped(results, sigint_ignored):
    # the dashboard runs as a script's background job would (SIGINT ignored, which its
    # launches inherit): the stop button must stop them all the same
    with live_server([results]) as base:
        body = {"values": {"num-server-rounds": "500", "run-name": "long"}, "num_clients": 10}
        httpx.post(f"{base}/api/launch", json=body, headers=POST, timeout=30).raise_for_status()
        wait_for(lambda: (r := run_state(base, "0/long")) and r["state"] == "running" and r["round"] >= 1,
                 120, "the run's first round")
        stop = httpx.post(f"{base}/api/stop", json={"id": "0/long"}, headers=POST, timeout=30).json()
        assert stop["ok"] and "SIGINT" in stop["message"]
        final = wait_for(lambda: (r := run_state(base, "0/long")) and r["state"] == "stopped" and r,
                         60, "the run to stop")
        status = json.loads((results / "long" / "status.json").read_text())
        rows = (results / "long" / "metrics.jsonl").read_text().splitlines()
        assert status["state"] == "stopped" and status["round"] == len(rows) == final["round"] < 500
        assert "fedaccel-run: stopped" in (results / "long" / "console.log").read_text()
        again = httpx.post(f"{base}/api/stop", json={"id": "0/long"}, headers=POST, timeout=30)
        assert again.status_code == 409 and "not running (it is stopped)" in again.json()["error"]


@pytest.mark.slow  # a whole run behind the dashboard: the full suite
def test_a_launch_that_fails_at_once_is_listed_with_its_error(client, results, monkeypatch):
    # the data folder disappears between validation and start: the run's own error shows
    values = {"dataset": "fashion-mnist", "data-dir": str(results / "missing"), "run-name": "nodata",
              "num-server-rounds": "1"}
    response = client.post("/api/launch", json={"values": values}, headers=POST)
    assert response.status_code == 200, response.json()
    client.app.state.launcher.launched[(results / "nodata").resolve()].process.wait(timeout=120)
    run = by_id(client, "0/nodata")
    assert run["state"] == "failed" and "missing" in run["error"], run


# ------------------------------------------------------------------- guards
def test_posts_need_the_header_hosts_are_checked_and_a_token_is_enforced(results):
    plain = TestClient(create_app([results]))
    assert plain.post("/api/validate", json={}).status_code == 403
    assert plain.get("/api/runs", headers={"host": "evil.example:8765"}).status_code == 403
    guarded = TestClient(create_app([results], token="s3cret"))
    assert guarded.get("/api/runs").status_code == 401
    assert guarded.get("/api/runs", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get("/?token=s3cret").status_code == 200  # sets the cookie
    assert guarded.get("/api/runs").status_code == 200


def test_static_assets_are_served_from_the_package(client):
    page = client.get("/").text
    assert "/static/plotly.min.js" in page and "http" not in page.replace("http-equiv", "")  # no CDN
    assert client.get("/static/plotly.min.js").content.startswith(b"/**")
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/../app.py").status_code == 404


def test_flower_listing_never_starts_a_superlink(client, monkeypatch):
    monkeypatch.setattr("fedaccel.dashboard.flower_runs.local_superlink_pids", lambda: [])
    got = client.get("/api/flower", params={"connection": "local-simulation"}).json()
    assert got["runs"] == [] and "no local SuperLink is running" in got["note"]
    unknown = client.get("/api/flower", params={"connection": "no-such-connection"}).json()
    assert unknown["runs"] == [] and unknown["error"]


def test_cli_refuses_a_file_as_results_folder(tmp_path, capsys):
    from fedaccel.dashboard.cli import main

    (tmp_path / "f").write_text("x")
    assert main([str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file" in err[0]


def test_stop_of_a_run_on_no_process_is_refused(client, results):
    record_run(results, "done", 1, [0.5])
    response = client.post("/api/stop", json={"id": "0/done"}, headers=POST)
    assert response.status_code == 409 and "not running" in response.json()["error"]
    assert os.path.exists(results / "done" / "summary.json")
