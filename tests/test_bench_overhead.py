"""bench/overhead.py compares like with like: its bare PyTorch loop and the
fast runner train the same clients the same way and end at the same model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _overhead():
    spec = importlib.util.spec_from_file_location("bench_overhead", ROOT / "bench" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algo, mode", [("fedavg", "fast"), ("fedcdr", "cohort"),
                                        pytest.param("fedcdr", "fast", marks=pytest.mark.slow),
                                        pytest.param("fedpm", "fast", marks=pytest.mark.slow)])
def test_bare_loop_and_fast_runner_reach_the_same_model(tmp_path, algo, mode):
    overhead = _overhead()
    ov = overhead.overrides("mlp-synthetic", algo, rounds=3, clients=20, run_dir=tmp_path, name=algo,
                            mode=mode)
    assert ov["cohort-batching"] == ("on" if mode == "cohort" else "off")
    bare = overhead.bare_run(ov, 20)
    fast = overhead.fast_run(ov, 20)
    assert len(bare["round_seconds"]) == len(fast["round_seconds"]) == 3
    with np.load(Path(fast["folder"]) / "final_model.npz") as final:
        assert sorted(final.files) == sorted(bare["final"])
        for key, want in bare["final"].items():
            np.testing.assert_allclose(final[key], want.numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
