"""Benchmark FedACG (with its Table 4 ablation rows) and GC-Fed on Fashion-MNIST.

Papers: "Communication-Efficient Federated Learning with Accelerated Client Gradient"
(FedACG; Kim, Kim, Han, CVPR 2024, arXiv:2201.03172; Algorithm 1, Table 4) and "GC-Fed:
Gradient Centralized Federated Learning with Partial Client Participation" (Seo, Catak,
Rong, Hong, Kim, 2025, arXiv:2503.13180; Algorithm 1, Table 7, the
FedACG-with-local-momentum remark). Setting: label Dirichlet 0.1, 5 of 100 clients per
round, rounds to a target and final accuracy.
Every run goes through the fast in-process runner (:func:`fedaccel.local_run.run_local`)
in its own spawned process.

    python bench/fedacg_gcfed.py --phase all --rounds 80 --seeds 0 1 2 --jobs 2
    python bench/fedacg_gcfed.py --quick --out /tmp/fedacg-smoke          # smoke run
    python bench/fedacg_gcfed.py --model cnn ...                          # ~10x slower on CPU

Phases (``--phase``):

- ``lr``: FedAvg at each ``--lrs`` value (seed 0, ``--lr-rounds`` rounds), a sanity check
  of the shared local learning rate (informational; ``--lr`` is what the other phases use).
- ``main``: every method of ``METHODS`` x ``--seeds``.
- ``momentum``: the GC-Fed paper's remark that FedACG degrades with local momentum 0.9:
  FedAvg and FedACG with ``momentum=0.9`` at each ``--momentum-lrs`` (``--momentum-seeds``),
  against their ``momentum=0`` runs of ``main``. A run that fails (every sampled client
  replies non-finite weights) is recorded with ``error`` and its curve up to the failure.
- ``all``: the three in order; ``table``: only rewrite the outputs from ``runs.jsonl``.

Every finished run appends one JSON line to ``<out>/runs.jsonl``; runs already there are
skipped, so an interrupted invocation resumes. At the end ``table.md`` and ``curves.png``
are (re)written from ``runs.jsonl``. Run folders go to ``--run-dir`` (default /tmp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import plots  # bench/plots.py: the curve figures
import runner  # bench/runner.py: resumable parallel fast-runner runs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# label -> algorithm overrides (on top of base_overrides)
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"algo": "fedavg"},
    "FedAvgM (0.85)": {"algo": "fedavgm", "fedavgm.server-momentum": 0.85},
    "FedACG (full)": {"algo": "fedacg"},
    "FedACG no lookahead": {"algo": "fedacg", "fedacg.lookahead": False},
    "FedACG no local reg.": {"algo": "fedacg", "fedacg.local-regularizer": False},
    "FedACG server momentum only": {"algo": "fedacg", "fedacg.lookahead": False,
                                    "fedacg.local-regularizer": False},
    # mu pinned to the value the recorded results ran with (the default is now 0.1)
    "FedProx": {"algo": "fedprox", "fedprox.mu": 0.01},
    "LocalGC": {"algo": "gcfed", "gc.mode": "local"},
    "GlobalGC": {"algo": "gcfed", "gc.mode": "global"},
    "GC-Fed": {"algo": "gcfed"},
    "FedProx+GC-Fed": {"algo": "fedprox", "fedprox.mu": 0.01, "gc.mode": "hybrid"},
}
MOMENTUM_METHODS = ("FedAvg", "FedACG (full)")
GROUPS = {  # curve panels
    "FedAvg / FedAvgM / FedACG and its Table 4 rows": ["FedAvg", "FedAvgM (0.85)", "FedACG (full)",
                                                        "FedACG no lookahead", "FedACG no local reg.",
                                                        "FedACG server momentum only"],
    "Gradient centralization": ["FedAvg", "LocalGC", "GlobalGC", "GC-Fed", "FedProx", "FedProx+GC-Fed"],
}

ID_KEYS = ("phase", "method", "model", "seed", "num-server-rounds", "num-clients", "clients-per-round",
           "local-epochs", "batch-size", "lr", "momentum", "dirichlet-alpha", "eval-every")


# ----------------------------------------------------------------------------- runs

def base_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dataset": "fashion-mnist",
        "model": args.model,
        "partition": "dirichlet",
        "dirichlet-alpha": args.alpha,
        "clients-per-round": args.per_round,
        "local-epochs": args.local_epochs,
        "batch-size": args.batch_size,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "eval-every": args.eval_every,
        "accl-every": 0,
        "target-accuracy": args.target,
        "device": args.device,
        "cohort-batching": "off",  # the recorded runs trained one client after another (the default is now 'auto')
    }


def make_run(args, phase: str, method: str, seed: int, rounds: int, lr: float, momentum: float = 0.0):
    ov = base_overrides(args)
    ov.update(METHODS[method])
    ov.update({"seed": seed, "num-server-rounds": rounds, "lr": lr, "momentum": momentum})
    ident = {k: ov[k] for k in ID_KEYS if k in ov}
    ident.update({"phase": phase, "method": method, "num-clients": args.clients})
    key = run_key(ident)
    name = runner.run_folder_name(method, f"s{seed}", key)
    return {"id": ident, "key": key, "name": name, "overrides": ov, "num_clients": args.clients}


def run_key(ident: dict[str, Any]) -> str:
    """Identity of a run: its config, not the phase that asked for it."""
    return json.dumps({k: ident.get(k) for k in ID_KEYS if k != "phase"}, sort_keys=True)


def describe(rec: dict[str, Any]) -> str:
    """The progress line of a finished run."""
    result = (f"FAILED at round {rec['last_round']}: {rec['error']}" if rec.get("error") else
              f"final {100 * rec['final_accg']:.2f}%, to {rec['target_accuracy']}: {rec['rounds_to_target']}")
    return (f"{rec['phase']:8s} {rec['method']:28s} seed={rec['seed']} lr={rec['lr']} "
            f"mom={rec['momentum']}: {result}")


def execute(jobs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the jobs not yet in runs.jsonl (bench/runner.py); records of all ``jobs``."""
    return runner.execute(jobs, args.out, args.run_dir, args.jobs, describe)


# ----------------------------------------------------------------------------- metrics

mean_last, rounds_to, _ms, _rtt = runner.mean_last, runner.rounds_to, runner.mean_std, runner.rounds_to_cell


def _row(label: str, sel: list[dict[str, Any]], args) -> str:
    failed = [r for r in sel if r.get("error")]
    if failed:  # diverged: no final accuracy
        best = max((a for r in sel for _, a in r["accg_curve"]), default=0.0)
        return (f"| {label} | {len(sel)} | failed: every sampled client replied non-finite weights "
                f"in round {', '.join(str((r['last_round'] or 0) + 1) for r in failed)} | "
                f"{100 * best:.2f} (before) | - | "
                f"{_rtt(sel, args.target)} | {_rtt(sel, args.target2)} | - |")
    return (f"| {label} | {len(sel)} | {_ms([r['final_accg'] for r in sel])} | "
            f"{_ms([r['best_accg'] for r in sel])} | {_ms([mean_last(r) for r in sel])} | "
            f"{_rtt(sel, args.target)} | {_rtt(sel, args.target2)} | "
            f"{statistics.fmean(r['total_mb'] for r in sel):.0f} |")


def write_outputs(args: argparse.Namespace) -> None:
    recs = runner.load_records(args.out)
    main = [r for r in recs if r["phase"] == "main" and r["num-server-rounds"] == args.rounds
            and r["lr"] == args.lr and r["model"] == args.model]
    if not main:
        print("[bench] no main runs to tabulate", flush=True)
        return
    seeds = sorted({r["seed"] for r in main})
    head = ["| method | n | final % | best % | mean last 10 rounds % | "
            f"rounds to {100 * args.target:.0f}% (k/n) | rounds to {100 * args.target2:.0f}% (k/n) | total MB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines = [
        f"# FedACG / GC-Fed on Fashion-MNIST ({args.model}, {args.clients} clients, "
        f"{args.per_round} per round, Dirichlet {args.alpha}, {args.rounds} rounds, seeds {seeds})",
        "",
        f"Local SGD lr {args.lr}, momentum 0 (unless stated), batch {args.batch_size}, "
        f"{args.local_epochs} local epochs, no weight decay; server test set (10k images) every "
        f"{args.eval_every} rounds. Mean ± std over seeds. Rounds to a target: first evaluated round at "
        f"or above it, mean ± std over the seeds that reached it (k of n); granularity {args.eval_every} rounds. "
        "'mean last 10 rounds': mean of the evaluations in the last 10 rounds. Total MB: up + down "
        "over the run (mean over seeds). FedACG lam 0.85, beta 0.01; FedProx mu 0.01; GC-Fed = hybrid "
        "(local GC on feature layers, global GC on the classifier `fc`).",
        "",
        "## Main grid",
        "",
        *head,
    ]
    for m in METHODS:
        sel = [r for r in main if r["method"] == m]
        if sel:
            lines.append(_row(m, sel, args))
    mom = [r for r in recs if r["phase"] == "momentum" and r["num-server-rounds"] == args.rounds
           and r["lr"] in args.momentum_lrs and r["model"] == args.model]
    if mom:
        mseeds = sorted({r["seed"] for r in mom})
        lines += ["", f"## Local momentum 0.9 vs 0 (seeds {mseeds})", "", *head]
        for m in MOMENTUM_METHODS:
            sel = [r for r in main if r["method"] == m and r["seed"] in mseeds]
            if sel:
                lines.append(_row(f"{m}, momentum 0, lr {args.lr}", sel, args))
            for lr in sorted({r["lr"] for r in mom}, reverse=True):
                sel = [r for r in mom if r["method"] == m and r["lr"] == lr]
                if sel:
                    lines.append(_row(f"{m}, momentum 0.9, lr {lr}", sel, args))
    lrs = [r for r in recs if r["phase"] == "lr" and r["model"] == args.model]
    if lrs:
        lines += ["", "## Learning-rate check (FedAvg, seed 0)", "", "| lr | rounds | final % | best % | "
                  f"rounds to {100 * args.target:.0f}% |", "|---:|---:|---:|---:|---:|"]
        for r in sorted(lrs, key=lambda x: x["lr"]):
            lines.append(f"| {r['lr']} | {r['num-server-rounds']} | {100 * r['final_accg']:.2f} | "
                         f"{100 * r['best_accg']:.2f} | {rounds_to(r, args.target) or '-'} |")
    allr = main + mom
    if any(r.get("error") for r in allr):
        lines += ["", "A failed run's curve ends at its last evaluation before the failure (curves.png)."]
    secs = [r["seconds"] for r in allr]
    lines += ["", f"{len(allr)} runs in the tables above, {sum(secs) / 60:.1f} process-minutes in total "
              f"(mean {statistics.fmean(secs):.0f} s per run, {args.jobs} at a time on 2 shared CPU cores).", ""]
    (args.out / "table.md").write_text("\n".join(lines))
    plot_curves(main, mom, args.out / "curves.png")
    print(f"[bench] wrote {args.out / 'table.md'} and curves.png", flush=True)


def plot_curves(main, mom, path: Path) -> None:
    panels = [(t, [(m, [r for r in main if r["method"] == m]) for m in ms]) for t, ms in GROUPS.items()]
    if mom:
        mseeds = {r["seed"] for r in mom}
        series = []
        for m in MOMENTUM_METHODS:
            series.append((f"{m}, mom 0", [r for r in main if r["method"] == m and r["seed"] in mseeds]))
            for lr in sorted({r["lr"] for r in mom}, reverse=True):
                series.append((f"{m}, mom 0.9 lr {lr}", [r for r in mom if r["method"] == m and r["lr"] == lr]))
        panels.append(("Local momentum 0 vs 0.9", series))
    panels = [(title, [plots.mean_series(label, sel) for label, sel in series]) for title, series in panels]
    plots.plot_panels(panels, path, panel_size=(6, 4.2), linestyles=plots.LINESTYLES, ylim=(30, None))


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["lr", "main", "momentum", "all", "table"], default="all")
    p.add_argument("--model", default="mlp200", help="mlp200 (784-200-200-10) or cnn (~10x slower on CPU)")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=5, help="clients per round")
    p.add_argument("--alpha", type=float, default=0.1, help="label-Dirichlet concentration")
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--lr-rounds", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--target2", type=float, default=0.8, help="second target, computed from the curves")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--momentum-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--momentum-lrs", type=float, nargs="+", default=[0.05, 0.005],
                   help="lr of the momentum-0.9 runs (0.005 x 1/(1-0.9) = the same effective step as 0.05)")
    p.add_argument("--methods", nargs="+", default=None, help="subset of METHODS labels (default all)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fedacg_gcfed")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/fedacg_gcfed_runs"))
    p.add_argument("--quick", action="store_true", help="smoke run: 20 clients, 6 rounds, 1 seed")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.lr_rounds, args.seeds, args.eval_every = 20, 6, 4, [0], 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    methods = args.methods or list(METHODS)
    if args.phase in ("lr", "all"):
        execute([make_run(args, "lr", "FedAvg", 0, args.lr_rounds, lr) for lr in args.lrs], args)
    # Order: the first seed of the main grid, the momentum check, then the other seeds, so a run
    # cut short by a time budget still has one complete seed and the momentum rows.
    main_jobs = [make_run(args, "main", m, s, args.rounds, args.lr) for s in args.seeds for m in methods]
    jobs = main_jobs[:len(methods)] if args.phase in ("main", "all") else []
    if args.phase in ("momentum", "all"):
        jobs += [make_run(args, "main", m, s, args.rounds, args.lr) for s in args.momentum_seeds
                 for m in MOMENTUM_METHODS]
        jobs += [make_run(args, "momentum", m, s, args.rounds, lr, momentum=0.9)
                 for lr in args.momentum_lrs for s in args.momentum_seeds for m in MOMENTUM_METHODS]
    if args.phase in ("main", "all"):
        jobs += main_jobs[len(methods):]
    if jobs:
        execute(jobs, args)
    write_outputs(args)
    print(f"[bench] done in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
