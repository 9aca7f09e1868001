"""The YAML run configs in configs/ (one per reproduced paper experiment, for
``fedaccel-run --config FILE``): each loads, fuses with pyproject's keys and
validates; each holds exactly the run config its bench script passes; the
smallest runs end to end, with key=value tokens overriding the file."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from fakes import bench_script

from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse, parse_overrides, run_local

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
FILES = sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.yml"))
SMALLEST = CONFIGS / "fedpm-test1.yaml"  # logreg on breast-cancer (569 samples), 10 clients, one Newton step a round


def _ids(paths):
    return [p.name for p in paths]


def test_the_folder_holds_the_experiments():
    assert len(FILES) >= 5, f"expected at least 5 YAML files in {CONFIGS}, found {_ids(FILES)}"
    assert SMALLEST in FILES


@pytest.mark.parametrize("path", FILES, ids=_ids(FILES))
def test_every_file_loads_fuses_and_validates(path):
    overrides = parse_overrides([], None, str(path))
    assert overrides, f"{path.name} sets no key"
    cfg = fuse(default_run_config(), overrides)  # SystemExit on an unknown (e.g. renamed) key
    parse_run_config(cfg)  # ConfigError on an invalid value
    # YAML 1.1 reads 5e-4 (no dot) as a string: every number must be written as one.
    for key, value in overrides.items():
        if isinstance(value, str):
            with pytest.raises(ValueError):
                float(value)


@pytest.mark.parametrize("path", FILES, ids=_ids(FILES))
def test_every_file_says_what_it_is_and_how_to_run_it(path):
    text = path.read_text(encoding="utf-8")
    header = "".join(line[1:] + "\n" for line in text.splitlines() if line.startswith("#"))
    assert text.startswith("#"), f"{path.name} must start with comments"
    assert "bench/" in header and "docs/" in header, f"{path.name}: name the bench script and the doc"
    assert f"fedaccel-run --config configs/{path.name}" in header
    match = re.search(r"--num-clients (\d+)", header)
    assert match, f"{path.name}: say how many clients to pass"
    cfg = fuse(default_run_config(), parse_overrides([], None, str(path)))
    per_round = cfg["clients-per-round"]
    if isinstance(per_round, int) or (isinstance(per_round, float) and per_round > 1):
        assert per_round <= int(match.group(1)), f"{path.name}: more clients per round than clients"
    assert re.search(r"algo='\w+'", header), f"{path.name}: show a command that swaps the algorithm"
    for bad in ("/work/", "../shared", "/tmp/"):
        assert bad not in text, f"{path.name} names a local path ({bad})"


def _commands(text):
    """Every ``fedaccel-run --config configs/...`` command in ``text`` (comments after `#` dropped)."""
    for line in text.splitlines():
        start = line.find("fedaccel-run --config configs/")
        if start >= 0:
            yield shlex.split(line[start:].split(" # ")[0], comments=True)[1:]


def _validate_command(argv):
    config, run_config, tokens, clients = None, None, [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            config = next(it)
        elif arg == "--run-config":
            run_config = next(it)
        elif arg == "--num-clients":
            clients = int(next(it))
        else:
            tokens.append(arg)
    assert config and clients, argv
    parse_run_config(fuse(default_run_config(), parse_overrides(tokens, run_config, str(ROOT / config))))


@pytest.mark.parametrize("path", FILES + [ROOT / "docs" / "config.md"], ids=_ids(FILES) + ["docs/config.md"])
def test_the_example_commands_are_valid(path):
    commands = list(_commands(path.read_text(encoding="utf-8")))
    assert commands, f"{path.name} shows no fedaccel-run --config command"
    for argv in commands:
        _validate_command(argv)


def test_precedence_file_then_run_config_then_tokens():
    from_file = parse_overrides([], None, str(SMALLEST))
    merged = parse_overrides(["lr=0.2", "fedpm.damping=0.5"], "lr=0.7 seed=3", str(SMALLEST))
    assert merged["lr"] == 0.2  # token over --run-config over the file
    assert merged["seed"] == 3  # --run-config over the file
    assert merged["fedpm.damping"] == 0.5
    assert {k: v for k, v in merged.items() if k not in ("lr", "seed", "fedpm.damping")} == \
        {k: v for k, v in from_file.items() if k not in ("lr", "seed", "fedpm.damping")}
    # the file over pyproject's defaults
    assert default_run_config()["model"] != from_file["model"] == "logreg"


def test_smallest_file_runs_end_to_end_and_tokens_override_it(tmp_path):
    file_values = parse_overrides([], None, str(SMALLEST))
    tokens = ["num-server-rounds=1", "lr=0.5", f"results-dir='{tmp_path}'",
              "run-name='from-yaml'"]
    cfg = fuse(default_run_config(), parse_overrides(tokens, None, str(SMALLEST)))
    assert file_values["num-server-rounds"] != 1
    run_dir = run_local(cfg, num_clients=10, quiet=True)
    config = json.loads((run_dir / "config.json").read_text())
    overridden = {"num-server-rounds", "lr", "results-dir", "run-name"}
    for key, value in file_values.items():
        if key not in overridden:
            assert config[key] == value and type(config[key]) is type(value), key
    assert config["num-server-rounds"] == 1 and config["lr"] == 0.5
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1]
    assert 0.0 <= rows[0]["accg"] <= 1.0


# ---------------------------------------------------------------- the bench scripts' own run configs

def _bench(monkeypatch, name):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # the scripts import bench/runner.py
    return bench_script(name)


def _fedcdr(monkeypatch, table):
    bench = _bench(monkeypatch, "fedcdr_table1")
    args = bench.parse_args([])
    # the swept values docs/fedcdr.md reports: lr 0.01, FedProx mu 0.001, eta 100, alpha 1, 'server'
    chosen = dict(lr=0.01, mu=0.001, eta=100.0, alpha=args.alpha, prox_start="server")
    if table == "1":
        return bench.make_run(args, "table1", "FedCDR", "(1,1)", 0, args.rounds, **chosen)
    return bench.make_run(args, "table8", "FedCDR", "(1,1)", 0, args.rounds, **chosen,
                          fraction=0.9, policy="partial")


@pytest.mark.parametrize("argv", [[], ["--quick"]])
def test_every_table8_run_of_the_bench_passes_what_a_run_refuses_first(monkeypatch, argv):
    """Each straggler run of bench/fedcdr_table1.py, full and --quick, passes
    the fast runner's preflight: with --quick's 20 clients a tenth a round
    (2) would make 90 % stragglers every client of a round, which 'drop'
    refuses (every reply dropped); --quick takes 6 a round."""
    from fedaccel.local_run import default_run_config, fuse, preflight

    bench = _bench(monkeypatch, "fedcdr_table1")
    args = bench.parse_args(argv)
    for method in bench.METHODS:
        for fraction in bench.FRACTIONS:
            for policy in ("drop", "partial"):
                run = bench.make_run(args, "table8", method, "(1,1)", 0, args.rounds, lr=0.01, mu=0.001, eta=100.0,
                                     alpha=args.alpha, prox_start="server", fraction=fraction, policy=policy)
                preflight(fuse(default_run_config(), run["overrides"]), run["num_clients"])


def _gradient_correction(monkeypatch):
    bench = _bench(monkeypatch, "gradient_correction")
    return bench.make_run(bench.parse_args([]), "FedRKMGC (w Re & fast KM)", 0.3, 0)


def _fedacg_gcfed(monkeypatch):
    bench = _bench(monkeypatch, "fedacg_gcfed")
    args = bench.parse_args([])
    return bench.make_run(args, "main", "FedACG (full)", 0, args.rounds, args.lr)


def _fedpm_test2(monkeypatch):
    bench = _bench(monkeypatch, "fedpm_test2")
    return bench.make_run(bench.parse_args([]), "FedPM", 1.0, 0)


class _Captured(Exception):
    pass


def _fedpm_test1(monkeypatch):
    """run_method() builds its run config inline: catch what it hands to fuse()."""
    import fedaccel.local_run
    from flwr.common.logger import FLOWER_LOGGER

    bench = _bench(monkeypatch, "fedpm_test1")
    algo, fixed, lr_key, lrs = bench.METHODS["FedPM (exact)"]
    assert lrs == [1.0]

    def capture(defaults, overrides):
        raise _Captured(overrides)

    monkeypatch.setattr(fedaccel.local_run, "fuse", capture)
    level = FLOWER_LOGGER.level
    try:
        # the script's defaults: --clients 10 (10 shards), --rounds 30
        bench.run_method(algo, {**fixed, lr_key: lrs[0]}, [None] * 10, {}, 30, None)
    except _Captured as caught:
        return {"overrides": caught.args[0], "num_clients": 10}
    finally:
        FLOWER_LOGGER.setLevel(level)
    raise AssertionError("run_method did not build a run config")


BENCH = {
    "fedcdr-table1.yaml": lambda mp: _fedcdr(mp, "1"),
    "fedcdr-table8.yaml": lambda mp: _fedcdr(mp, "8"),
    "fedrkmgc-ablation.yaml": _gradient_correction,
    "fedacg-gcfed.yaml": _fedacg_gcfed,
    "fedpm-test1.yaml": _fedpm_test1,
    "fedpm-test2.yaml": _fedpm_test2,
}


@pytest.mark.parametrize("name", sorted(BENCH))
def test_file_is_exactly_its_bench_scripts_run(monkeypatch, name):
    path = CONFIGS / name
    job = BENCH[name](monkeypatch)
    defaults = default_run_config()
    ours = fuse(defaults, parse_overrides([], None, str(path)))
    theirs = fuse(defaults, job["overrides"])
    diff = {k: (ours[k], theirs[k]) for k in ours if (ours[k], type(ours[k])) != (theirs[k], type(theirs[k]))}
    assert not diff, f"{name} differs from its bench script's run (file, script): {diff}"
    header = path.read_text(encoding="utf-8")
    assert f"--num-clients {job['num_clients']}" in header


def test_every_file_is_checked_against_its_bench_script():
    assert sorted(BENCH) == _ids(FILES), "add the new file's bench run to BENCH"
