"""FedPM paper, Test 2: second-order FL with a CNN on Fashion-MNIST.

FedPM (FOOF-preconditioned local steps, preconditioned mixing on the server) against
LocalNewton (the same local steps, plain mixing) and the first-order baselines FedAvg,
FedAvgM, SCAFFOLD and FedAdam (FedProx with ``--methods``), at label-Dirichlet 1.0 and
0.1. Paper: "FedPM: Federated Learning Using Second-order Optimization with Preconditioned
Mixing of Local Parameters" (Ishii, Niwa, Sawada, Fujino, Harada, Yokota, 2025,
arXiv:2511.09100), section 4.2 and appendix C.3 (Tables 4-13); implementation:
docs/fedpm.md.

The paper's Test 2 is CIFAR10 with a simple CNN and CIFAR100 with ResNet-18 (GroupNorm),
Dirichlet 1.0 / 0.1 with unequal client sizes, no client sampling in the main tables,
batch 64, weight decay 1e-4 for most methods, FOOF matrices once per round on the full
local set (appendix D.4: 64-1024 samples did not hurt on CIFAR10), damping 1.0 (1e-4 to
1 tried), gradient clipping for some methods; tuned learning rates 0.05-0.3 for the
first-order methods and 0.3-0.5 for LocalNewton/FedPM (a preconditioned step
``G (A + damping I)^-1`` is never longer than the plain gradient, so its good lr is
larger). Deviations here, to fit a 2-core CPU: Fashion-MNIST with the ``cnn-small``
model (McMahan CNN at 16/32 channels, 128 hidden units, 215k parameters; FOOF matrices
of size 26, 401, 1569 and 129, i.e. a FedPM client uploads 5.3 MB of preconditioners
beside the 0.86 MB model), a seeded 20,000-image training subset split equally over 100
clients (``partition=dirichlet``; ``--partition dirichlet-unbalanced`` gives unequal
sizes as in the paper), 10 clients per round, 1 local epoch at batch 20 (10 local
steps), 30 rounds, FOOF on 64 of each client's 200 samples, no gradient clipping
(``clip-norm=0`` pinned for every method unless the method sets it: the grid was run
before the project had clipping) and FedPM uploading the FOOF matrices recomputed at the
end of local training (``fedpm.upload='end'`` pinned: the project's ``auto`` is now
``used``, one FOOF pass per round). "FedPM (clip 1.0)" clips at 1.0 (the paper's value
for FedPM in most of its tuned settings); "FedPM (clip 1.0, used)" also uploads the matrix
it stepped with (the project's defaults). The server test set is the full 10,000 images,
every 5 rounds.

Cost (measured in one process, one torch thread, 200 samples and 10 steps per client):
FedAvg 0.11 s per client, LocalNewton 0.60 s, FedPM 0.72 s (1.25 s with FOOF on all 200
samples) plus 0.7-0.8 s per round for the server's preconditioned mixing of 10 replies;
i.e. a round of 10 clients costs about 1.1 s (FedAvg), 6 s (LocalNewton) and 8 s
(FedPM; 13 s with all samples), on top of ~4 s per server evaluation and ~16 s start-up
per run. The client side is FOOF matrices at the start (and, for FedPM's upload, the end)
of local training and a float64 Cholesky solve with fc1's 1569x1569 factor every step.
Hence 30 rounds and 64 FOOF samples: the default grid (2 alphas x 7 methods x 2 seeds =
28 runs, ~55 process-minutes) is estimated at 25-30 minutes with ``--jobs 2`` on 2 idle
cores.

Learning rates and method settings are in ``METHODS`` (one lr per method, the same at
both alphas): first-order methods SGD lr 0.05, no momentum; FedAvgM server momentum 0.9
(the paper's usual value), FedAdam server lr 0.01 (project default; the paper's tuned
values are 0.01-0.05), SCAFFOLD server lr 1 (as in the paper); LocalNewton and FedPM lr
0.3, damping 1.0, one preconditioner per round. ``--phase lr`` runs a short sweep (seed
0, ``--lr-rounds`` rounds, ``--lr-alphas``) of FedAvg, LocalNewton and FedPM over
``LR_GRID`` to check those choices.

    python bench/fedpm_test2.py --jobs 2                               # the grid, ~25-30 min
    python bench/fedpm_test2.py --phase lr --jobs 2                    # lr check, ~10 min
    python bench/fedpm_test2.py --quick --out /tmp/fedpm2-smoke        # smoke run
    python bench/fedpm_test2.py --phase table                          # re-tabulate only

Every finished run appends one JSON line to ``<out>/runs.jsonl`` and is skipped when the
script runs again (resumable); ``table.md`` and ``curves.png`` are rewritten at the end.
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
import runner  # bench/runner.py: resumable parallel fast-runner runs and summaries

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FOOF_SAMPLES = 64  # per client and preconditioner (0 = all local samples, the paper's main setting)

# label -> run-config overrides (each method carries its own lr)
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"algo": "fedavg", "lr": 0.05},
    "FedAvg (lr 0.1)": {"algo": "fedavg", "lr": 0.1},  # the paper's usual first-order lr
    "FedAvgM": {"algo": "fedavgm", "lr": 0.05, "fedavgm.server-lr": 1.0,
                "fedavgm.server-momentum": 0.9},
    "SCAFFOLD": {"algo": "scaffold", "lr": 0.05, "scaffold.server-lr": 1.0},
    "FedAdam": {"algo": "fedadam", "lr": 0.05, "fedadam.server-lr": 0.01},
    "FedProx": {"algo": "fedprox", "lr": 0.05, "fedprox.mu": 0.001},
    "LocalNewton": {"algo": "localnewton", "lr": 0.3, "localnewton.damping": 1.0,
                    "localnewton.foof-samples": FOOF_SAMPLES, "localnewton.refresh-every": 0},
    "FedPM": {"algo": "fedpm", "lr": 0.3, "fedpm.damping": 1.0, "fedpm.foof-samples": FOOF_SAMPLES,
              "fedpm.refresh-every": 0},
    # the lower end of the paper's tuned range, for settings where lr 0.3 diverges
    "FedPM (lr 0.1)": {"algo": "fedpm", "lr": 0.1, "fedpm.damping": 1.0, "fedpm.foof-samples": FOOF_SAMPLES,
                       "fedpm.refresh-every": 0},
    "LocalNewton (lr 0.1)": {"algo": "localnewton", "lr": 0.1, "localnewton.damping": 1.0,
                             "localnewton.foof-samples": FOOF_SAMPLES, "localnewton.refresh-every": 0},
    # gradient clipping at the paper's 1.0 (FedPM diverged at alpha 0.1, lr 0.3 without it)
    "FedPM (clip 1.0)": {"algo": "fedpm", "lr": 0.3, "fedpm.damping": 1.0,
                         "fedpm.foof-samples": FOOF_SAMPLES, "fedpm.refresh-every": 0,
                         "clip-norm": 1.0},
    "FedPM (clip 1.0, used)": {"algo": "fedpm", "lr": 0.3, "fedpm.damping": 1.0,
                               "fedpm.foof-samples": FOOF_SAMPLES, "fedpm.refresh-every": 0,
                               "clip-norm": 1.0, "fedpm.upload": "used"},
}
DEFAULT_METHODS = ["FedAvg", "FedAvg (lr 0.1)", "FedAvgM", "SCAFFOLD", "FedAdam", "LocalNewton", "FedPM"]
LR_GRID: dict[str, list[float]] = {  # --phase lr
    "FedAvg": [0.025, 0.05, 0.1, 0.2],
    "LocalNewton": [0.1, 0.3, 0.5],
    "FedPM": [0.1, 0.3, 0.5],
}

ID_KEYS = ("model", "seed", "num-server-rounds", "clients-per-round", "local-epochs",
           "batch-size", "momentum", "weight-decay", "dirichlet-alpha", "partition",
           "eval-every", "train-samples")


def make_run(args: argparse.Namespace, method: str, alpha: float, seed: int,
             phase: str = "main", lr: float | None = None) -> dict[str, Any]:
    rounds = args.lr_rounds if phase == "lr" else args.rounds
    ov: dict[str, Any] = {
        "dataset": "fashion-mnist", "model": args.model, "partition": args.partition,
        "dirichlet-alpha": alpha, "clients-per-round": args.per_round,
        "local-epochs": args.local_epochs, "batch-size": args.batch_size, "momentum": 0.0,
        "weight-decay": args.weight_decay, "eval-every": args.eval_every, "accl-every": 0,
        "local-test-fraction": 0.0, "train-samples": args.train_samples,
        "target-accuracy": args.target, "device": args.device, "seed": seed,
        "num-server-rounds": rounds,
        # Pinned to what the recorded grid ran with (no clipping; FedPM uploads FOOF
        # recomputed at the end), now that the project's defaults differ (clip-norm 'auto'
        # = 1.0 for fedpm/localnewton, fedpm.upload 'auto' = 'used'). Not part of a run's
        # identity unless the method sets them itself.
        "clip-norm": 0,
        "cohort-batching": "off",  # the recorded grid trained one client after another (the default is now 'auto')
    }
    if METHODS[method]["algo"] == "fedpm":
        ov["fedpm.upload"] = "end"
    if METHODS[method]["algo"] == "fedadam":
        ov["fedadam.variant"] = "flower"  # the rule the recorded grid ran (the default is now 'paper')
    ov.update(METHODS[method])
    if lr is not None:
        ov["lr"] = lr
    # identity: the shared setting plus every override of the method (lr, damping, ...)
    ident = {k: ov[k] for k in ID_KEYS}
    ident.update({k: ov[k] for k in METHODS[method]})
    ident.update({"lr": ov["lr"], "method": method, "num-clients": args.clients, "phase": phase})
    key = json.dumps(ident, sort_keys=True)
    name = runner.run_folder_name(method, f"a{alpha}-s{seed}-lr{ov['lr']}", key)
    return {"id": ident, "key": key, "name": name, "overrides": ov, "num_clients": args.clients}


def describe(rec: dict[str, Any]) -> str:
    result = (f"FAILED at round {rec['last_round']}: {rec['error']}" if rec.get("error") else
              f"final {100 * rec['final_accg']:.2f}%, total {rec['total_mb']:.0f} MB")
    return (f"{rec['phase']:4s} alpha={rec['dirichlet-alpha']} {rec['method']:11s} lr={rec['lr']} "
            f"seed={rec['seed']}: {result}")


def selected(recs: list[dict[str, Any]], args: argparse.Namespace, phase: str) -> list[dict[str, Any]]:
    """Records of this invocation's setting: the key a run of the record's method, alpha,
    seed (and lr in the lr phase) would have now; other settings in runs.jsonl are ignored."""
    out = []
    for r in recs:
        if r.get("phase") != phase or r.get("method") not in METHODS:
            continue
        job = make_run(args, r["method"], r["dirichlet-alpha"], r["seed"], phase,
                       r["lr"] if phase == "lr" else None)
        if job["key"] == r["key"]:
            out.append(r)
    return out


def round_seconds(rec: dict[str, Any]) -> float | None:
    """Median seconds of the rounds without a server evaluation (client training, upload,
    aggregation), read from the run folder when it still exists."""
    path = Path(rec.get("run_folder") or "") / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    secs = [r["seconds"] for r in rows if r.get("accg") is None and r.get("seconds") is not None]
    return statistics.median(secs) if secs else None


def _seconds_cell(sel: list[dict[str, Any]]) -> str:
    per_round = [s for s in map(round_seconds, sel) if s is not None]
    rs = f"{statistics.fmean(per_round):.2f}" if per_round else "-"
    return f"{rs} | {statistics.fmean(r['seconds'] for r in sel):.0f}"


def _row(label: str, sel: list[dict[str, Any]], args: argparse.Namespace) -> str:
    failed = [r for r in sel if r.get("error")]
    if failed:
        best = max((a for r in sel for _, a in r["accg_curve"]), default=0.0)
        return (f"| {label} | {len(sel)} | failed in round(s) {[(r['last_round'] or 0) + 1 for r in failed]} "
                f"(best before: {100 * best:.2f}) | - | {runner.rounds_to_cell(sel, args.target)} | "
                f"{runner.rounds_to_cell(sel, args.target2)} | - | {_seconds_cell(sel)} |")
    return (f"| {label} | {len(sel)} | {runner.mean_std([r['final_accg'] for r in sel])} | "
            f"{runner.mean_std([runner.mean_last(r) for r in sel])} | "
            f"{runner.rounds_to_cell(sel, args.target)} | {runner.rounds_to_cell(sel, args.target2)} | "
            f"{statistics.fmean(r['total_mb'] for r in sel):.0f} | {_seconds_cell(sel)} |")


def _lr_table(lrs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = ["## Learning-rate check (seed 0)", "",
             f"{args.lr_rounds} rounds, otherwise the setting above. * = the lr in METHODS "
             "(used by the main grid).", "",
             "| alpha | method | lr | final % | best % | last 10 rounds % | "
             f"rounds to {100 * args.target:.0f}% | rounds to {100 * args.target2:.0f}% |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for alpha in sorted({r["dirichlet-alpha"] for r in lrs}, reverse=True):
        for m in METHODS:
            for r in sorted((r for r in lrs if r["method"] == m and r["dirichlet-alpha"] == alpha),
                            key=lambda x: x["lr"]):
                star = "*" if r["lr"] == METHODS[m]["lr"] else ""
                if r.get("error"):
                    lines.append(f"| {alpha} | {m} | {r['lr']}{star} | failed in round "
                                 f"{(r['last_round'] or 0) + 1} | | | | |")
                    continue
                lines.append(f"| {alpha} | {m} | {r['lr']}{star} | {100 * r['final_accg']:.2f} | "
                             f"{100 * r['best_accg']:.2f} | {100 * runner.mean_last(r):.2f} | "
                             f"{runner.rounds_to(r, args.target) or '-'} | "
                             f"{runner.rounds_to(r, args.target2) or '-'} |")
    return lines + [""]


def write_outputs(args: argparse.Namespace) -> None:
    recs = runner.load_records(args.out)
    main, lrs = selected(recs, args, "main"), selected(recs, args, "lr")
    if not main and not lrs:
        print("[bench] no runs of this setting to tabulate", flush=True)
        return
    seeds = sorted({r["seed"] for r in main})
    n_train = args.train_samples or 60000
    settings = "; ".join(f"{m}: " + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in ov.items() if k != "algo")
                         for m, ov in METHODS.items() if m in {r["method"] for r in main + lrs})
    lines = [
        f"# FedPM Test 2 on Fashion-MNIST ({args.model}, {args.clients} clients, {args.per_round} per "
        f"round, " + (f"{args.rounds} rounds, seeds {seeds})" if main else "learning-rate check only)"), "",
        f"Training subset of {n_train} images ({n_train // args.clients} per client on average, "
        f"partition `{args.partition}`), {args.local_epochs} local epoch(s) at batch {args.batch_size}, "
        f"local momentum 0, weight decay {args.weight_decay}; server test set (10k images) every "
        f"{args.eval_every} rounds. Per method: {settings}. LocalNewton/FedPM: one FOOF preconditioner "
        "per round on `foof-samples` local samples (0 = all) at the received model; no gradient "
        "clipping unless the method says `clip-norm`; FedPM uploads its upper triangles "
        "recomputed at the end of local training (`fedpm.upload='end'`) unless it says `upload`.", "",
        "Mean ± std over seeds. Rounds to a target: first evaluated round at or above it, mean ± std "
        "over the seeds that reached it (k of n). 'last 10 rounds': mean of the evaluations in the "
        "last 10 rounds. Total MB: up + down over the run. s/round: median seconds of the rounds "
        "without a server evaluation (local training + aggregation; '-' once the run folders are "
        "gone); s/run: wall time of the whole run incl. start-up and evaluations. Both are on 2 CPU "
        "cores shared with other runs (the load varied), so they compare methods only roughly; "
        "bench/overhead.py measures cost on a quiet machine.", "",
    ]
    head = ["| method | n | final % | last 10 rounds % | "
            f"rounds to {100 * args.target:.0f}% (k/n) | rounds to {100 * args.target2:.0f}% (k/n) | "
            "total MB | s/round | s/run |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    panels = []
    for alpha in sorted({r["dirichlet-alpha"] for r in main}, reverse=True):
        rows = [(m, [r for r in main if r["dirichlet-alpha"] == alpha and r["method"] == m])
                for m in METHODS]
        rows = [(m, sel) for m, sel in rows if sel]
        lines += [f"## Dirichlet {alpha}", "", *head, *(_row(m, sel, args) for m, sel in rows), ""]
        panels.append((f"Dirichlet {alpha}", rows))
    if lrs:
        lines += _lr_table(lrs, args)
    if main:
        secs = [r["seconds"] for r in main]
        lines += [f"{len(main)} runs in the main grid, {sum(secs) / 60:.1f} process-minutes "
                  f"(mean {statistics.fmean(secs):.0f} s per run).", ""]
    (args.out / "table.md").write_text("\n".join(lines))
    if panels:
        plot(panels, args.out / "curves.png")
    print(f"[bench] wrote {args.out / 'table.md'}" + (" and curves.png" if panels else ""), flush=True)


def plot(panels: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]], path: Path) -> None:
    """Top row: accuracy per round, one panel per alpha; bottom row: the same against the
    cumulative traffic (MB, up + down; every round of a method moves the same bytes)."""
    top, bottom = [], []
    for title, series in panels:
        by_round, by_mb = [], []
        for label, sel in series:
            ok = [r for r in sel if r["accg_curve"]]
            s = plots.mean_series(label, ok, failed=sum(1 for r in sel if r.get("error")))
            mbs = [r["total_mb"] / r["num-server-rounds"] for r in ok if r.get("total_mb") is not None]
            by_round.append(s)
            by_mb.append((s[0], s[1] * statistics.fmean(mbs), *s[2:]) if mbs else (s[0], [], []))
        top.append((title, by_round))
        bottom.append((title, by_mb))
    plots.plot_panels(top + bottom, path, ncols=len(panels), linestyles=plots.LINESTYLES,
                      xlabel=("round", "cumulative traffic, up + down (MB)"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["run", "lr", "table"], default="run",
                   help="run: the main grid; lr: the lr sweep of LR_GRID; table: only rewrite outputs")
    p.add_argument("--model", default="cnn-small")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--partition", default="dirichlet", choices=["dirichlet", "dirichlet-unbalanced"],
                   help="dirichlet: equal client sizes; dirichlet-unbalanced: sizes differ (the paper's)")
    p.add_argument("--train-samples", type=int, default=20000, help="0 = all 60,000")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=1e-4, help="the paper's usual value")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.1])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    p.add_argument("--lr-alphas", type=float, nargs="+", default=[0.1])
    p.add_argument("--lr-rounds", type=int, default=15)
    p.add_argument("--target", type=float, default=0.75)
    p.add_argument("--target2", type=float, default=0.8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fedpm_test2")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/fedpm_test2_runs"))
    p.add_argument("--from-study", type=Path, default=None,
                   help="with --phase table: take the main phase's runs from this study folder "
                        "(fedaccel-sweep configs/studies/fedpm-test2.yaml) and write them as --out/runs.jsonl")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 20 clients of 200 images, 10 per round (the grid's per-round "
                        "cost), 4 rounds, 1 seed; lr phase: 2 rounds at alpha 0.1")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.seeds, args.eval_every = 20, 4, [0], 2
        args.train_samples, args.lr_rounds, args.lr_alphas = 4000, 2, [0.1]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.phase == "lr":
        jobs = [make_run(args, m, alpha, 0, "lr", lr) for alpha in args.lr_alphas
                for m, grid in LR_GRID.items() for lr in grid]
    else:  # the main grid, seed by seed, so a run cut short still has complete seeds
        jobs = [make_run(args, m, alpha, seed) for seed in args.seeds for alpha in args.alphas
                for m in args.methods]
    if args.phase != "table":
        runner.execute(jobs, args.out, args.run_dir, args.jobs, describe)
    elif args.from_study is not None:
        runner.save_records_from_study(jobs, args.from_study, args.out)
    write_outputs(args)
    print(f"[bench] done in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
