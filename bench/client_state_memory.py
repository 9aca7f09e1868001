"""Peak memory of a large stateful federation: FedCDR with 10,000 clients.

Runs the real ServerApp/ClientApp in the fast runner (one process) with the
784-128-10 MLP (101,770 parameters; FedCDR keeps y, x_i and xhat_i per
client: 3 x 407 KB = 1.2 MB) on Fashion-MNIST split IID over the clients
(MNIST has the same shapes; its files cannot be downloaded here), for one
full meta-epoch of reshuffled cohorts so every client ends up holding state.
Records peak resident memory, wall time and the on-disk state size per
``client-state`` backend into ``bench/results/client_state_memory.jsonl``.

    python bench/client_state_memory.py --clients 10000 --per-round 200 --mode disk
    python bench/client_state_memory.py --clients 2000 --per-round 200 --mode context
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One measured run in this process; prints one JSON line."""
    import torch

    from fedaccel.local_run import default_run_config, fuse, run_local

    torch.set_num_threads(1)
    rounds = -(-args.clients // args.per_round)  # one meta-epoch
    state_dir = Path(args.state_dir)
    cfg = fuse(default_run_config(), {
        "algo": "fedcdr", "dataset": "fashion-mnist", "model": "mlp", "partition": "iid",
        "num-server-rounds": rounds, "clients-per-round": args.per_round, "local-epochs": 1,
        "batch-size": 32, "lr": 0.05, "eval-every": max(rounds // 5, 1), "accl-every": 0,
        "local-test-fraction": 0.0, "client-state": args.mode, "state-dir": str(state_dir),
        "results-dir": args.results_dir, "run-name": f"state-{args.mode}-{args.clients}",
    })
    # Measure the state on disk just before the runner deletes it.
    import shutil

    disk_bytes = []
    real_rmtree = shutil.rmtree

    def measuring_rmtree(path, *a, **kw):
        p = Path(path)
        if p.exists():
            disk_bytes.append(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()))
        return real_rmtree(path, *a, **kw)

    shutil.rmtree = measuring_rmtree
    start = time.perf_counter()
    run_dir = run_local(cfg, num_clients=args.clients, quiet=True)
    seconds = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_round = sorted(r["seconds"] for r in rows[1:])
    print(json.dumps({
        "mode": args.mode, "clients": args.clients, "per_round": args.per_round, "rounds": rounds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "state_on_disk_mb": (disk_bytes[0] / 1e6) if disk_bytes else 0.0,
        "seconds_total": round(seconds, 1),
        "seconds_per_round_median": round(per_round[len(per_round) // 2], 3) if per_round else None,
        "seconds_first_round": round(rows[0]["seconds"], 3),
        "final_accg": summary["final_accg"],
    }))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10000)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--mode", choices=("disk", "context", "auto"), default="disk")
    parser.add_argument("--state-dir", default="/tmp/fedaccel-state-bench")
    parser.add_argument("--results-dir", default="/tmp/fedaccel-state-bench-results")
    parser.add_argument("--out", default=str(ROOT / "bench/results/client_state_memory.jsonl"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    # A fresh process per measurement, so peak RSS is this run's alone.
    cmd = [sys.executable, __file__, "--child", "--clients", str(args.clients), "--per-round",
           str(args.per_round), "--mode", args.mode, "--state-dir", args.state_dir,
           "--results-dir", args.results_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return out.returncode
    line = out.stdout.strip().splitlines()[-1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
