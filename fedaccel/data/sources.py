"""Dataset sources: the FedProx synthetic generator and loaders for real data.

Every loader returns a :class:`Source`: a training *pool* (partitioned among
clients later) and a fixed global test set. Image pools are kept as ``uint8``
and normalised per client in :meth:`Source.transform`, which keeps CIFAR's
50k-image pool at 150 MB instead of 600 MB per worker process.
"""

from __future__ import annotations

import gzip
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import DataConfig, DataError

ENV_DATA_DIR = "FEDACCEL_DATA_DIR"

# Usual normalisation constants (pixel values scaled to [0, 1] first).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

DEFAULT_DIRS = {
    "fashion-mnist": "/usr/share/datasets/fashion-mnist",  # Debian dataset-fashion-mnist
    "mnist": "~/.cache/fedaccel/mnist",
    "cifar10": "~/.cache/fedaccel/cifar",
    "cifar100": "~/.cache/fedaccel/cifar",
}

# Seed of the digits train/test holdout: fixed so every run shares one test set.
DIGITS_TEST_SEED = 0
DIGITS_TEST_FRACTION = 0.2


@dataclass
class Source:
    """A training pool plus a fixed global test set."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    augment: bool
    pool_x: np.ndarray  # raw storage (float32 or uint8), shape (N, *input_shape)
    pool_y: np.ndarray  # int64
    test_x: np.ndarray  # normalised, in the run's precision (float32 or float64)
    test_y: np.ndarray  # int64
    transform: Callable[[np.ndarray], np.ndarray]  # raw rows -> normalised, in the run's precision


def _as_dtype(dtype: np.dtype = np.dtype(np.float32)):
    """Rows already normalised, in ``dtype`` (a copy only when the dtype changes)."""
    def f(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=dtype)

    return f


def _scalar_norm(mean: float, std: float, scale: float = 255.0, dtype: np.dtype = np.dtype(np.float32)):
    def f(x: np.ndarray) -> np.ndarray:
        out = x.astype(dtype)
        out *= dtype.type(1.0 / scale)
        out -= dtype.type(mean)
        out /= dtype.type(std)
        return out

    return f


def _channel_norm(mean: tuple[float, ...], std: tuple[float, ...], dtype: np.dtype = np.dtype(np.float32)):
    m = np.asarray(mean, dtype=dtype).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=dtype).reshape(1, -1, 1, 1)

    def f(x: np.ndarray) -> np.ndarray:
        out = x.astype(dtype)
        out *= dtype.type(1.0 / 255.0)
        out -= m
        out /= s
        return out

    return f


def resolve_dir(cfg: DataConfig) -> Path:
    """The directory to read ``cfg.dataset`` from.

    ``data_dir`` if set, else ``$FEDACCEL_DATA_DIR/<dataset>`` if that variable
    is set, else the dataset's default directory.
    """
    if cfg.data_dir:
        return Path(cfg.data_dir).expanduser()
    env = os.environ.get(ENV_DATA_DIR, "")
    if env:
        return Path(env).expanduser() / cfg.dataset
    return Path(DEFAULT_DIRS[cfg.dataset]).expanduser()


# --------------------------------------------------------------------------
# Synthetic-(alpha, beta)
# --------------------------------------------------------------------------

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10


def generate_synthetic(
    num_users: int,
    alpha: float,
    beta: float,
    iid: bool,
    max_samples: int,
    rng: np.random.Generator,
    size_mu: float,
    min_samples: int,
    dtype: np.dtype = np.dtype(np.float32),
    shared_model: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """FedProx's Synthetic-(alpha, beta) data, one (x, y) pair per user.

    Port of ``generate_synthetic.py`` of the FedProx repository (Li et al.,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020; also the
    setup of FedCDR's appendix G.1), with these changes:
    a numpy ``Generator`` instead of the global RNG; per-user sample counts
    clipped to ``max_samples``; x drawn as ``mean + N(0, 1) * sqrt(diag)``
    (same distribution as ``multivariate_normal`` with the diagonal
    covariance, much faster); in the IID variant ``mean_x = 0`` (FedProx
    writes ``B[i]``, which is 0 in its synthetic_iid run where beta = 0).
    Sizes are ``LogNormal(size_mu, 2) + min_samples`` clipped to
    ``max_samples``: FedProx uses (4, 50, no clip); FedCDR appendix G.1 uses
    (2, 10, 50). ``x`` is drawn in float64 and returned in ``dtype``.

    The client models: FedProx's code draws each client's ``W_k ~ N(u_k, 1)``
    and ``b_k ~ N(u_k, 1)`` with no common part (``shared_model=False``).
    FedCDR's appendix G.1 writes ``W_k - W ~ N(u_k, 1)`` and
    ``b_k - b ~ N(u_k, 1)`` around one model ``(W, b)`` that every client
    shares (``shared_model=True``); the paper does not say how ``W`` and ``b``
    are drawn, so they are ``N(0, 1)`` like the IID variant's model, drawn
    after the feature means so that ``shared_model=False`` data is unchanged.
    """
    d, c = SYNTHETIC_DIM, SYNTHETIC_CLASSES
    # clipped before the cast as well: a draw beyond int64 (a huge size_mu) would wrap to a negative size;
    # below max_samples the cast truncates the same value, at or above it the size is max_samples either way
    sizes = np.minimum(rng.lognormal(size_mu, 2, num_users), max_samples).astype(np.int64) + min_samples
    sizes = np.minimum(sizes, max_samples)
    mean_w = rng.normal(0.0, alpha, num_users)
    mean_b = mean_w
    big_b = rng.normal(0.0, beta, num_users)
    sqrt_diag = np.power(np.arange(1, d + 1, dtype=np.float64), -1.2) ** 0.5
    if iid:
        mean_x = np.zeros((num_users, d))
        w_global = rng.normal(0.0, 1.0, (d, c))
        b_global = rng.normal(0.0, 1.0, c)
    else:
        mean_x = np.stack([rng.normal(big_b[i], 1.0, d) for i in range(num_users)])
        if shared_model:
            w_shared = rng.normal(0.0, 1.0, (d, c))
            b_shared = rng.normal(0.0, 1.0, c)
    xs, ys = [], []
    for i in range(num_users):
        if iid:
            w, b = w_global, b_global
        else:
            w = rng.normal(mean_w[i], 1.0, (d, c))
            b = rng.normal(mean_b[i], 1.0, c)
            if shared_model:
                w, b = w_shared + w, b_shared + b
        x = mean_x[i] + rng.standard_normal((int(sizes[i]), d)) * sqrt_diag
        # argmax(softmax(z)) == argmax(z)
        y = np.argmax(x @ w + b, axis=1).astype(np.int64)
        xs.append(x.astype(dtype))  # drawn in float64
        ys.append(y)
    return xs, ys


# --------------------------------------------------------------------------
# digits (scikit-learn, bundled)
# --------------------------------------------------------------------------


def load_digits_source(dtype: np.dtype = np.dtype(np.float32)) -> Source:
    """sklearn's 8x8 digits (1797 samples) with a fixed stratified 20% test set,
    scaled and standardised in ``dtype``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data.astype(dtype) / 16.0).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, stratify=y, random_state=DIGITS_TEST_SEED
    )
    mean, std = float(x_tr.mean()), float(x_tr.std())
    x_tr = ((x_tr - mean) / std).astype(dtype)
    x_te = ((x_te - mean) / std).astype(dtype)
    return Source("digits", 10, (1, 8, 8), False, x_tr, y_tr, x_te, y_te, _as_dtype(dtype))


# --------------------------------------------------------------------------
# breast cancer (scikit-learn, bundled)
# --------------------------------------------------------------------------

BREAST_CANCER_FEATURES = 30


def load_breast_cancer_source(dtype: np.dtype = np.dtype(np.float32)) -> Source:
    """sklearn's Wisconsin breast-cancer data: 569 samples, 30 features, 2 classes.

    Each feature is standardised over all 569 samples in float64
    (``(x - mean) / std``, population std), then given in ``dtype``. There is
    no held-out test set: the pool is every sample, and the global test set
    is the same 569 samples (the problem FedPM's Test 1 runs is the
    optimisation of the training objective; ``accg`` is training accuracy)."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)  # float64, as bench/fedpm_test1.py
    pool_x = np.asarray(x, dtype=dtype)
    pool_y = np.asarray(y, dtype=np.int64)
    return Source("breast-cancer", 2, (BREAST_CANCER_FEATURES,), False, pool_x, pool_y,
                  pool_x.copy(), pool_y.copy(), _as_dtype(dtype))


# --------------------------------------------------------------------------
# MNIST / Fashion-MNIST (IDX files)
# --------------------------------------------------------------------------

IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_TORCHVISION_NAMES = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (optionally gzipped) into a numpy array.

    Hand-written: the format is a 4-byte magic number (0, 0, type code,
    number of dims), big-endian uint32 dims, then the raw values; no
    well-kept library available offline reads it without torchvision.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read IDX file {path}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = raw[2], raw[3]
    if code not in dtypes or ndim < 1:
        raise DataError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    header = 4 + 4 * ndim
    dims = tuple(int(v) for v in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dt = np.dtype(dtypes[code])
    if len(raw) - header != int(np.prod(dims)) * dt.itemsize:
        raise DataError(
            f"{path} is truncated or corrupt: header says {dims}, "
            f"found {len(raw) - header} data bytes"
        )
    arr = np.frombuffer(raw, dtype=dt, offset=header).reshape(dims)
    return arr.astype(dt.newbyteorder("="), copy=True) if dt.itemsize > 1 else arr.copy()


def _find_idx(directory: Path, dataset: str, stem: str) -> Path | None:
    candidates = [directory, directory / dataset]
    if dataset in _TORCHVISION_NAMES:
        candidates.append(directory / _TORCHVISION_NAMES[dataset] / "raw")
    for d in candidates:
        for name in (stem + ".gz", stem):
            if (d / name).is_file():
                return d / name
    return None


def load_idx_source(cfg: DataConfig) -> Source:
    """MNIST or Fashion-MNIST from the standard IDX files (gz or plain)."""
    directory = resolve_dir(cfg)
    arrays = {}
    for key, stem in IDX_FILES.items():
        path = _find_idx(directory, cfg.dataset, stem)
        if path is None:
            hint = (
                "install it with `apt-get install dataset-fashion-mnist` (Debian) or set "
                "data-dir to a folder holding the four IDX files"
                if cfg.dataset == "fashion-mnist"
                else "set data-dir to a folder holding the four IDX files"
            )
            raise DataError(
                f"{cfg.dataset} file {directory / (stem + '.gz')} (or {stem}) not found "
                f"in directory {directory} (data-dir={cfg.data_dir!r}); {hint}"
            )
        arrays[key] = read_idx(path)
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or len(x) != len(y):
            raise DataError(
                f"{cfg.dataset} {split} IDX files in {directory} have unexpected shapes "
                f"images {x.shape}, labels {y.shape}; expected (N, 28, 28) and (N,)"
            )
        if len(y) and int(y.max()) >= 10:
            raise DataError(
                f"{cfg.dataset} {split} labels in {directory} reach {int(y.max())}; "
                "expected classes 0..9"
            )
    mean, std = (FASHION_MEAN, FASHION_STD) if cfg.dataset == "fashion-mnist" else (
        MNIST_MEAN, MNIST_STD)
    tf = _scalar_norm(mean, std, dtype=cfg.dtype)
    pool_x = arrays["train_x"].astype(np.uint8, copy=False).reshape(-1, 1, 28, 28)
    test_x = tf(arrays["test_x"].reshape(-1, 1, 28, 28))
    return Source(
        cfg.dataset, 10, (1, 28, 28), False,
        pool_x, arrays["train_y"].astype(np.int64), test_x,
        arrays["test_y"].astype(np.int64), tf,
    )


# --------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickle versions)
# --------------------------------------------------------------------------

CIFAR_LAYOUT = {
    # dataset: (folder, train files, test files, label key)
    "cifar10": (
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        b"labels",
    ),
    "cifar100": ("cifar-100-python", ("train",), ("test",), b"fine_labels"),
}


def _cifar_folder(directory: Path, dataset: str) -> Path | None:
    folder, train, test, _ = CIFAR_LAYOUT[dataset]
    for d in (directory / folder, directory, directory / dataset / folder):
        if all((d / f).is_file() for f in train + test):
            return d
    return None


def _try_download_cifar(directory: Path, dataset: str) -> str:
    """Download with torchvision if it is installed; returns an error note or ""."""
    try:
        import torchvision  # noqa: F401  (optional dependency)
        from torchvision import datasets as tvd

        cls = tvd.CIFAR10 if dataset == "cifar10" else tvd.CIFAR100
        directory.mkdir(parents=True, exist_ok=True)
        cls(root=str(directory), train=True, download=True)
        cls(root=str(directory), train=False, download=True)
        return ""
    except ImportError:
        return "torchvision is not installed, so no download was tried"
    except Exception as e:  # network, disk, checksum...
        return f"download with torchvision failed ({type(e).__name__}: {e})".replace("\n", " ")


def _read_cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    # The CIFAR "python version" is a pickle of a dict with bytes keys; pickle
    # is the format's own encoding (files come from a local, user-chosen dir).
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        x = np.asarray(d[b"data"], dtype=np.uint8)
        y = np.asarray(d[label_key], dtype=np.int64)
    except Exception as e:
        raise DataError(f"cannot read CIFAR file {path}: {type(e).__name__}: {e}") from e
    if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
        raise DataError(
            f"CIFAR file {path} has data of shape {x.shape} and {len(y)} labels; "
            "expected (N, 3072) and N labels"
        )
    return x.reshape(-1, 3, 32, 32), y


def load_cifar_source(cfg: DataConfig) -> Source:
    """CIFAR-10/100 from the standard python-pickle batches."""
    directory = resolve_dir(cfg)
    folder, train, test, label_key = CIFAR_LAYOUT[cfg.dataset]
    found = _cifar_folder(directory, cfg.dataset)
    if found is None:
        note = _try_download_cifar(directory, cfg.dataset)
        found = _cifar_folder(directory, cfg.dataset)
        if found is None:
            raise DataError(
                f"{cfg.dataset} files {', '.join(train + test)} not found in directory "
                f"{directory / folder} or {directory} (data-dir={cfg.data_dir!r}); "
                f"{note}; put the python version of {cfg.dataset} ({folder}/) there "
                "or set data-dir to where it is"
            )
    parts = [_read_cifar_batch(found / f, label_key) for f in train]
    pool_x = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    pool_y = np.concatenate([p[1] for p in parts])
    test_x, test_y = _read_cifar_batch(found / test[0], label_key)
    n_classes = 10 if cfg.dataset == "cifar10" else 100
    for name, y in (("train", pool_y), ("test", test_y)):
        if len(y) and (y.min() < 0 or y.max() >= n_classes):
            raise DataError(
                f"{cfg.dataset} {name} labels in {found} fall outside [0, {n_classes})"
            )
    mean, std = (CIFAR10_MEAN, CIFAR10_STD) if cfg.dataset == "cifar10" else (
        CIFAR100_MEAN, CIFAR100_STD)
    tf = _channel_norm(mean, std, dtype=cfg.dtype)
    return Source(
        cfg.dataset, n_classes, (3, 32, 32), True, pool_x, pool_y, tf(test_x), test_y, tf
    )
