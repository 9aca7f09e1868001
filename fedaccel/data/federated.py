"""The federated dataset object and its cached constructor."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

import numpy as np

from .config import DataConfig, DataError
from .partition import STREAM_SYNTHETIC, STREAM_TRAIN_SUBSET, in_partition_order, partition_pool, split_local
from .sources import (
    SYNTHETIC_CLASSES,
    SYNTHETIC_DIM,
    Source,
    _as_dtype,
    generate_synthetic,
    load_breast_cancer_source,
    load_cifar_source,
    load_digits_source,
    load_idx_source,
)


@dataclass(frozen=True)
class ClientData:
    """One client's local data: x (N, *input_shape) in the run's precision
    (float32 or float64), y int64 (N,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


class FederatedDataset:
    """A training pool split among clients, plus a fixed global test set.

    The pool is stored once; :meth:`client` gathers a client's rows through
    its index arrays (and normalises image pools, which are kept as uint8).
    """

    def __init__(
        self,
        source: Source,
        train_idx: list[np.ndarray],
        test_idx: list[np.ndarray],
        config: DataConfig,
    ) -> None:
        self.name: str = source.name
        self.num_classes: int = source.num_classes
        self.input_shape: tuple[int, ...] = tuple(source.input_shape)
        self.augment: bool = source.augment
        self.num_clients: int = len(train_idx)
        self.test_x: np.ndarray = source.test_x
        self.test_y: np.ndarray = source.test_y
        self.config = config
        self._pool_x = source.pool_x
        self._pool_y = source.pool_y
        self._transform = source.transform
        self._train_idx = train_idx
        self._test_idx = test_idx
        for arr in (self._pool_x, self._pool_y):
            arr.setflags(write=False)  # shared by every caller of the cache

    def _check(self, i: int) -> int:
        try:
            i = operator.index(i)
        except TypeError:
            raise DataError(f"client id {i!r} is not an integer") from None
        if not 0 <= i < self.num_clients:
            raise DataError(
                f"client id {i} is out of range for {self.name!r} with "
                f"{self.num_clients} clients; use 0..{self.num_clients - 1}"
            )
        return i

    def client(self, i: int) -> ClientData:
        """Client ``i``'s train and local test split (fresh arrays)."""
        i = self._check(i)
        tr, te = self._train_idx[i], self._test_idx[i]
        return ClientData(
            x_train=self._transform(self._pool_x[tr]),
            y_train=self._pool_y[tr],
            x_test=self._transform(self._pool_x[te]),
            y_test=self._pool_y[te],
        )

    def training_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every client's training samples together, in pool order: the data
        the federation's sample-weighted objective is the mean over (the
        clients' local test splits left out)."""
        rows = np.sort(np.concatenate(self._train_idx))
        return self._transform(self._pool_x[rows]), self._pool_y[rows]

    def train_sizes(self) -> list[int]:
        """Each client's training samples (``len(client(i).y_train)``)."""
        return [len(a) for a in self._train_idx]

    def partition_sizes(self) -> list[int]:
        """Total samples per client (train + local test)."""
        return [len(a) + len(b) for a, b in zip(self._train_idx, self._test_idx)]

    def label_histograms(self) -> np.ndarray:
        """(num_clients, num_classes) label counts of all samples of each client."""
        hist = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        for i, (a, b) in enumerate(zip(self._train_idx, self._test_idx)):
            y = self._pool_y[np.concatenate([a, b])]
            hist[i] = np.bincount(y, minlength=self.num_classes)[: self.num_classes]
        return hist

    def __repr__(self) -> str:
        sizes = self.partition_sizes()
        return (
            f"FederatedDataset({self.name!r}, clients={self.num_clients}, "
            f"partition={self.config.resolved_partition!r}, samples={sum(sizes)} "
            f"(min {min(sizes)}, max {max(sizes)}), test={len(self.test_y)})"
        )


def _synthetic(cfg: DataConfig) -> FederatedDataset:
    rng = np.random.default_rng([cfg.seed, STREAM_SYNTHETIC])
    xs, ys = generate_synthetic(
        cfg.num_clients,
        float(cfg.synthetic_alpha),
        float(cfg.synthetic_beta),
        cfg.synthetic_iid,
        cfg.synthetic_max_samples,
        rng,
        size_mu=float(cfg.synthetic_size_mu),
        min_samples=int(cfg.synthetic_min_samples),
        dtype=cfg.dtype,
        shared_model=cfg.synthetic_shared_model,
    )
    offsets = np.cumsum([0] + [len(y) for y in ys])
    users = [np.arange(offsets[i], offsets[i + 1]) for i in range(cfg.num_clients)]
    train_idx, test_idx = split_local(users, cfg.local_test_fraction, cfg.seed)
    pool_x = np.concatenate(xs)
    pool_y = np.concatenate(ys)
    # FedProx evaluates on the users' held-out samples; the global test set is
    # their union, so it is fixed for a seed.
    all_test = np.concatenate(test_idx)
    if len(all_test) == 0:
        fraction = cfg.local_test_fraction
        # a client's local test split is round(n * fraction) of its n samples, at most n - 1
        fix = ("use a local-test-fraction in (0, 1)" if not 0 < fraction < 1 else
               f"give the clients at least {max(2, math.ceil(0.5 / fraction - 1e-9))} samples "
               "(synthetic.min-samples, synthetic.max-samples) or raise local-test-fraction")
        raise DataError(
            f"local-test-fraction={fraction} leaves dataset 'synthetic' without a test set: its "
            "global test set is the union of the clients' local test splits, and none of the "
            f"{cfg.num_clients} clients (the largest has {max(len(y) for y in ys)} samples) gets a "
            f"test sample; {fix}"
        )
    source = Source(
        "synthetic", SYNTHETIC_CLASSES, (SYNTHETIC_DIM,), False,
        pool_x, pool_y, pool_x[all_test], pool_y[all_test], _as_dtype(cfg.dtype),
    )
    return FederatedDataset(source, train_idx, test_idx, cfg)


def _subsample(source: Source, cfg: DataConfig) -> Source:
    """``train-samples``: a seeded random subset of the training pool (kept in pool order)."""
    n = len(source.pool_y)
    if cfg.train_samples > n:
        raise DataError(
            f"train-samples={cfg.train_samples} exceeds the {n} training samples of "
            f"{source.name!r}; use at most {n}, or 0 for all"
        )
    rows = np.sort(np.random.default_rng([cfg.seed, STREAM_TRAIN_SUBSET]).choice(
        n, size=cfg.train_samples, replace=False))
    return dataclasses.replace(source, pool_x=source.pool_x[rows], pool_y=source.pool_y[rows])


@functools.lru_cache(maxsize=8)
def load_federated(cfg: DataConfig) -> FederatedDataset:
    """Build (once per process and config) the federated dataset ``cfg`` describes.

    Deterministic: the same config gives identical arrays. Raises
    :class:`DataError` for impossible settings or missing files.
    """
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"load_federated expects a DataConfig, got {type(cfg).__name__}")
    if cfg.dataset == "synthetic":
        return _synthetic(cfg)
    if cfg.dataset == "digits":
        source = load_digits_source(cfg.dtype)
    elif cfg.dataset == "breast-cancer":
        source = load_breast_cancer_source(cfg.dtype)
    elif cfg.dataset in ("mnist", "fashion-mnist"):
        source = load_idx_source(cfg)
    elif cfg.dataset in ("cifar10", "cifar100"):
        source = load_cifar_source(cfg)
    else:  # pragma: no cover - validated by DataConfig
        raise DataError(f"dataset={cfg.dataset!r} is unknown")
    if cfg.train_samples:
        source = _subsample(source, cfg)
    first = source.pool_x.reshape(len(source.pool_x), -1)[:, 0] if cfg.resolved_partition == "label-sorted" else None
    parts = partition_pool(source.pool_y, cfg, source.name, first_feature=first)
    train_idx, test_idx = split_local(parts, cfg.local_test_fraction, cfg.seed)
    if cfg.resolved_partition == "label-sorted":
        train_idx = in_partition_order(parts, train_idx)
    return FederatedDataset(source, train_idx, test_idx, cfg)
