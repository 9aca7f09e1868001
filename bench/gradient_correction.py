"""Benchmark the gradient-correction family on Fashion-MNIST with a CNN.

FedAvg, SCAFFOLD, FedDyn and FedRKMGC with the ablation rows of the FedRKMGC paper's
Tables 3 and 9 (raw, w Re, w KM, w fast KM, w Re & KM, w Re & fast KM = full), label
Dirichlet 0.3 (every method) and 0.1 (FedAvg, SCAFFOLD, FedDyn, FedRKMGC by default),
100 clients, 10 per round, several seeds. Paper: "FedRKMGC: Towards High-Performance Gradient
Correction-Based Federated Learning via Relaxation and Fast KM Iteration" (anonymous,
under double-blind review, no arXiv id; section 4.4, appendix D.6); local optimizer as in its
section 4.1 (SGD lr 0.01, momentum 0.8, batch 20).

Scale, chosen so the default grid (39 runs) finishes in about an hour on 2 CPU cores:
the ``cnn-small`` model (the McMahan CNN at 16/32 channels and 128 hidden units,
215k parameters), a seeded 20,000-image subset of the training set (200 images per
client, ``train-samples``), 1 local epoch (10 steps) and 80 rounds; the server test set
is the full 10,000 images, evaluated every 5 rounds. ``--model cnn --train-samples 0
--local-epochs 5`` is the paper-sized setting (about 40x slower here).

    python bench/gradient_correction.py --seeds 0 1 2 --jobs 2          # the grid, ~1 h
    python bench/gradient_correction.py --quick --out /tmp/gc-smoke     # smoke run
    python bench/gradient_correction.py --phase table --target 0.7      # re-tabulate only
    python bench/gradient_correction.py --phase table --from-study results/sweeps/fedrkmgc-ablation \
        --out bench/results/gradient_correction/study   # the tables from the study's cells

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

# label -> algorithm overrides; FedRKMGC rows are the paper's Table 9 names
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"algo": "fedavg"},
    "SCAFFOLD": {"algo": "scaffold"},
    # alpha pinned to the value the recorded results ran with (the default is now 0.3)
    "FedDyn": {"algo": "feddyn", "feddyn.alpha": 0.01},
    "FedRKMGC (w Re & fast KM)": {"algo": "fedrkmgc", "fedrkmgc.variant": "full"},
    "raw": {"algo": "fedrkmgc", "fedrkmgc.variant": "raw"},
    "w Re": {"algo": "fedrkmgc", "fedrkmgc.variant": "re"},
    "w KM": {"algo": "fedrkmgc", "fedrkmgc.variant": "km"},
    "w fast KM": {"algo": "fedrkmgc", "fedrkmgc.variant": "fast-km"},
    "w Re & KM": {"algo": "fedrkmgc", "fedrkmgc.variant": "re-km"},
}
MAIN = ["FedAvg", "SCAFFOLD", "FedDyn", "FedRKMGC (w Re & fast KM)"]
ABLATION = ["raw", "w Re", "w KM", "w fast KM", "w Re & KM", "FedRKMGC (w Re & fast KM)"]

ID_KEYS = ("method", "model", "seed", "num-server-rounds", "num-clients", "clients-per-round",
           "local-epochs", "batch-size", "lr", "momentum", "dirichlet-alpha", "eval-every",
           "train-samples")


def make_run(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    ov: dict[str, Any] = {
        "dataset": "fashion-mnist", "model": args.model, "partition": "dirichlet",
        "dirichlet-alpha": alpha, "clients-per-round": args.per_round,
        "local-epochs": args.local_epochs, "batch-size": args.batch_size, "lr": args.lr,
        "momentum": args.momentum, "weight-decay": 0.0, "eval-every": args.eval_every,
        "accl-every": 0, "local-test-fraction": 0.0, "train-samples": args.train_samples,
        "target-accuracy": args.target, "device": args.device, "seed": seed,
        "num-server-rounds": args.rounds,
        "cohort-batching": "off",  # the recorded runs trained one client after another (the default is now 'auto')
    }
    ov.update(METHODS[method])
    ident = {k: ov[k] for k in ID_KEYS if k in ov}
    ident.update({"method": method, "num-clients": args.clients})
    key = json.dumps(ident, sort_keys=True)
    name = runner.run_folder_name(method, f"a{alpha}-s{seed}", key)
    return {"id": ident, "key": key, "name": name, "overrides": ov, "num_clients": args.clients}


def describe(rec: dict[str, Any]) -> str:
    result = (f"FAILED at round {rec['last_round']}: {rec['error']}" if rec.get("error") else
              f"final {100 * rec['final_accg']:.2f}%")
    return f"alpha={rec['dirichlet-alpha']} {rec['method']:26s} seed={rec['seed']}: {result}"


def selected(recs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Records of this invocation's setting (other settings in runs.jsonl are ignored)."""
    want = {k: v for k, v in make_run(args, "FedAvg", 0.0, 0)["id"].items()
            if k not in ("method", "seed", "dirichlet-alpha")}
    return [r for r in recs if all(r.get(k) == v for k, v in want.items())]


def _row(label: str, sel: list[dict[str, Any]], args: argparse.Namespace) -> str:
    failed = [r for r in sel if r.get("error")]
    if failed:
        return f"| {label} | {len(sel)} | failed in round(s) {[r['last_round'] for r in failed]} | | | | |"
    return (f"| {label} | {len(sel)} | {runner.mean_std([r['final_accg'] for r in sel])} | "
            f"{runner.mean_std([runner.mean_last(r) for r in sel])} | "
            f"{runner.rounds_to_cell(sel, args.target)} | {runner.rounds_to_cell(sel, args.target2)} | "
            f"{statistics.fmean(r['total_mb'] for r in sel):.0f} |")


def write_outputs(args: argparse.Namespace) -> None:
    recs = selected(runner.load_records(args.out), args)
    if not recs:
        print("[bench] no runs of this setting to tabulate", flush=True)
        return
    seeds = sorted({r["seed"] for r in recs})
    lines = [
        f"# Gradient correction on Fashion-MNIST ({args.model}, {args.clients} clients, "
        f"{args.per_round} per round, {args.rounds} rounds, seeds {seeds})", "",
        f"Training subset of {args.train_samples or 60000} images ({(args.train_samples or 60000) // args.clients} "
        f"per client, label Dirichlet with equal sizes), local SGD lr {args.lr}, momentum {args.momentum}, "
        f"batch {args.batch_size}, {args.local_epochs} local epoch(s); server test set (10k images) every "
        f"{args.eval_every} rounds. Mean ± std over seeds. Rounds to a target: first evaluated round at or "
        "above it, mean ± std over the seeds that reached it (k of n). 'last 10 rounds': mean of the "
        "evaluations in the last 10 rounds. FedRKMGC beta 0.03, rho 1.5, gamma 500 (paper defaults); "
        "SCAFFOLD server lr 1, control variates from the mean local gradient; FedDyn alpha 0.01.", "",
    ]
    head = ["| method | n | final % | last 10 rounds % | "
            f"rounds to {100 * args.target:.0f}% (k/n) | rounds to {100 * args.target2:.0f}% (k/n) | total MB |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    panels = []
    for alpha in sorted({r["dirichlet-alpha"] for r in recs}, reverse=True):
        at = [r for r in recs if r["dirichlet-alpha"] == alpha]
        for title, methods in ((f"Dirichlet {alpha}: baselines", MAIN),
                               (f"Dirichlet {alpha}: FedRKMGC ablation (Tables 3/9)", ABLATION)):
            rows = [(m, [r for r in at if r["method"] == m]) for m in methods]
            rows = [(m, sel) for m, sel in rows if sel]
            if len(rows) < 2:
                continue
            lines += [f"## {title}", "", *head, *(_row(m, sel, args) for m, sel in rows), ""]
            panels.append((title, rows))
    secs = [r["seconds"] for r in recs]
    lines += [f"{len(recs)} runs, {sum(secs) / 60:.1f} process-minutes (mean {statistics.fmean(secs):.0f} s "
              f"per run, {args.jobs} at a time on 2 shared CPU cores).", ""]
    (args.out / "table.md").write_text("\n".join(lines))
    plot(panels, args.out / "curves.png")
    print(f"[bench] wrote {args.out / 'table.md'} and curves.png", flush=True)


def plot(panels: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]], path: Path) -> None:
    """Two panels a row; a series' failed runs are left out of its curve."""
    plots.plot_panels([(title, [plots.mean_series(label, [r for r in sel if not r.get("error")])
                                for label, sel in series]) for title, series in panels],
                      path, ncols=2, linestyles=plots.LINESTYLES)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["run", "table"], default="run")
    p.add_argument("--model", default="cnn-small")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--train-samples", type=int, default=20000, help="0 = all 60,000")
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.8)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.1])
    p.add_argument("--ablation-alphas", type=float, nargs="*", default=[0.3],
                   help="alphas at which the FedRKMGC ablation rows run (the baselines run at every alpha)")
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--target2", type=float, default=0.75)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gradient_correction")
    p.add_argument("--run-dir", type=Path, default=Path("/tmp/gradient_correction_runs"))
    p.add_argument("--quick", action="store_true", help="smoke run: 20 clients, 4 rounds, 1 seed")
    p.add_argument("--from-study", type=Path, default=None,
                   help="with --phase table: take the runs from this study folder (fedaccel-sweep "
                        "configs/studies/fedrkmgc-ablation.yaml) and write them as --out/runs.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.per_round, args.rounds, args.seeds = 20, 4, 4, [0]
        args.train_samples, args.eval_every = 2000, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # seed by seed, so a run cut short still has complete seeds
    jobs = [make_run(args, m, alpha, seed) for seed in args.seeds for alpha in args.alphas
            for m in (MAIN + [a for a in ABLATION if a not in MAIN]
                      if alpha in args.ablation_alphas else MAIN)]
    if args.phase == "run":
        runner.execute(jobs, args.out, args.run_dir, args.jobs, describe)
    elif args.from_study is not None:
        runner.save_records_from_study(jobs, args.from_study, args.out)
    write_outputs(args)
    print(f"[bench] done in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
