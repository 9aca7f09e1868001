"""A study's final models read on the clients' training rows, beside the test set.

Some federated papers' code reports accuracy on the data the clients
trained on (the FedDC authors' synthetic data set, github.com/gaoliang13/FedDC
``utils_dataset.py``: its test set is every client's data concatenated). This reads each finished cell of a sweep's study
(``fedaccel-sweep``: ``<results-dir>/<study>/cells/*/config.json`` and
``final_model.npz``) on its run's pooled training rows and on its test set,
and reports mean ± std over the cells that differ only in the seed.

    python bench/training_rows_accuracy.py --num-clients 500 \\
        results/sweeps/fedcdr-table1-paper-scale-tuned results/sweeps/fedcdr-table1-paper-scale-fedavg-e5-tuned \\
        --out bench/results/fedcdr/training_rows_accuracy.jsonl

One JSON line per cell appended to ``--out`` (study, cell, seed, training-row
and test accuracy, %); a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedaccel.run_config import parse_run_config  # noqa: E402
from fedaccel.runtime import build_model_for, data_config_for, load_data  # noqa: E402


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.ascontiguousarray(x))).argmax(1).numpy()
    return float(100.0 * np.mean(predicted == np.asarray(y)))


def read_cell(cell: Path, num_clients: int) -> dict | None:
    """The cell's final model on its training rows and its test set; None
    for a cell that left no final model (a run that failed or stopped)."""
    if not (cell / "config.json").is_file() or not (cell / "final_model.npz").is_file():
        return None
    cfg = parse_run_config(json.loads((cell / "config.json").read_text()))
    data = load_data(data_config_for(cfg, num_clients))
    model = build_model_for(cfg, data)
    saved = np.load(cell / "final_model.npz")
    model.load_state_dict({k: torch.from_numpy(saved[k]) for k in saved.files})
    x, y = data.training_rows()
    return {"train": accuracy(model, x, y), "test": accuracy(model, data.test_x, data.test_y), "seed": cfg.seed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="study folders (each with cells/)")
    p.add_argument("--num-clients", type=int, required=True, help="the studies' num-clients")
    p.add_argument("--out", type=Path, help="append one JSON line per cell here")
    args = p.parse_args(argv)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for study in args.studies:
        cells = sorted((study / "cells").glob("*"))
        if not cells:
            print(f"{study}: no cells/ with runs; give a study folder of fedaccel-sweep", file=sys.stderr)
            return 2
        for cell in cells:
            found = read_cell(cell, args.num_clients)
            if found is None:
                continue
            record = {"study": study.name, "cell": cell.name, **found}
            groups[(study.name, re.sub(r",?seed=\d+", "", cell.name))].append(record)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
    print("| study | group | runs | training rows (%) | test set (%) |\n|---|---|---:|---:|---:|")
    for (study, group), records in groups.items():
        train = np.array([r["train"] for r in records])
        test = np.array([r["test"] for r in records])
        spread = lambda a: f" ± {a.std(ddof=1):.2f}" if len(a) > 1 else ""  # noqa: E731
        print(f"| {study} | {group} | {len(records)} | {train.mean():.2f}{spread(train)} | {test.mean():.2f}{spread(test)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
