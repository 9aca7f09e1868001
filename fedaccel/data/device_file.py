"""A real device's own data: one ``.npz`` file named by ``data-path`` in node config.

Format (``np.savez``): ``x`` floats (read as the run's ``precision``) of shape ``(N, *input_shape)``,
preprocessed exactly like the run's ``dataset`` loader (e.g. Fashion-MNIST:
(N, 1, 28, 28), pixels / 255 normalised with mean 0.2860 and std 0.3530 — the
simplest way to get that right is :func:`export_partition`, or
``python -m fedaccel.data.device_file --dataset fashion-mnist --partition-id 3
--num-partitions 10 --out dev3.npz``), and ``y`` integer labels in
``[0, num_classes)``. The device splits it into train and a local test split
(``local-test-fraction``) with the run's seed. The server still evaluates on
the run's ``dataset`` global test set, so shapes and classes must match it.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .config import DataConfig, DataError
from .federated import ClientData

# (input shape, number of classes, train-time augmentation) per dataset.
DATASET_SPECS: dict[str, tuple[tuple[int, ...], int, bool]] = {
    "synthetic": ((60,), 10, False),
    "digits": ((1, 8, 8), 10, False),
    "breast-cancer": ((30,), 2, False),
    "mnist": ((1, 28, 28), 10, False),
    "fashion-mnist": ((1, 28, 28), 10, False),
    "cifar10": ((3, 32, 32), 10, True),
    "cifar100": ((3, 32, 32), 100, True),
}


ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06")  # an .npz is a zip archive (empty or not)


def load_device_file(path: str, dataset: str, local_test_fraction: float, seed: int,
                     dtype: np.dtype = np.dtype(np.float32)) -> ClientData:
    """Read and check a device's ``.npz``; split it into train and local test;
    ``x`` in ``dtype`` (the run's ``precision``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"data-path={path!r}: no such file on this SuperNode; give an .npz with "
                        "arrays x and y (see docs/deployment.md)")
    try:
        with open(file, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise DataError(f"data-path={path!r} cannot be read ({err.strerror or err})") from None
    if head not in ZIP_SIGNATURES:  # np.load would try it as .npy or as a pickle
        what = ("is empty" if not head else "is an .npy file" if head == b"\x93NUM"
                else "is not an .npz file (no zip signature): corrupted or of another format")
        raise DataError(f"data-path={path!r} {what}; give an .npz with arrays x and y "
                        "(np.savez, see docs/deployment.md)")
    try:
        with np.load(file, allow_pickle=False) as npz:
            if "x" not in npz.files or "y" not in npz.files:
                raise DataError(f"data-path={path!r} holds {sorted(npz.files)}; it needs arrays 'x' and 'y'")
            x, y = npz["x"], npz["y"]
    except DataError:
        raise
    except (EOFError, zipfile.BadZipFile, zlib.error) as err:  # truncated or damaged ("Bad CRC-32")
        raise DataError(f"data-path={path!r} is corrupted (truncated or damaged .npz: {err})") from None
    except (OSError, ValueError) as err:
        raise DataError(f"data-path={path!r} is not a readable .npz file ({err})") from None
    shape, classes, _ = DATASET_SPECS[dataset]
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape:
        raise DataError(f"data-path={path!r}: x has shape {tuple(x.shape)}; dataset={dataset!r} "
                        f"needs (N, {', '.join(map(str, shape))})")
    if len(y) != len(x) or len(x) < 1:
        raise DataError(f"data-path={path!r}: x has {len(x)} rows and y {len(y)}; they must match and be >= 1")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes:
        raise DataError(f"data-path={path!r}: y must hold integer labels in [0, {classes})")
    if not np.isfinite(x).all():
        raise DataError(f"data-path={path!r}: x holds NaN or infinite values")
    rng = np.random.default_rng([seed, 7919])
    order = rng.permutation(len(y))
    n_test = min(int(round(len(y) * local_test_fraction)), len(y) - 1)
    test, train = order[:n_test], order[n_test:]
    x, y = x.astype(dtype, copy=False), y.astype(np.int64, copy=False)
    return ClientData(x_train=x[train], y_train=y[train], x_test=x[test], y_test=y[test])


def export_partition(cfg: DataConfig, partition_id: int, out: str) -> Path:
    """Write partition ``partition_id`` of ``cfg`` (train and local test rows
    together) as a device file, preprocessed like the loader."""
    from .federated import load_federated

    part = load_federated(cfg).client(partition_id)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.concatenate([part.x_train, part.x_test]),
             y=np.concatenate([part.y_train, part.y_test]))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export one partition as a device data file (.npz).")
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--partition-id", type=int, required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--partition", default="auto")
    parser.add_argument("--dirichlet-alpha", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        cfg = DataConfig(dataset=args.dataset, num_clients=args.num_partitions, partition=args.partition,
                         dirichlet_alpha=args.dirichlet_alpha, seed=args.seed, data_dir=args.data_dir)
        print(export_partition(cfg, args.partition_id, args.out))
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
