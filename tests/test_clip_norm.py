"""Run-config ``clip-norm``: total-gradient-norm clipping in the shared local loop.

Hand-computed on a two-scalar model: logits ``[10 a, 10 b]`` for the one input
``x = 10``, label 0, from ``a = b = 0``. The cross-entropy gradient is
``10 (softmax - e_0) = (-5, 5)``, total norm ``sqrt(50) = 7.0711``; one SGD step
at lr 0.1 without clipping gives ``(a, b) = (0.5, -0.5)``, with ``clip-norm = 1``
it gives ``0.1 (1, -1) / sqrt(2) = (0.070711, -0.070711)`` (clipping each tensor
on its own would give ``(0.1, -0.1)``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedaccel.clients.base import LocalSolver, TrainData
from fedaccel.contract import train_config_record
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse
from fedaccel.registry import algorithm_names, get_algorithm

X = torch.tensor([[10.0]])
Y = torch.tensor([0])


class TwoScalars(nn.Module):
    """Logits ``[x a, x b]``: two parameter tensors of one value each."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x * self.a, x * self.b], dim=1)


def run_cfg(**overrides):
    return parse_run_config(fuse(default_run_config(), overrides))


def cfg_for(clip, algo="fedavg", **extra):
    return run_cfg(algo=algo, **{"clip-norm": clip, "batch-size": 1, "momentum": 0.0,
                                 "weight-decay": 0.0, **extra})


def one_step(solver, model=None, x=X, y=Y, lr=0.1):
    model = TwoScalars() if model is None else model
    solver.fit(model, TrainData(x, y), train_config_record(1, lr, 1), None,
               torch.Generator().manual_seed(0))
    return model


def ab(model) -> tuple[float, float]:
    return float(model.a.detach()), float(model.b.detach())


# ------------------------------------------------------------- the loop
def test_no_clip_is_the_plain_step():
    assert ab(one_step(LocalSolver(cfg_for(0)))) == pytest.approx((0.5, -0.5), abs=1e-7)


def test_clip_scales_the_total_norm_of_all_parameters():
    a, b = ab(one_step(LocalSolver(cfg_for(1.0))))
    r = 0.1 / math.sqrt(2.0)
    assert (a, b) == pytest.approx((r, -r), abs=1e-7)  # not (0.1, -0.1): one norm over both tensors


def test_clip_above_the_norm_changes_nothing():
    assert ab(one_step(LocalSolver(cfg_for(7.1)))) == pytest.approx((0.5, -0.5), abs=1e-7)
    a, _ = ab(one_step(LocalSolver(cfg_for(7.0))))  # just below sqrt(50) = 7.0711
    assert a == pytest.approx(0.1 * 5.0 * 7.0 / math.sqrt(50.0), abs=1e-7)  # 0.49497


class Scaled(LocalSolver):
    """An algorithm whose gradient transform multiplies every gradient by ``factor``."""

    factor = 1.0

    def transform_gradients(self, model):
        for p in model.parameters():
            p.grad.mul_(self.factor)


@pytest.mark.parametrize("factor, expected", [
    (100.0, 0.1 / math.sqrt(2.0)),  # (-500, 500) clipped to norm 1 (clipping first: 7.07)
    (0.01, 0.005),                   # (-0.05, 0.05), norm 0.07 < 1: unclipped (clipping first: 7.1e-4)
])
def test_clip_acts_on_the_transformed_gradient(factor, expected):
    solver = type("S", (Scaled,), {"factor": factor})(cfg_for(1.0))
    a, b = ab(one_step(solver))
    assert (a, b) == pytest.approx((expected, -expected), abs=1e-7)


def test_clip_acts_after_local_gradient_centralization():
    """Linear(2, 2, no bias) from zero, x = (10, 0), label 0: gradient
    [[-5, 0], [5, 0]]; local GC removes each row's mean: [[-2.5, 2.5], [2.5, -2.5]]
    (norm 5); clipped to 1 and stepped at lr 0.1: W = [[.05, -.05], [-.05, .05]].
    Clipping before GC would give +-0.0354."""
    model = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(model.weight)
    solver = LocalSolver(cfg_for(1.0, **{"gc.mode": "local"}))
    one_step(solver, model, x=torch.tensor([[10.0, 0.0]]))
    torch.testing.assert_close(model.weight.detach(),
                               torch.tensor([[0.05, -0.05], [-0.05, 0.05]]), atol=1e-7, rtol=0)


def test_every_algorithm_trains_through_the_shared_loop():
    """No solver has its own step loop (FedPM's exact mode, which has one,
    refuses clip-norm > 0: tests/test_fedpm.py), so every solver clips."""
    for algo in algorithm_names():
        solver = get_algorithm(algo).solver
        assert solver.run_epochs is LocalSolver.run_epochs, algo
        # fit() could bypass the loop: only FedPM/LocalNewton override it, for
        # their exact mode (which refuses clipping) and to pick FOOF samples
        if algo not in ("fedpm", "localnewton"):
            assert solver.fit is LocalSolver.fit, algo


# -------------------------------------------------------------- config
@pytest.mark.parametrize("algo, expected", [
    ("fedavg", 0.0), ("fedprox", 0.0), ("scaffold", 0.0), ("fedpm", 1.0), ("localnewton", 1.0),
])
def test_auto_is_the_algorithms_default(algo, expected):
    assert default_run_config()["clip-norm"] == "auto"
    assert run_cfg(algo=algo).clip_norm == expected


def test_auto_is_off_in_the_exact_mode():
    cfg = run_cfg(algo="fedpm", model="logreg", **{"fedpm.mode": "exact"})
    assert cfg.clip_norm == 0.0


@pytest.mark.parametrize("value, expected", [(0, 0.0), (0.5, 0.5), (2, 2.0)])
def test_a_number_is_taken_as_is(value, expected):
    cfg = run_cfg(algo="fedpm", **{"clip-norm": value})
    assert cfg.clip_norm == expected and isinstance(cfg.clip_norm, float)


@pytest.mark.parametrize("value", [-1, -0.5, "none", "Auto", True, float("nan"), float("inf")])
def test_a_bad_value_is_one_line_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        run_cfg(**{"clip-norm": value})
    msg = str(info.value)
    assert "\n" not in msg and "clip-norm" in msg and "'auto'" in msg


def test_the_key_is_required():
    cfg = default_run_config()
    del cfg["clip-norm"]
    with pytest.raises(ConfigError, match="clip-norm"):
        parse_run_config(cfg)
