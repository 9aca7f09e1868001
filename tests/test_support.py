"""docs/support.md is true: generated from the registry, and every cell it
marks *tested* runs, every cell it marks *refused* is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedaccel import support
from fedaccel.config import ConfigError
from fedaccel.local_run import fuse, project_dir, run_local
from fedaccel.registry import algorithm_names

CELLS = [(a, m, p) for a in algorithm_names() for m in support.MODES for p in support.POLICIES]
ACCEPTED = [c for c in CELLS if support.verdict(*c) is None]
REFUSED = [c for c in CELLS if support.verdict(*c) is not None]


def test_support_page_is_current():
    page = (project_dir() / "docs" / "support.md").read_text(encoding="utf-8")
    assert page == support.render(), "regenerate: python -m fedaccel.support > docs/support.md"


def test_runner_columns_match_the_engine_tests():
    """The engine tests run exactly the runs the table lists, each registered
    algorithm at least once per engine, in the tier the table says."""
    import test_deployment
    import test_flwr_run

    for engine in support.ENGINES:
        runs = support.engine_runs(engine)
        assert {algo for algo, variant, _ in runs if variant == "default"} == set(algorithm_names())
        assert all(tier in (support.SUITE, support.MATRIX) for _, _, tier in runs)

    def tier(param) -> str:
        return support.MATRIX if any(m.name == "engine_matrix" for m in param.marks) else support.SUITE

    sim = [(p.values[0], "default" if not p.values[1] else "stragglers dropped", tier(p))
           for p in test_flwr_run.CASES]
    assert sim == support.engine_runs("simulation")
    dep = support.engine_runs("deployment")
    assert test_deployment.SUITE_ALGOS == [a for a, _, t in dep if t == support.SUITE]
    assert test_deployment.MATRIX_ALGOS == [a for a, _, t in dep if t == support.MATRIX]
    # the matrix test is the one the engine_matrix marker selects
    marks = {m.name for m in test_deployment.test_matrix_two_rounds_through_real_supernodes.pytestmark}
    assert "engine_matrix" in marks


def test_the_table_has_both_kinds_of_cells():
    assert REFUSED and len(ACCEPTED) > len(REFUSED)


@pytest.mark.parametrize("algo,mode,policy", REFUSED[:2] + REFUSED[-2:])
def test_refused_cells_stop_the_fast_runner_with_the_reason(tmp_path, algo, mode, policy):
    cfg = support.combination(algo, mode, policy)
    cfg["results-dir"] = str(tmp_path)
    with pytest.raises(ConfigError, match=rf"gc.mode='{mode}': is refused with algo='{algo}'"):
        run_local(cfg, num_clients=4, quiet=True)
    assert not any(Path(tmp_path).iterdir())  # nothing was written


@pytest.mark.parametrize("algo,mode,policy", ACCEPTED)
def test_every_accepted_combination_runs(tmp_path, monkeypatch, algo, mode, policy):
    # curves.png is 90 % of a cell's time (0.42 of 0.47 s) and is tested elsewhere
    # (tests/test_results.py); the cells check the training path
    monkeypatch.setattr("fedaccel.results.plot_curves", lambda *args, **kwargs: None)
    cfg = fuse(support.combination(algo, mode, policy), {
        # 2 local epochs: a straggler does 1, so 'partial' really aggregates partial work
        "num-server-rounds": 2, "clients-per-round": 2, "local-epochs": 2, "accl-every": 0,
        "synthetic.max-samples": 40, "synthetic.min-samples": 20, "results-dir": str(tmp_path),
        "run-name": "cell"})
    run_dir = run_local(cfg, num_clients=4, quiet=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
