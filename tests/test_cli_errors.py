"""Every mistake a user can make on the fast runner's command line gets one
plain line on stderr and the documented exit code (``fedaccel-run --help``):
2 for the command or the config, 3 for the machine or the data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedaccel.config import ConfigError

from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse, main

SMALL = ["num-server-rounds=1", "clients-per-round=2", "local-epochs=1", "accl-every=0",
         "synthetic.max-samples=60", "--num-clients", "3"]
# for any dataset (a synthetic.* key with another one is refused), without --num-clients
SMALL_ANY_DATA = SMALL[:-3]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fedaccel-run: error: ") and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("args,code,wanted", [
    (["algo='fedprx'"], 2, "algo='fedprx': allowed: fedacg"),
    (["algo='fedprx'"], 2, "(did you mean 'fedprox'?)"),
    (["lerning-rate=0.1"], 2, "unknown run-config key(s) lerning-rate"),
    (["lr"], 2, "expected key=value, got 'lr'"),
    (["--run-config", "algo='fedavg' lr"], 2, "--run-config: 'lr' is not key=value"),
    (["--run-config", "algo=fedavg"], 2, "algo=fedavg is not a TOML value: quote strings (algo='fedavg')"),
    (["--run-config", "algo='fedavg"], 2, "--run-config: "),
    (["clients-per-round=2.0"], 2, "a float is a fraction of the clients and must be in (0, 1]; for a "
                                   "count of clients write a whole number without a decimal point (e.g. 2)"),
    (["clients-per-round=0"], 2, "an integer is a count of clients and must be >= 1"),
    (["cohort-batching='sometimes'"], 2, "cohort-batching='sometimes': allowed: auto, on, off"),
    (["cohort-chunk=-1"], 2, "cohort-chunk=-1: must be an integer >= 0"),
    (["cohort-chunk=2", "cohort-batching='off'"], 2,
     "cohort-chunk=2: sizes the chunks of a batched cohort, which this run does not train (cohort-batching='off')"),
    (["logical-clients=-4"], 2, "logical-clients=-4: must be an integer >= 0"),
    (["--num-clients", "20", "logical-clients=8", "clients-per-round=10"], 2,
     "clients-per-round=10: exceeds the 8 logical clients the cohort nodes serve; use at most 8, or raise "
     "logical-clients"),
    (["logical-clients=1.5"], 2, "logical-clients=1.5: must be an integer >= 0"),
    (["precision='float16'"], 2, "precision='float16': allowed: float32, float64"),
    (["tf32='yes'"], 2, "tf32='yes': must be true or false"),
    (["init-noise=0.3"], 2, "init-noise=0.3: is the noise of init='near-optimum', which this run does not use"),
    (["init='near-optimum'"], 2, "init='near-optimum': needs a strongly convex problem, whose optimum is unique: "
                                 "model='logreg' with weight-decay > 0 (this run: model='mlp', weight-decay=0.0)"),
    (["optimality=true", "model='logreg'"], 2, "optimality=true: needs a strongly convex problem, whose optimum is unique: "
                                               "model='logreg' with weight-decay > 0 (this run: model='logreg', "
                                               "weight-decay=0.0)"),
    (["algo='fedavg'", "fedprox.mu=0.5"], 2,
     "fedprox.mu=0.5: is a hyperparameter of algo='fedprox', which this run does not use (algo='fedavg')"),
    (["--config", "/nonexistent/study.yaml"], 2, "--config /nonexistent/study.yaml: no such file"),
    (["--run-config", "momentum=.9"], 2, "--run-config: momentum=.9 is not a TOML value: write a number with a "
                                         "digit on each side of its point (momentum=0.9), and quote a string "
                                         "(momentum='.9')"),
    (["--run-config", "run-name=.5"], 2, "and quote a string (run-name='.5')"),
    (["--run-config", "name=x"], 2, "--run-config: name=x is not a TOML value: quote strings (name='x')"),
    (["lr=.1"], 2, "lr='.1': must be a finite number; '.1' was read as text: write the number as 0.1, without "
                   "quotes and with a digit on each side of any point"),
    (["algo='fedprox'", "fedprox.mu='1.'"], 2, "fedprox.mu='1.': must be a finite number; '1.' was read as text: "
                                               "write the number as 1,"),
    (["clients-per-round=2."], 2, "'2.' was read as text: write the number as 2,"),  # 2.0 would be a fraction
    (["seed='3'"], 2, "seed='3': must be an integer >= 0; '3' was read as text: write the number as 3,"),
    (["lr='1e39'"], 2, "lr='1e39': must be a finite number of at most 3.403e+38 in magnitude (a float32)"),
    (["lr='fast'"], 2, "lr='fast': must be a finite number"),
    (["dirichlet-alpha=0.1"], 2, "dirichlet-alpha=0.1: draws the split of partition='dirichlet', "
                                 "'dirichlet-unbalanced' or 'label-sorted', which this run does not use (its "
                                 "partition is 'natural'); dataset='synthetic' is generated client by client"),
    (["dataset='digits'", "partition='iid'", "dirichlet-alpha=0.1"], 2,
     "dirichlet-alpha=0.1: draws the split of partition='dirichlet', 'dirichlet-unbalanced' or 'label-sorted', "
     "which this run does not use (its partition is 'iid'): remove it, or set partition='dirichlet'"),
    (["dataset='digits'", "synthetic.alpha=0.5"], 2,
     "synthetic.alpha=0.5: sets the generated data of dataset='synthetic', which this run does not use "
     "(dataset='digits'): remove it, or set dataset='synthetic'"),
    (["dataset='breast-cancer'", "synthetic.iid=true"], 2, "synthetic.iid=true: sets the generated data"),
    (["tracker-uri='runs/tb'"], 2, "tracker-uri='runs/tb': is where tracker='tensorboard' or 'mlflow' writes, "
                                   "and this run has tracker='none': remove it, or set tracker='tensorboard' or "
                                   "'mlflow'"),
    (["partition='iid'", "dirichlet-alpha=0.1"], 3,  # the partition synthetic lacks, not the alpha it ignores
     "partition='iid' is not available for dataset 'synthetic'"),
    (["algo='feddc'", "feddc.alpha=0"], 2, "feddc.alpha=0.0: must be > 0"),
    (["algo='feddc'", "feddc.cv-update='bogus'"], 2, "feddc.cv-update='bogus': allowed: mean-gradient, option-ii"),
    (["algo='scaffold'", "scaffold.cv-update='bogus'"], 2,
     "scaffold.cv-update='bogus': allowed: mean-gradient, option-ii"),
    (["synthetic.shared-model='yes'"], 2, "synthetic.shared-model='yes': must be true or false"),
    (["synthetic.shared-model=true", "synthetic.iid=true"], 2,
     "synthetic.shared-model=true: applies to the non-IID generator only"),
    # numbers beyond what the run's tensors and sizes hold (each was a traceback from deep inside)
    (["lr=1e308"], 2, "lr=1e+308: must be a finite number of at most 3.403e+38 in magnitude (a float32)"),
    (["algo='fedprox'", "fedprox.mu=1e308"], 2, "fedprox.mu=1e+308: must be a finite number of at most 3.403e+38"),
    (["seed=99999999999999999999"], 2, "seed=99999999999999999999: must be an integer in [0, 9223372036854775807]"),
    (["logical-clients=1e308"], 2, "logical-clients=1e+308: must be an integer in [0, 2147483647]"),
    (["local-epochs=99999999999999999999"], 2, "local-epochs=99999999999999999999: must be an integer in [1, "),
    (["algo='fedpm'", "fedpm.foof-samples=99999999999999999999"], 2, "must be at most 2147483647 in magnitude"),
    (["algo='fedcdr'", "fedcdr.eta=1e-300"], 2, "fedcdr.eta=1e-300: must be > 0 and at least 2.94e-39"),
    (["synthetic.alpha=3e38"], 2, "synthetic.alpha=3e+38: must be at most 1000"),
    (["run-name=\"a\\u0000b\""], 2, "run-name='a\\x00b': must not contain a NUL character"),
    # settings that would run and silently do nothing
    (["straggler-fraction=0.9", "straggler-policy='drop'"], 2,
     "straggler-fraction=0.9: with straggler-policy='drop' every client of a round of 2 is a straggler"),
    (["gc.mode='hybrid'", "gc.global-layers='fc,nope'"], 2,
     "gc.global-layers='fc,nope': 'nope' is no layer of this model (its layers: fc1, fc)"),
])
def test_config_mistakes_get_one_line_and_exit_2(tmp_path, capsys, args, code, wanted):
    got, out, err = run_cli(capsys, f"results-dir='{tmp_path}'", *SMALL, *args)
    assert got == code
    assert wanted in one_error_line(err)
    assert not any(tmp_path.iterdir())  # refused before any work


def test_yaml_on_and_off_are_strings_as_in_yaml_1_2(tmp_path, capsys):
    """YAML 1.1 (PyYAML's default) reads on/off/yes/no as booleans, which
    made ``cohort-batching: on`` a refused true; a config file reads them
    as the strings they are in YAML 1.2, true/false stay booleans."""
    study = tmp_path / "on.yaml"
    study.write_text("cohort-batching: on\nlogical-clients: 4\ntf32: false\n")
    code, out, _ = run_cli(capsys, "--config", str(study), "--check", *SMALL)
    assert code == 0 and "cohort-batching='on'" in out
    study.write_text("tf32: yes\n")
    code, _, err = run_cli(capsys, "--config", str(study), "--check", *SMALL)
    assert code == 2 and "tf32='yes': must be true or false" in one_error_line(err)


@pytest.mark.parametrize("text,wanted", [
    ("algo: [fedavg\n", "not valid YAML at line 2, column 1"),
    ("- algo\n- lr\n", "must hold a mapping of run-config keys (key: value lines), not a list"),
    ("algo: fedavg\n\tlr: 0.1\n", "not valid YAML at line 2"),
    ("run-name: 2024-01-01\n", "run-name=datetime.date(2024, 1, 1) is not a number, true/false or a string"),
    ("run-name: null\n", "run-name=None is not a number, true/false or a string"),
    ("fedprox:\n  mu: [1]\n", "fedprox.mu=[1] is not a number, true/false or a string"),
    ("1: 3\n", "key 1 is not a string"),
    (b"\xff\xfelr: 1\n", "not a UTF-8 text file"),
])
def test_malformed_yaml_files(tmp_path, capsys, text, wanted):
    study = tmp_path / "study.yaml"
    study.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = run_cli(capsys, "--config", str(study), f"results-dir='{tmp_path / 'out'}'", *SMALL)
    assert code == 2 and wanted in one_error_line(err)
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("text,wanted", [("lr = [0.1]\n", "lr=[0.1] is not a number, true/false or a string"),
                                         (b"\xff\xfelr = 1\n", "not a UTF-8 text file")])
def test_malformed_run_config_toml_files(tmp_path, capsys, text, wanted):
    toml = tmp_path / "run.toml"
    toml.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = run_cli(capsys, "--run-config", str(toml), f"results-dir='{tmp_path / 'out'}'", *SMALL)
    assert code == 2 and wanted in one_error_line(err)


@pytest.mark.parametrize("key", ["run-name", "results-dir", "state-dir"])
def test_a_path_too_long_for_the_file_system_is_exit_3_in_one_line(tmp_path, capsys, key):
    """A run name or folder longer than a file name may be (255 bytes): one
    line naming the key, exit 3, not an OSError traceback."""
    long = "x" * 300
    value = long if key == "run-name" else str(tmp_path / long)
    stateful = ["algo='scaffold'", "client-state='disk'"] if key == "state-dir" else []
    code, _, err = run_cli(capsys, f"results-dir='{tmp_path / 'out'}'", *SMALL, *stateful, f"{key}='{value}'")
    line = one_error_line(err)
    assert code == 3 and key in line and ("path is too long" in line or "cannot make" in line), line


@pytest.mark.parametrize("args,wanted", [
    (["dataset='digits'", "--num-clients", "5000"],
     "num-clients=5000 exceeds the 1437 training samples of 'digits'; use at most 1437 clients"),
    (["dataset='digits'", "--num-clients", "2", "logical-clients=2000"],
     "logical-clients=2000 exceeds the 1437 training samples of 'digits'; use at most 1437 clients"),
    (["dataset='breast-cancer'", "partition='label-sorted'", "--num-clients", "400"],
     "partition='label-sorted' leaves 371 of the 400 clients of 'breast-cancer' without samples"),
])
@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_data_refused_after_the_run_folder_exists_leaves_no_folder(tmp_path, capsys, args, wanted):
    """A data error is found once the run folder exists (the server loads the
    data after checking that the folder can be written): exit 3, one line,
    and the empty run folder is removed again."""
    code, _, err = run_cli(capsys, f"results-dir='{tmp_path}'", *SMALL_ANY_DATA, *args)
    assert code == 3 and wanted in one_error_line(err)
    assert not any(tmp_path.iterdir())


def test_a_refused_run_leaves_an_existing_run_folder_alone(tmp_path, capsys):
    """``run-name`` naming a folder that already holds files: a refused run
    removes nothing of it."""
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    code, _, _ = run_cli(capsys, f"results-dir='{tmp_path}'", "run-name='mine'", "dataset='digits'",
                         *SMALL_ANY_DATA, "--num-clients", "5000")
    assert code == 3 and [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_results_dir_that_is_a_file_is_exit_3(tmp_path, capsys):
    blocker = tmp_path / "results"
    blocker.write_text("not a folder")
    code, _, err = run_cli(capsys, f"results-dir='{blocker}'", *SMALL)
    line = one_error_line(err)
    assert code == 3 and f"results-dir='{blocker}': cannot write the run folder" in line
    assert "set results-dir to a writable folder" in line
    assert blocker.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [blocker]


@pytest.mark.parametrize("where", ["state-dir", "env"])
def test_a_state_dir_that_cannot_be_made_is_exit_3_in_one_line(tmp_path, capsys, monkeypatch, where):
    """A client-state folder in the way of a file: one line naming
    state-dir, exit 3, as for results-dir (not a NotADirectoryError from
    deep inside); a stateless run, or one whose state lives in the
    clients' Contexts, does not touch it."""
    blocker = tmp_path / "state"
    blocker.write_text("not a folder")
    state = [f"state-dir='{blocker}'"] if where == "state-dir" else []
    if where == "env":
        monkeypatch.setenv("FEDACCEL_STATE_DIR", str(blocker))
    results = f"results-dir='{tmp_path / 'results'}'"
    code, _, err = run_cli(capsys, results, "algo='scaffold'", "client-state='disk'", *state, *SMALL)
    line = one_error_line(err)
    assert code == 3 and line.startswith("fedaccel-run: error: state-dir: cannot make the client-state folder")
    assert "(Not a directory); set state-dir (or the FEDACCEL_STATE_DIR environment variable" in line
    for algo, kept in (("fedavg", "disk"), ("scaffold", "context")):
        code, _, _ = run_cli(capsys, results, f"algo='{algo}'", f"client-state='{kept}'", *state, *SMALL)
        assert code == 0
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_results_dir_is_exit_3(tmp_path, capsys):  # pragma: no cover - CI runs as root
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_cli(capsys, f"results-dir='{locked}'", *SMALL)
    finally:
        locked.chmod(0o700)
    assert code == 3 and "Permission denied" in one_error_line(err)


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's sysfs")
def test_a_results_dir_no_process_may_create_is_exit_3(capsys):
    """What the read-only test above checks for a user, checked as root too
    (CI runs as root, which writes into read-only folders): sysfs refuses a
    new folder to every process."""
    target = Path("/sys/fedaccel-results")
    code, _, err = run_cli(capsys, f"results-dir='{target}'", *SMALL)
    line = one_error_line(err)
    assert code == 3 and f"results-dir='{target}': cannot write the run folder" in line
    assert "set results-dir to a writable folder" in line
    assert not target.exists()


def test_other_algorithms_defaults_are_not_refused():
    """The run config always holds every algorithm's keys; at their defaults they are fine."""
    cfg = fuse(default_run_config(), {"algo": "fedavg", "fedprox.mu": default_run_config()["fedprox.mu"]})
    assert parse_run_config(cfg).algo == "fedavg"
    with pytest.raises(ConfigError, match="feddyn.alpha=0.01: is a hyperparameter of algo='feddyn'"):
        parse_run_config(fuse(default_run_config(), {"algo": "fedprox", "feddyn.alpha": 0.01}))


def test_clients_per_round_int_is_a_count_float_a_fraction():
    base = default_run_config()
    assert parse_run_config(fuse(base, {"clients-per-round": 1})).cohort_size(10) == 1
    assert parse_run_config(fuse(base, {"clients-per-round": 1.0})).cohort_size(10) == 10
    assert parse_run_config(fuse(base, {"clients-per-round": 0.25})).cohort_size(10) == 2  # round(2.5) = 2
    assert parse_run_config(fuse(base, {"clients-per-round": 4})).cohort_size(10) == 4


def test_quiet_still_prints_where_the_results_are(tmp_path, capsys):
    code, out, err = run_cli(capsys, f"results-dir='{tmp_path}'", "run-name='q'", "--quiet", *SMALL)
    assert code == 0, err
    assert out.strip().splitlines() == [
        f"[fedaccel] results written to {(tmp_path / 'q').resolve()} "
        "(metrics.jsonl, summary.json, curves.png, config.json, final_model.npz)"]
    assert (tmp_path / "q" / "final_model.npz").is_file()


def test_flower_log_is_plain_when_not_a_terminal(tmp_path, monkeypatch):
    """Under pytest stderr is no terminal: Flower's console handler writes no
    ANSI colour codes during the run, and is back to Flower's default after."""
    import fedaccel.apps.server_app
    from flwr.common.logger import console_handler

    seen = []
    original = fedaccel.apps.server_app.run_experiment

    def spy(grid, run_config, **kwargs):
        seen.append(console_handler.colored)
        return original(grid, run_config, **kwargs)

    monkeypatch.setattr(fedaccel.apps.server_app, "run_experiment", spy)
    assert main([f"results-dir='{tmp_path}'", "--quiet", *SMALL]) == 0
    assert seen == [False]
    assert console_handler.colored is True


@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_piped_error_is_one_plain_line(tmp_path):
    """The real console script, stderr to a pipe: one line, no ANSI codes, exit 2."""
    exe = Path(sys.executable).parent / "fedaccel-run"
    proc = subprocess.run([str(exe), "algo='nope'", f"results-dir='{tmp_path}'"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("fedaccel-run: error: invalid run config: algo='nope': allowed: "
                           + ", ".join(__import__("fedaccel.registry", fromlist=["x"]).algorithm_names())
                           + "\n")
    assert "\x1b[" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("batching,where", [("off", "fedaccel.clients.base.LocalSolver.run_epochs"),
                                            ("auto", "fedaccel.clients.cohort.train_stacked")])
def test_a_run_whose_clients_all_fail_is_exit_4(tmp_path, capsys, monkeypatch, batching, where):
    """Every client of a round fails (one after another, or batched): one line
    with the cause, exit 4, and the run folder says failed (with that line)
    instead of looking finished."""
    import json

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(where, broken)
    code, _, err = run_cli(capsys, f"results-dir='{tmp_path}'", "run-name='f'", "--quiet",
                           f"cohort-batching='{batching}'", *SMALL)
    line = one_error_line(err)
    assert code == 4 and "disk on fire" in line
    status = json.loads((tmp_path / "f" / "status.json").read_text())
    assert status["state"] == "failed" and "disk on fire" in status["error"]
    assert not (tmp_path / "f" / "summary.json").exists() and not (tmp_path / "f" / "final_model.npz").exists()


@pytest.mark.parametrize("args,why", [
    (["algo='fedpm'", "fedpm.mode='exact'"], "fedpm.mode='exact' takes full-batch Newton steps per client"),
    (["algo='fedpm'", "fedpm.refresh-every=1"], "fedpm.refresh-every=1 recomputes each client's FOOF matrix")])
def test_check_refuses_cohort_batching_on_for_a_run_that_cannot_be_batched(tmp_path, capsys, args, why):
    """``--check`` gives the line the run itself would (and the run gives it
    before any folder or data); the server of a flwr run before it asks
    any node (run_experiment on a grid that must not be touched)."""
    from fedaccel.config import ConfigError
    from fedaccel.experiment import run_experiment
    from fedaccel.local_run import default_run_config, fuse

    on = ["cohort-batching='on'", "logical-clients=4"]
    code, _, err = run_cli(capsys, "--check", *on, *args, *SMALL)
    line = one_error_line(err)
    assert code == 2 and "cohort-batching='on' but this run cannot be batched: " + why in line
    code, _, err = run_cli(capsys, f"results-dir='{tmp_path}'", *on, *args, *SMALL)
    assert code == 2 and why in one_error_line(err) and not list(tmp_path.iterdir())

    class Untouchable:  # a Flower grid whose every use fails (an AttributeError, not the ConfigError)
        def __getattr__(self, name):
            raise AttributeError(f"the grid was asked for {name}")

    overrides = dict(kv.split("=", 1) for kv in on + args)
    overrides = {k: v.strip("'") if v.startswith("'") else int(v) for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=re.escape("cannot be batched: " + why)):
        run_experiment(Untouchable(), fuse(default_run_config(), {**overrides, "results-dir": str(tmp_path)}))


def test_check_validates_a_flwr_run_string_without_running(tmp_path, capsys):
    """``flwr run`` drops a --run-config token that is not key=value (Flower's
    parser, before the app sees the config); ``fedaccel-run --check`` with the
    same string refuses it, and accepts a good one, writing nothing."""
    code, out, err = run_cli(capsys, "--check", "--run-config", f"algo='fedprox' lr=0.02 results-dir='{tmp_path}'")
    assert code == 0 and err == ""
    assert out.splitlines() == [f"fedaccel-run: run config OK for 20 clients: algo='fedprox' lr=0.02 "
                                f"results-dir='{tmp_path}'",
                                "fedaccel-run: data and model OK: synthetic: 3,347 training samples over 20 "
                                "clients (40 to 800 each), 838 test samples; model mlp (2,282 parameters) for "
                                "inputs (60,) and 10 classes"]
    code, out, err = run_cli(capsys, "--check", "--run-config", f"algo='fedavg' lr results-dir='{tmp_path}'")
    assert code == 2 and out == "" and "--run-config: 'lr' is not key=value" in one_error_line(err)
    code, _, err = run_cli(capsys, "--check", "clients-per-round=30", f"results-dir='{tmp_path}'")
    assert code == 2 and "exceeds the 20 clients" in one_error_line(err)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,code,wanted", [
    (["device='cuda'"], 2, "device='cuda': no CUDA device is visible here"),
    (["dataset='mnist'", "data-dir='{missing}'"], 3, "mnist file {missing}/train-images-idx3-ubyte.gz"),
    (["dataset='fashion-mnist'", "data-dir='{missing}'"], 3, "fashion-mnist file {missing}/train-images"),
    (["dataset='digits'", "--num-clients", "1500"], 3, "num-clients=1500 exceeds the 1437 training samples"),
    (["dataset='digits'", "partition='label-sorted'", "--num-clients", "100"], 3,
     "partition='label-sorted' leaves 43 of the 100 clients of 'digits' without samples"),
    (["model='cnn'"], 2, "model: 'cnn' cannot take input_shape (60,)"),
    # the run's order: the data before the device
    (["device='cuda'", "dataset='mnist'", "data-dir='{missing}'"], 3, "mnist file {missing}/train-images"),
    (["dataset='breast-cancer'", "model='logreg'", "init='near-optimum'", "weight-decay=1e-9", "--num-clients", "3"], 2,
     "weight-decay=1e-09: Newton's method from zero did not find the optimum"),
    (["dataset='breast-cancer'", "model='logreg'", "optimality=true", "weight-decay=1e-9", "--num-clients", "3"], 2,
     "weight-decay=1e-09: Newton's method from zero did not find the optimum"),
    (["logical-clients=4", "checkpoint-every=1", "--num-clients", "2"], 2,
     "logical-clients=4: the fast runner does not checkpoint cohort nodes"),
    (["resume='{missing}'"], 2, "resume='{missing}': no such run folder or checkpoint file"),
])
def test_check_refuses_what_the_run_refuses_once_it_starts(tmp_path, capsys, args, code, wanted):
    """``--check`` loads the data and builds the model as the run does: a
    run it passes is not refused for its device, data files, client count,
    partition or model. Each case: ``--check`` and the run itself exit with
    the same code and the same one line."""
    if "device='cuda'" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: device='cuda' is valid here")
    missing = tmp_path / "no-data"
    args = [a.format(missing=missing) for a in args]
    wanted = wanted.format(missing=missing)
    small = ["num-server-rounds=1", "local-epochs=1", "accl-every=0", "clients-per-round=2"]
    check_code, out, err = run_cli(capsys, "--check", *small, *args)
    line = one_error_line(err)
    assert (check_code, out) == (code, "") and wanted in line
    results = tmp_path / "results"
    run_code, _, err = run_cli(capsys, f"results-dir='{results}'", *small, *args)
    assert run_code == code and one_error_line(err) == line


@pytest.mark.parametrize("args", [
    ["dataset='digits'", "dirichlet-alpha=0.1"],  # the default partition of an image set is Dirichlet's
    ["dataset='breast-cancer'", "partition='label-sorted'", "dirichlet-alpha=2.0"],
    ["dataset='digits'", "partition='iid'", "dirichlet-alpha=0.3"],  # the default value: not the user's
    ["synthetic.alpha=0.5", "synthetic.iid=true"],
])
def test_keys_that_this_run_uses_are_accepted(capsys, args):
    """The refusal of keys a run would ignore refuses only those: each of
    these sets a key that the run reads (or leaves it at its default)."""
    code, _, err = run_cli(capsys, "--check", *args)
    assert (code, err) == (0, "")


def test_check_keeps_no_dataset_loaded():
    """``--check`` (and the dashboard's Check, a long-lived process) loads
    the data without the run's per-process cache: nothing stays behind."""
    from fedaccel.data.federated import load_federated
    from fedaccel.local_run import check_data_and_model, default_run_config, fuse, preflight

    cfg, clients = preflight(fuse(default_run_config(), {"dataset": "digits", "clients-per-round": 7}), 7)
    load_federated.cache_clear()
    assert check_data_and_model(cfg, clients).startswith("digits: ")
    assert load_federated.cache_info().currsize == 0


def test_check_says_what_data_and_model_it_found(capsys):
    """A passing ``--check`` names the data it loaded and the model it built
    (here digits' 8x8 images for the CNN, which the config alone cannot tell)."""
    code, out, err = run_cli(capsys, "--check", "dataset='digits'", "model='cnn-small'", "clients-per-round=7",
                                  "--num-clients", "7")
    assert (code, err) == (0, "")
    assert out.splitlines()[1] == ("fedaccel-run: data and model OK: digits: 1,150 training samples over 7 clients "
                                   "(164 to 165 each), 360 test samples; model cnn-small (31,050 parameters) "
                                   "for inputs (1, 8, 8) and 10 classes")


@pytest.mark.slow  # five fresh interpreters, ~10 s: the same checks run in-process in the quick tier
@pytest.mark.parametrize("case", ["yaml", "dangling", "results-file", "memory", "data"])
def test_the_console_script_answers_each_kind_in_one_plain_line(tmp_path, case):
    """The installed ``fedaccel-run``, stderr to a pipe, one mistake of each
    kind of the issue: one plain line naming what to fix, its exit code,
    nothing in the results folder."""
    exe = Path(sys.executable).parent / "fedaccel-run"
    results = tmp_path / "results"
    bad_yaml = tmp_path / "study.yaml"
    bad_yaml.write_text("algo: [fedavg\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    args, code, wanted = {
        "yaml": (["--config", str(bad_yaml)], 2, f"--config {bad_yaml}: not valid YAML at line 2"),
        "dangling": (["--run-config", "algo='fedavg' lr"], 2, "--run-config: 'lr' is not key=value"),
        "results-file": ([f"results-dir='{blocker}'"], 3, f"results-dir='{blocker}': cannot write the run folder"),
        "memory": (["--num-clients", "100000000"], 3, "100,000,000 clients need about"),
        "data": (["dataset='digits'", "--num-clients", "5000"], 3, "exceeds the 1437 training samples"),
    }[case]
    proc = subprocess.run([str(exe), f"results-dir='{results}'", *SMALL_ANY_DATA, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "" and "\x1b[" not in proc.stderr and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("fedaccel-run: error: ") and wanted in line
    assert not (results.exists() and any(results.iterdir())) and blocker.read_text() == "x"


@pytest.mark.parametrize("entity", ["ServerApp", "Simulation"])
def test_flower_logs_a_user_error_as_one_line(entity):
    """What Flower logs when the ServerApp raises: on a SuperLink ("ServerApp
    raised an exception") and under Ray ("Simulation ..."), with exc_info."""
    import logging

    from fedaccel.apps.server_app import OneLineUserErrors

    def record(err: BaseException) -> logging.LogRecord:
        try:
            raise err
        except BaseException:  # noqa: BLE001 - we want its exc_info
            return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception",
                                     (entity,), sys.exc_info())

    user = record(ConfigError("invalid run config: lr=-1: must be > 0"))
    assert OneLineUserErrors().filter(user)
    assert user.getMessage() == f"{entity} stopped: [fedaccel] invalid run config: lr=-1: must be > 0"
    assert user.exc_info is None
    bug = record(KeyError("arrays"))
    assert OneLineUserErrors().filter(bug)
    assert bug.getMessage() == f"{entity} raised an exception" and bug.exc_info is not None


def test_a_refused_run_leaves_flowers_logging_as_it_was(tmp_path, capsys, monkeypatch):
    """Refused before anything is built (here: by the memory check inside
    run_local): Flower's log level and colours are the caller's again."""
    from flwr.common.logger import FLOWER_LOGGER, console_handler

    monkeypatch.setattr("fedaccel.memory.available_bytes", lambda: 2**30)

    level, colored = FLOWER_LOGGER.level, console_handler.colored
    assert main([f"results-dir='{tmp_path}'", "--num-clients", "10000000", "--quiet"]) != 0
    assert (FLOWER_LOGGER.level, console_handler.colored) == (level, colored)
