"""What one learner reaches on a federated run's data pooled in one place.

A reference for the accuracy tables: the run's own data (every client's
training rows together), model, loss, optimizer, batch size and test set,
trained by plain minibatch SGD without any federation. No federated method
is expected to beat it by much; where a paper's federated numbers are far
above it on data generated "the same way", the data differ.

    python bench/pooled_reference.py --config configs/fedcdr-table1.yaml --num-clients 500 \\
        --set synthetic.shared-model=true --variants 0,0 1,1 5,5 --seeds 0 1 2 3 4 \\
        --lrs 0.001 0.002 0.01 0.05 --epochs 100 --out bench/results/fedcdr/pooled_reference.jsonl

For each Synthetic-(alpha, beta) variant, seed and lr: the test accuracy
after every ``--eval-every`` epochs; one JSON line per run (the settings,
the final and best accuracy, the curve) appended to ``--out``, and a table
on stdout (the best lr by the mean over seeds of the final accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedaccel.local_run import default_run_config, fuse, load_yaml_config  # noqa: E402
from fedaccel.run_config import parse_run_config  # noqa: E402
from fedaccel.runtime import build_model_for, data_config_for, load_data  # noqa: E402


def base_run_config(config: str | None) -> dict:
    """The project's defaults under the run's YAML config (as ``fedaccel-run --config``)."""
    base = default_run_config()
    return fuse(base, load_yaml_config(config)) if config else base


def run_config(base: dict, overrides: dict) -> object:
    return parse_run_config(fuse(base, overrides))


def pooled_run(cfg, num_clients: int, lr: float, epochs: int, eval_every: int) -> dict:
    """Train the run's model on its pooled training rows; the accuracy on its test set."""
    data = load_data(data_config_for(cfg, num_clients))
    x, y = data.training_rows()
    x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.asarray(y, dtype=np.int64))
    xt, yt = torch.from_numpy(np.ascontiguousarray(data.test_x)), torch.from_numpy(np.asarray(data.test_y, dtype=np.int64))
    torch.manual_seed(cfg.seed)
    model = build_model_for(cfg, data)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    curve = []
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        if epoch % eval_every == 0 or epoch == epochs:
            with torch.no_grad():
                acc = float((model(xt).argmax(1) == yt).float().mean())
            curve.append([epoch, round(100 * acc, 2)])
    return {"train_rows": int(len(y)), "test_rows": int(len(yt)), "curve": curve,
            "final": curve[-1][1], "best": max(a for _, a in curve)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="the run's YAML config (as fedaccel-run --config)")
    p.add_argument("--num-clients", type=int, required=True)
    p.add_argument("--set", nargs="*", default=[], help="key=value overrides (YAML values)")
    p.add_argument("--variants", nargs="*", default=[], help="synthetic alpha,beta pairs, e.g. 0,0 5,5")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--lrs", nargs="+", type=float, default=[0.01])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--out", help="append one JSON line per run here")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the run's arithmetic as on one fast-runner worker; restored below
    try:
        return _run_all(args)
    finally:
        torch.set_num_threads(threads)


def _run_all(args: argparse.Namespace) -> int:
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    variants = [tuple(float(v) for v in pair.split(",")) for pair in args.variants] or [None]
    base = base_run_config(args.config)  # read once for every run
    results = []
    for variant in variants:
        for lr in args.lrs:
            for seed in args.seeds:
                extra = {"seed": seed, "lr": lr}
                if variant is not None:
                    extra.update({"synthetic.alpha": variant[0], "synthetic.beta": variant[1]})
                cfg = run_config(base, {**overrides, **extra})
                start = time.perf_counter()
                record = {"variant": variant, "seed": seed, "lr": lr, "epochs": args.epochs,
                          "batch_size": cfg.batch_size, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                          "num_clients": args.num_clients, "overrides": overrides,
                          **pooled_run(cfg, args.num_clients, lr, args.epochs, args.eval_every)}
                record["seconds"] = round(time.perf_counter() - start, 1)
                print(f"[pooled] {variant} lr {lr} seed {seed}: final {record['final']:.2f} % "
                      f"best {record['best']:.2f} % ({record['train_rows']} training rows, {record['seconds']} s)",
                      flush=True)
                results.append(record)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print("\n| variant | best lr | final (%), mean ± std over seeds | best (%) |\n|---|---:|---:|---:|")
    for variant in variants:
        rows = [r for r in results if r["variant"] == variant]
        by_lr = {lr: [r for r in rows if r["lr"] == lr] for lr in args.lrs}
        lr = max(by_lr, key=lambda k: np.mean([r["final"] for r in by_lr[k]]))
        finals = [r["final"] for r in by_lr[lr]]
        print(f"| {variant} | {lr} | {np.mean(finals):.2f} ± {np.std(finals, ddof=1) if len(finals) > 1 else 0:.2f} "
              f"| {np.mean([r['best'] for r in by_lr[lr]]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
