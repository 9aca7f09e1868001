"""FedPM paper, Test 1: strongly convex logistic regression, gap and distance per round.

    python bench/fedpm_test1.py [--rounds 30] [--clients 10] [--out bench/results/fedpm]
    fedaccel-sweep configs/studies/fedpm-test1.yaml --workers 1 --results-dir RESULTS
    python bench/fedpm_test1.py --phase table --from-study RESULTS/fedpm-test1 [--out ...]

The first command runs the grid below in this process, on the script's own
client runtime (the reference); the second runs the same 21 runs as ordinary
fast-runner runs (a study file, every cell's run config equal to one run of
this script: ``tests/test_sweep.py``), and the third makes this script's
tables and plot from the study's cells (``--phase table``).

Problem: L2-regularised 2-logit logistic regression (the project's ``logreg``
model, ``theta = vec([W | b])``, 62 values) on scikit-learn's breast cancer
data (569 x 30, standardized), ``F(theta) = mean CE + wd/2 ||theta||^2`` over
all 569 samples (wd = 1e-2, bias included, exactly the solvers' objective).
Split: the one of ``tests/test_fedpm.py`` (samples sorted by label, then cut
into ``--clients`` contiguous shards of Dirichlet(2)-drawn sizes, >= 20 each),
so most clients hold a single class and the shard sizes differ.
Start: ``theta* + N(0, 0.1^2)`` per coordinate (torch seed 0), as the paper
and the test (the theorem is local), *not* the model's seeded initialisation.
``theta*``: centralized Newton from zero until ||grad F|| < 1e-13 (gradient and
Hessian by autograd here, independent of the code under test).

How it runs: the project's *real* pieces, in this process, in float64: the
ClientApp ``fedaccel.apps.client_app.app`` (its ``train`` handler), each algorithm's
registered strategy (``get_algorithm(algo).build_strategy``) and solver, the
fast runner's ``LocalGrid``, and Flower's ``Strategy.start``. Only the client
runtime (data + model) is replaced: ``client_runtime`` returns a float64
``LogReg(30, 2)`` and the client's breast-cancer shard, and the per-round
models are taken from Flower's ``evaluate_fn`` hook, so that the data, the
optimum, the start and the measures come from this script's own code: the
independent reference the study's cells (the runner's own breast-cancer
data, ``precision``, ``init`` and ``optimality`` keys) are checked against.
Full participation,
one local step per round (``local-epochs=1``, ``batch-size`` > any shard:
full-batch GD for the first-order methods, one exact Newton step for
LocalNewton/FedPM), momentum 0, as in the paper's Test 1.

Learning rates: each baseline over a small grid; the kept lr is the one with
the smallest final gap (diverged runs are skipped). FedPM uses the theorem's
setting (lr 1, damping 0, ``fedpm.mode='exact'``) without tuning.

Every run's run config (:func:`run_overrides`) carries the keys that say
all this to the fast runner (``dataset='breast-cancer'``,
``partition='label-sorted'`` with ``dirichlet-alpha=2.0``,
``local-test-fraction=0.0``, ``precision='float64'``,
``init='near-optimum'`` with ``init-noise=0.1``, ``optimality=true``);
``run_method`` itself replaces the data and the model, so they change nothing
there. The fast runner's run of the same keys gives bit-identical gaps and
distances (``tests/test_fedpm.py``).

Outputs (``--out``): ``test1.csv`` (method, round, dist, gap; kept lrs),
``test1_grid.csv`` (every grid run), ``test1.png`` (log-scale gap and
distance per round), ``test1.md`` (tables).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import plots  # bench/plots.py: the curve figures

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WD = 1e-2
NOISE = 0.1

# method label -> (algo, fixed overrides, lr key, lr grid)
METHODS: "OrderedDict[str, tuple[str, dict, str, list[float]]]" = OrderedDict([
    ("FedAvg", ("fedavg", {}, "lr", [1.0, 2.0, 4.0, 8.0])),
    ("FedAvgM", ("fedavgm", {"fedavgm.server-lr": 1.0, "fedavgm.server-momentum": 0.9},
                 "lr", [0.3, 1.0, 2.0, 4.0])),
    ("SCAFFOLD", ("scaffold", {"scaffold.server-lr": 1.0}, "lr", [1.0, 2.0, 4.0, 8.0])),
    # variant pinned to the rule the recorded results ran (the default is now 'paper')
    ("FedAdam", ("fedadam", {"lr": 1.0, "fedadam.beta1": 0.9, "fedadam.beta2": 0.99,
                             "fedadam.tau": 1e-3, "fedadam.variant": "flower"},
                 "fedadam.server-lr", [0.003, 0.01, 0.03, 0.1])),
    ("LocalNewton", ("localnewton", {"localnewton.mode": "exact", "localnewton.damping": 0.0},
                     "lr", [0.1, 0.25, 0.5, 1.0])),
    ("FedPM (exact)", ("fedpm", {"fedpm.mode": "exact", "fedpm.damping": 0.0}, "lr", [1.0])),
])


SIZE_ALPHA = 2.0  # Dirichlet concentration of the shard sizes
SEED = 0


def run_overrides(algo: str, overrides: dict, rounds: int, clients: int) -> dict:
    """The run config of one run (over the project's defaults): the keys
    ``run_method`` builds the run with, and those that make the fast runner
    (``fedaccel-run``, a study's cell) run the same problem."""
    return {"algo": algo, "model": "logreg", "weight-decay": WD, "local-epochs": 1,
            "batch-size": 4096, "momentum": 0.0, "num-server-rounds": rounds,
            "clients-per-round": clients, "accl-every": 0, "client-state": "context",
            "seed": SEED, "dataset": "breast-cancer", "partition": "label-sorted",
            "dirichlet-alpha": SIZE_ALPHA, "local-test-fraction": 0.0, "precision": "float64",
            "init": "near-optimum", "init-noise": NOISE, "optimality": True,
            "cohort-batching": "off", **overrides}  # one client after another, as recorded


def make_runs(rounds: int, clients: int) -> list[dict]:
    """Every run of the grid: METHODS x their lr grids, in that order."""
    return [{"method": label, "lr_key": lr_key, "lr": lr, "algo": algo, "num_clients": clients,
             "name": f"{label} {lr_key}={lr:g}", "method_overrides": {**fixed, lr_key: lr},
             "overrides": run_overrides(algo, {**fixed, lr_key: lr}, rounds, clients)}
            for label, (algo, fixed, lr_key, lrs) in METHODS.items() for lr in lrs]


# ------------------------------------------------------------------ problem
def breast_cancer_clients(num_clients: int):
    """The split of tests/test_fedpm.py: label-sorted, Dirichlet(2) sizes >= 20."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    order = np.lexsort((x[:, 0], y))  # sorted by label: most clients see one class
    sizes = np.random.default_rng(SEED).dirichlet(np.ones(num_clients) * SIZE_ALPHA) * len(y)
    cuts = np.clip(np.cumsum(np.maximum(sizes, 20)).astype(int), 0, len(y))[:-1]
    parts = [p for p in np.split(order, cuts) if len(p)]
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    return [(xt[p].contiguous(), yt[p].contiguous()) for p in parts], xt, yt


def objective(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, wd: float = WD) -> torch.Tensor:
    """mean CE + wd/2 ||theta||^2, theta = vec([W | b]) of shape (2 * 31,)."""
    xt = torch.cat([x, torch.ones(len(y), 1, dtype=x.dtype)], 1)
    return F.cross_entropy(xt @ theta.reshape(2, -1).T, y) + 0.5 * wd * theta.pow(2).sum()


def newton_optimum(shards_weights, iters: int = 50) -> torch.Tensor:
    """argmin sum_j w_j f_j (autograd gradient/Hessian, centralized Newton from zero)."""
    def f(t):
        return sum(w * objective(t, xs, ys) for w, (xs, ys) in shards_weights)

    theta = torch.zeros(62, dtype=torch.float64)
    for _ in range(iters):
        t = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(t), t)
        if float(g.norm()) < 1e-13:
            break
        h = torch.autograd.functional.hessian(f, theta)
        theta = theta - torch.linalg.solve(h, g)
    t = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(t), t)
    assert float(g.norm()) < 1e-12, float(g.norm())
    return theta.detach()


def as_theta(arrays) -> torch.Tensor:
    w = np.asarray(arrays["fc.weight"].numpy(), dtype=np.float64)
    b = np.asarray(arrays["fc.bias"].numpy(), dtype=np.float64)
    return torch.from_numpy(np.concatenate([w, b[:, None]], 1).reshape(-1))


# ------------------------------------------------------------------ one run
def run_method(algo: str, overrides: dict, shards, start: dict, rounds: int,
               measure) -> tuple[list[float], list[float], str]:
    """Rounds 0..R of the real ClientApp + strategy; returns (dist, gap, status)."""
    from flwr.app import ArrayRecord
    from flwr.common.logger import FLOWER_LOGGER

    import fedaccel.apps.client_app as client_module
    from fedaccel.apps.client_app import ClientRuntime
    from fedaccel.clients.base import TrainData
    from fedaccel.run_config import parse_run_config
    from fedaccel.local_grid import LocalGrid, task_identity
    from fedaccel.local_run import default_run_config, fuse
    from fedaccel.registry import get_algorithm
    from fedaccel.models import LogReg
    from fedaccel.membership import Federation

    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.ERROR)  # the grid's rounds are quiet; put back below
    run_config = fuse(default_run_config(), run_overrides(algo, overrides, rounds, len(shards)))
    cfg = parse_run_config(run_config)
    spec = get_algorithm(algo)
    runtimes = {}
    for pid, (xs, ys) in enumerate(shards):
        model = LogReg(30, 2).double()
        solver = spec.solver(cfg)
        solver.initial_model = OrderedDict((k, torch.from_numpy(v.copy())) for k, v in start.items())
        runtimes[pid] = ClientRuntime(cfg=cfg, partition_id=pid, device=torch.device("cpu"),
                                      model=model, solver=solver, train=TrainData(xs, ys),
                                      test_x=xs[:1], test_y=ys[:1], state_mode="context")
    original = client_module.client_runtime
    client_module.client_runtime = lambda context: runtimes[int(context.node_config["partition-id"])]
    dist: list[float] = []
    gap: list[float] = []

    def on_round(server_round, arrays):
        d, g = measure(as_theta(arrays))
        dist.append(d)
        gap.append(g)
        return None

    status = "ok"
    try:
        grid = LocalGrid(client_module.app, run_config, len(shards), seed=0)
        federation = Federation({int(c.node_config["partition-id"]): node
                                 for node, c in grid.contexts.items()})
        strategy = spec.build_strategy(cfg, federation)
        initial = ArrayRecord(OrderedDict((k, torch.from_numpy(v.copy())) for k, v in start.items()))
        with task_identity(grid.run.run_id):
            strategy.start(grid=grid, initial_arrays=strategy.initial_model(initial),
                           num_rounds=rounds, timeout=600.0, evaluate_fn=on_round)
    except Exception as err:  # a diverged run: NaN replies are rejected, the round fails
        status = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    finally:
        client_module.client_runtime = original
        FLOWER_LOGGER.setLevel(level)
    if not all(math.isfinite(v) for v in dist + gap) or len(dist) < rounds + 1:
        status = status if status != "ok" else "diverged"
    while len(dist) < rounds + 1:
        dist.append(float("nan"))
        gap.append(float("nan"))
    return dist, gap, status


# ------------------------------------------------------------------ report
def first_below(gap: list[float], level: float) -> str:
    for r, g in enumerate(gap):
        if math.isfinite(g) and g < level:
            return str(r)
    return f"> {len(gap) - 1}"


def tail_ratios(dist: list[float], count: int = 3, floor: float = 1e-12) -> list[float]:
    """e_{r+1}/e_r for the last ``count`` rounds whose e_r and e_{r+1} are above ``floor``."""
    pairs = [(a, b) for a, b in zip(dist, dist[1:]) if math.isfinite(b) and a > floor and b > floor]
    return [b / a for a, b in pairs[-count:]]


def fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.2e}"


def plot(kept: dict, path: Path, suptitle: str) -> None:
    """Objective gap and distance to w* per round of each kept method (log scale, floored at 1e-16)."""
    floor = 1e-16
    gaps, dists = [], []
    for label, (lr_key, lr, dist, gap) in kept.items():
        rr = np.arange(len(gap))
        name = f"{label} ({'server lr' if lr_key != 'lr' else 'lr'} {lr:g})"
        gaps.append((name, rr, np.maximum(np.abs(gap), floor)))
        dists.append((name, rr, np.maximum(dist, floor)))
    plots.plot_panels([(r"$|F(w_r) - F(w^*)|$ (floored at 1e-16)", gaps), (r"$\|w_r - w^*\|$", dists)], path,
                      ylabel=None, panel_size=(5.5, 4.2), marker=".", logy=True, legend={"fontsize": 8},
                      legend_panels=(1,), suptitle=suptitle, dpi=110)


def problem(clients: int) -> dict:
    """The data, ``w*``, ``F*``, the start and the measure of every run."""
    shards, x, y = breast_cancer_clients(clients)
    theta_star = newton_optimum([(1.0, (x, y))])
    f_star = float(objective(theta_star, x, y))
    torch.manual_seed(SEED)
    theta0 = (theta_star + NOISE * torch.randn_like(theta_star)).reshape(2, 31)
    start = {"fc.weight": theta0[:, :30].numpy().copy(), "fc.bias": theta0[:, 30].numpy().copy()}

    def measure(theta):
        return float((theta - theta_star).norm()), float(objective(theta, x, y)) - f_star

    return {"shards": shards, "x": x, "y": y, "theta_star": theta_star, "f_star": f_star,
            "start": start, "measure": measure,
            "start_dist": float((theta0.reshape(-1) - theta_star).norm())}


def run_grid(runs: list[dict], prob: dict, rounds: int) -> list[tuple]:
    """Every run on the script's own runtime: (label, lr_key, lr, dist, gap, status) each."""
    rows = []
    for run in runs:
        t = time.time()
        dist, gap, status = run_method(run["algo"], run["method_overrides"], prob["shards"], prob["start"],
                                       rounds, prob["measure"])
        print(f"{run['method']:14s} {run['lr_key']}={run['lr']:<6g} final gap {fmt(gap[-1])} dist "
              f"{fmt(dist[-1])} {status} ({time.time() - t:.1f} s)", flush=True)
        rows.append((run["method"], run["lr_key"], run["lr"], dist, gap, status))
    return rows


def study_cell(run: dict, cells: list[tuple[Path, dict]], folder: Path) -> Path:
    """The one cell of the study whose run config has every key of ``run``
    (values and types); anything else is an error naming the run."""
    found = [cell for cell, config in cells
             if all(k in config and config[k] == v and type(config[k]) is type(v)
                    for k, v in run["overrides"].items())]
    if len(found) != 1:
        raise SystemExit(f"[bench] {run['name']}: {len(found)} cells of {folder} have its run config "
                         "(fedaccel-sweep configs/studies/fedpm-test1.yaml makes one each)")
    return found[0]


def grid_from_study(runs: list[dict], folder: Path, prob: dict, rounds: int) -> tuple[list[tuple], float]:
    """The grid's rows from a study's cells (``fedaccel-sweep
    configs/studies/fedpm-test1.yaml``): round 0 from each cell's
    ``config.json`` (``resolved.optimum``: start-dist, start-gap), rounds
    1..R from ``metrics.jsonl`` (``dist``, ``gap``); a cell that did not
    finish is ``failed`` with its error. Also the cells' seconds, summed.
    Refuses a study whose optimum or start is not this script's problem."""
    cells = [(cell, json.loads((cell / "config.json").read_text()))
             for cell in sorted((folder / "cells").iterdir()) if (cell / "config.json").is_file()]
    rows, seconds = [], 0.0
    for run in runs:
        cell = study_cell(run, cells, folder)
        resolved = json.loads((cell / "config.json").read_text())["resolved"]
        optimum = resolved["optimum"]
        if optimum["f-star"] != prob["f_star"] or optimum["start-dist"] != prob["start_dist"]:
            raise SystemExit(f"[bench] {cell}: F* {optimum['f-star']!r} and ||w0 - w*|| {optimum['start-dist']!r} "
                             f"are not this script's ({prob['f_star']!r}, {prob['start_dist']!r})")
        if resolved["partition-sizes"] != [len(ys) for _, ys in prob["shards"]]:
            raise SystemExit(f"[bench] {cell}: client sizes {resolved['partition-sizes']} are not this script's")
        metrics = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]
        nan = float("nan")
        dist = [optimum["start-dist"]] + [nan if r.get("dist") is None else r["dist"] for r in metrics]
        gap = [optimum["start-gap"]] + [nan if r.get("gap") is None else r["gap"] for r in metrics]
        status_file = json.loads((cell / "status.json").read_text())
        status = "ok" if status_file["state"] == "finished" else f"{status_file['state']}: {status_file['error']}"
        if status == "ok" and not all(math.isfinite(v) for v in dist + gap):
            status = "diverged"
        while len(dist) < rounds + 1:
            dist.append(nan)
            gap.append(nan)
        if (cell / "summary.json").is_file():
            seconds += json.loads((cell / "summary.json").read_text())["total_seconds"]
        rows.append((run["method"], run["lr_key"], run["lr"], dist[:rounds + 1], gap[:rounds + 1], status))
    return rows, seconds


def keep_best(grid_rows: list[tuple], rounds: int) -> OrderedDict:
    """Per method, the lr with the smallest final gap (runs not ``ok`` skipped)."""
    kept: OrderedDict = OrderedDict()
    for label in METHODS:
        best = None
        for method, lr_key, lr, dist, gap, status in grid_rows:
            if method != label:
                continue
            if status == "ok" and math.isfinite(gap[-1]) and (best is None or gap[-1] < best[3][-1]):
                best = (lr_key, lr, dist, gap)
        nan = [float("nan")] * (rounds + 1)
        kept[label] = best if best is not None else (METHODS[label][2], float("nan"), nan, nan)
    return kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--out", default="bench/results/fedpm")
    parser.add_argument("--phase", choices=["run", "table"], default="run",
                        help="run: the grid on this script's runtime; table: the tables from --from-study")
    parser.add_argument("--from-study", type=Path, default=None, metavar="FOLDER",
                        help="with --phase table: a study folder of fedaccel-sweep configs/studies/fedpm-test1.yaml")
    args = parser.parse_args(argv)
    if (args.phase == "table") != (args.from_study is not None):
        parser.error("--phase table takes its runs from --from-study FOLDER (and --from-study needs --phase table)")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    prob = problem(args.clients)
    shards, x, y = prob["shards"], prob["x"], prob["y"]
    n, f_star, theta_star = len(y), prob["f_star"], prob["theta_star"]
    # SCAFFOLD's server takes the *unweighted* mean over clients: its fixed point
    # with one local step is the minimiser of (1/N) sum_i f_i, a diagnostic.
    theta_unif = newton_optimum([(1.0 / len(shards), s) for s in shards])
    sizes = [len(s[1]) for s in shards]
    ones = [int(s[1].sum()) for s in shards]
    print(f"breast cancer: n={n}, {len(shards)} clients, sizes {sizes}, label-1 counts {ones}")
    print(f"F* = {f_star:.12f}, ||theta*|| = {float(theta_star.norm()):.4f}, "
          f"||theta0 - theta*|| = {prob['start_dist']:.4f}, "
          f"||theta*_unif - theta*|| = {float((theta_unif - theta_star).norm()):.3e}")

    runs = make_runs(args.rounds, args.clients)
    if args.phase == "run":
        grid_rows = run_grid(runs, prob, args.rounds)
        runtime = time.time() - t0
        command = (f"Command: `python bench/fedpm_test1.py --rounds {args.rounds} --clients {args.clients} "
                   f"--out {args.out}` ({runtime:.0f} s on a shared 2-core CPU).")
    else:
        grid_rows, seconds = grid_from_study(runs, args.from_study, prob, args.rounds)
        runtime = time.time() - t0
        command = ("Commands: `fedaccel-sweep configs/studies/fedpm-test1.yaml --workers 1` (the runs: "
                   f"{seconds:.0f} s of rounds in the cells' summaries), then `python bench/fedpm_test1.py "
                   f"--phase table --from-study {args.from_study} --out {args.out}`.")
    kept = keep_best(grid_rows, args.rounds)

    with open(out / "test1.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "round", "dist", "gap"])
        for label, (_, _, dist, gap) in kept.items():
            for r, (d, g) in enumerate(zip(dist, gap)):
                w.writerow([label, r, repr(d), repr(g)])
    with open(out / "test1_grid.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "lr_key", "lr", "status", "round", "dist", "gap"])
        for label, lr_key, lr, dist, gap, status in grid_rows:
            for r, (d, g) in enumerate(zip(dist, gap)):
                w.writerow([label, lr_key, lr, status, r, repr(d), repr(g)])

    # ---- plot
    plot(kept, out / "test1.png", f"Test 1: logistic regression, breast cancer, {len(shards)} label-sorted "
         f"clients, 1 local step, wd={WD:g}")

    # ---- markdown
    lines = [
        command,
        "",
        f"n = {n}, clients {len(shards)}, sizes {sizes}, label-1 counts {ones}; "
        f"F* = {f_star:.12f}; ||w0 - w*|| = {prob['start_dist']:.4f}.",
        "",
        "| method | lr (kept) | rounds to gap < 1e-6 | rounds to gap < 1e-10 | final gap | final dist "
        "| e_{r+1}/e_r, last 3 rounds with e > 1e-12 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, (lr_key, lr, dist, gap) in kept.items():
        ratios = ", ".join(f"{v:.3g}" for v in tail_ratios(dist))
        key = "server lr" if lr_key != "lr" else "lr"
        lines.append(f"| {label} | {key} {lr:g} | {first_below(gap, 1e-6)} | {first_below(gap, 1e-10)} "
                     f"| {fmt(gap[-1])} | {fmt(dist[-1])} | {ratios} |")
    lines += ["", "Learning-rate grid (final gap / final dist after "
              f"{args.rounds} rounds; kept = smallest final gap):", "",
              "| method | grid key | value | final gap | final dist | status |", "|---|---|---|---|---|---|"]
    for label, lr_key, lr, dist, gap, status in grid_rows:
        lines.append(f"| {label} | {lr_key} | {lr:g} | {fmt(gap[-1])} | {fmt(dist[-1])} | {status} |")
    fed = kept["FedPM (exact)"][2]
    lines += ["", "FedPM (exact) distance per round: " + ", ".join(fmt(v) for v in fed[:8]),
              "", "FedPM (exact) e_{r+1}/e_r, rounds 0..6: "
              + ", ".join(f"{b / a:.3g}" for a, b in zip(fed[:7], fed[1:8]) if a > 1e-12)]
    lines += ["", f"||w*_unif - w*|| = {float((theta_unif - theta_star).norm()):.3e} "
              "(w*_unif = argmin (1/N) sum_i f_i, the fixed point of SCAFFOLD's unweighted mean); "
              f"gap F(w*_unif) - F* = {float(objective(theta_unif, x, y)) - f_star:.3e}."]
    (out / "test1.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}/test1.csv, test1_grid.csv, test1.png, test1.md in {runtime:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
