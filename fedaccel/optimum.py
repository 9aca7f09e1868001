"""The optimum of a strongly convex run, a start near it, and the distance to it.

For ``model='logreg'`` with ``weight-decay`` > 0 the federation minimises the
strongly convex

    F(theta) = mean CE over every client's training samples + wd/2 ||theta||^2,

``theta = vec([W | b])`` (one row per class, the bias last; the bias is
decayed too, as the local solvers' SGD weight decay does), whose minimiser
``w*`` is unique. :func:`newton_optimum` finds it by Newton's method from
zero in float64 (on one torch thread), with the gradient and the Hessian from autograd, so it
shares no code with the solvers it measures (FedPM's exact mode has its own
Hessian), until ``||grad F|| < 1e-13``: the procedure of FedPM's Test 1
(``bench/fedpm_test1.py``). With it a run can

- start at ``w* + N(0, init-noise^2)`` per coordinate (``init='near-optimum'``;
  FedPM's Test 1 and its theorem are local), and
- record every round's gap ``F(w_r) - F*`` and distance ``||w_r - w*||``
  (``optimality=true``; ``gap`` and ``dist`` in ``metrics.jsonl``).

The sample-weighted mean is what FedAvg-style example weighting minimises; an
algorithm that averages its clients uniformly (SCAFFOLD's server) has another
fixed point when client sizes differ, and its gap says so.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from fedaccel.config import config_error
from fedaccel.data import DataConfig, load_federated

NEWTON_TOLERANCE = 1e-13  # stop when ||grad F|| falls below this
NEWTON_ACCEPT = 1e-12  # ... and refuse an optimum whose gradient norm is above this
NEWTON_ITERATIONS = 50


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside: the optimum and the measures are small
    problems whose float sums would otherwise depend on the run's thread
    count (and on a busy 2-core machine two threads made the Newton run 100x
    slower: 13 s against 0.11 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def logreg_objective(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, wd: float) -> torch.Tensor:
    """``mean CE + wd/2 ||theta||^2`` of the ``logreg`` model, ``theta = vec([W | b])``."""
    xt = torch.cat([x, torch.ones(len(y), 1, dtype=x.dtype)], 1)
    classes = theta.numel() // xt.shape[1]
    return F.cross_entropy(xt @ theta.reshape(classes, -1).T, y) + 0.5 * wd * theta.pow(2).sum()


def newton_optimum(x: torch.Tensor, y: torch.Tensor, wd: float, classes: int,
                   iterations: int = NEWTON_ITERATIONS) -> tuple[torch.Tensor, float, int]:
    """``(w*, ||grad F(w*)||, Newton steps)``: centralized Newton from zero,
    autograd gradient and Hessian, until ``||grad F|| < 1e-13`` (float64)."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return logreg_objective(t, x, y, wd)

    theta = torch.zeros(classes * (x.shape[1] + 1), dtype=torch.float64)
    steps = 0
    for _ in range(iterations):
        t = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(t), t)
        if float(g.norm()) < NEWTON_TOLERANCE:
            break
        h = torch.autograd.functional.hessian(f, theta)
        try:
            theta = theta - torch.linalg.solve(h, g)
        except torch.linalg.LinAlgError:  # a diverged iterate (NaN): refused by the caller
            break
        steps += 1
    t = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(t), t)
    return theta.detach(), float(g.norm()), steps


def theta_of(state: Mapping[str, Any]) -> torch.Tensor:
    """``vec([W | b])`` in float64 from a logreg state (``fc.weight``, ``fc.bias``;
    tensors, NumPy arrays or Flower Arrays)."""
    def array(value: Any) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        elif hasattr(value, "numpy"):  # a Flower Array
            value = value.numpy()
        return np.asarray(value, dtype=np.float64)

    w, b = array(state["fc.weight"]), array(state["fc.bias"])
    return torch.from_numpy(np.concatenate([w, b[:, None]], 1).reshape(-1))


@dataclass(frozen=True)
class Optimum:
    """``w*`` of a run's objective and what measuring against it needs."""

    theta: torch.Tensor  # float64, vec([W | b])
    f_star: float
    grad_norm: float
    newton_steps: int
    x: torch.Tensor  # every client's training samples, float64, in pool order
    y: torch.Tensor
    wd: float

    def measure(self, state: Mapping[str, Any]) -> tuple[float, float]:
        """``(F(w) - F*, ||w - w*||)`` of a logreg state."""
        theta = theta_of(state)
        with torch.no_grad(), one_thread():
            gap = float(logreg_objective(theta, self.x, self.y, self.wd)) - self.f_star
        return gap, float((theta - self.theta).norm())

    def near(self, noise: float, seed: int) -> dict[str, torch.Tensor]:
        """``w* + noise * N(0, 1)`` per coordinate (a torch generator seeded with
        ``seed``) as a logreg state in float64."""
        generator = torch.Generator().manual_seed(seed)
        theta = self.theta + noise * torch.randn(self.theta.shape, generator=generator, dtype=torch.float64)
        wb = theta.reshape(self.theta.numel() // (self.x.shape[1] + 1), -1)  # one row per class
        return {"fc.weight": wb[:, :-1].contiguous(), "fc.bias": wb[:, -1].contiguous()}

    def describe(self) -> dict[str, float | int]:
        """What ``config.json`` records of it."""
        return {"f-star": self.f_star, "w-star-norm": float(self.theta.norm()),
                "grad-norm": self.grad_norm, "newton-steps": self.newton_steps,
                "samples": int(self.y.shape[0])}


@lru_cache(maxsize=4)
def optimum_for(data_cfg: DataConfig, wd: float, num_classes: int) -> Optimum:
    """The optimum of ``F`` over every client's training samples of
    ``data_cfg`` (computed once per process); a Newton run that does not
    reach ``||grad F|| < 1e-12`` is refused with one line."""
    x, y = load_federated(data_cfg).training_rows()
    xt = torch.from_numpy(np.ascontiguousarray(x.reshape(len(x), -1), dtype=np.float64))
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    with one_thread():
        theta, grad_norm, steps = newton_optimum(xt, yt, wd, num_classes)
        with torch.no_grad():
            f_star = float(logreg_objective(theta, xt, yt, wd))
    if not grad_norm < NEWTON_ACCEPT:
        raise config_error("weight-decay", wd, f"Newton's method from zero did not find the optimum of the "
                           f"logreg objective in {NEWTON_ITERATIONS} steps (||grad F|| = {grad_norm:.3g}, needs "
                           f"< {NEWTON_ACCEPT:g}): a larger weight-decay makes it better conditioned")
    return Optimum(theta=theta, f_star=f_star, grad_norm=grad_norm, newton_steps=steps, x=xt, y=yt, wd=wd)
