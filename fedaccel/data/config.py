"""Data configuration, names and the error type of the `data` package."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

DATASETS: tuple[str, ...] = (
    "synthetic",
    "digits",
    "breast-cancer",
    "fashion-mnist",
    "mnist",
    "cifar10",
    "cifar100",
)
PARTITIONS: tuple[str, ...] = (
    "auto",
    "natural",
    "iid",
    "dirichlet",
    "dirichlet-unbalanced",
    "label-sorted",
)
#: ``precision``: the floating-point type of the data (and of the model and all state)
PRECISIONS: tuple[str, ...] = ("float32", "float64")


class DataError(ValueError):
    """A data configuration or data file problem, with a one-line message.

    Messages name the run-config key as users type it (``dirichlet-alpha``,
    ``data-dir``, ``synthetic.alpha``, ...), the bad value and what is allowed.
    """


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


SYNTHETIC_SPREAD_MAX = 1000.0  # synthetic.alpha and synthetic.beta: standard deviations of the generator's means



def resolve_partition(dataset: str, partition: str) -> str:
    """The partition scheme ``partition`` means for ``dataset``: ``auto`` is
    ``natural`` for synthetic (its data is generated client by client),
    ``dirichlet`` otherwise; any other name is itself."""
    if partition != "auto":
        return partition
    return "natural" if dataset == "synthetic" else "dirichlet"


def partition_available(dataset: str, partition: str) -> bool:
    """Whether ``dataset`` has ``partition``: ``natural`` is synthetic's only
    partition, and only synthetic has it (:class:`DataConfig` refuses the others)."""
    return (resolve_partition(dataset, partition) == "natural") == (dataset == "synthetic")


@dataclass(frozen=True)
class DataConfig:
    """Everything that determines a federated dataset (hashable: used as cache key).

    Validated on construction; the checks that need the data itself (too many
    clients, missing files) happen in :func:`data.load_federated`.
    """

    dataset: str = "synthetic"
    num_clients: int = 20
    # auto = natural for synthetic, dirichlet otherwise
    partition: str = "auto"
    dirichlet_alpha: float = 0.3
    seed: int = 0
    # "" = the dataset's default directory (or $FEDACCEL_DATA_DIR/<dataset>)
    data_dir: str = ""
    # share of each client's samples held out as its local test split; [0, 1)
    local_test_fraction: float = 0.2
    # > 0: a seeded random subset of this many training rows before partitioning
    train_samples: int = 0
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    synthetic_iid: bool = False
    # clip per-client sample counts (FedProx draws lognormal(4, 2) + 50)
    synthetic_max_samples: int = 1000
    # per-client sizes: LogNormal(synthetic_size_mu, 2) + synthetic_min_samples
    synthetic_size_mu: float = 4.0
    synthetic_min_samples: int = 50
    # client models around one shared model (FedCDR appendix G.1) instead of
    # independent ones (FedProx's code); the non-IID generator only
    synthetic_shared_model: bool = False
    # the dtype of every client's and the test set's inputs
    precision: str = "float32"
    # the run-config key that set num_clients (logical-clients on cohort
    # nodes), named by the errors about it
    clients_key: str = "num-clients"

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise DataError(
                f"dataset={self.dataset!r} is unknown; allowed: {', '.join(DATASETS)}"
            )
        if self.partition not in PARTITIONS:
            raise DataError(
                f"partition={self.partition!r} is unknown; allowed: {', '.join(PARTITIONS)}"
            )
        if self.precision not in PRECISIONS:
            raise DataError(
                f"precision={self.precision!r} is unknown; allowed: {', '.join(PRECISIONS)}"
            )
        if not _is_int(self.num_clients) or self.num_clients < 1:
            raise DataError(
                f"{self.clients_key}={self.num_clients!r} is invalid; it must be an integer >= 1"
            )
        if not _is_number(self.dirichlet_alpha) or not math.isfinite(self.dirichlet_alpha) \
                or self.dirichlet_alpha <= 0:
            raise DataError(
                f"dirichlet-alpha={self.dirichlet_alpha!r} is invalid; it must be a "
                "finite number > 0 (small = skewed labels, large = close to IID)"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise DataError(f"seed={self.seed!r} is invalid; it must be an integer >= 0")
        if not isinstance(self.data_dir, str):
            raise DataError(f"data-dir={self.data_dir!r} is invalid; it must be a string path")
        if not _is_number(self.local_test_fraction) \
                or not 0.0 <= self.local_test_fraction < 1.0:
            raise DataError(
                f"local-test-fraction={self.local_test_fraction!r} is invalid; "
                "it must be in [0, 1)"
            )
        if not _is_int(self.train_samples) or self.train_samples < 0:
            raise DataError(
                f"train-samples={self.train_samples!r} is invalid; it must be an integer >= 0 "
                "(0 = the whole training set)"
            )
        if self.dataset == "synthetic" and self.train_samples:
            raise DataError(
                "train-samples only subsamples image datasets; for dataset 'synthetic' set "
                "synthetic.max-samples (and synthetic.size-mu) instead"
            )
        for key, val in (("synthetic.alpha", self.synthetic_alpha),
                         ("synthetic.beta", self.synthetic_beta)):
            if not _is_number(val) or not math.isfinite(val) or not 0 <= val <= SYNTHETIC_SPREAD_MAX:
                raise DataError(f"{key}={val!r} is invalid; it must be a number in [0, {SYNTHETIC_SPREAD_MAX:g}] "
                                "(FedProx's Synthetic-(alpha, beta) uses 0 to 1; far larger spreads overflow the "
                                "generated features and labels)")
        if not isinstance(self.synthetic_iid, (bool, np.bool_)):
            raise DataError(
                f"synthetic.iid={self.synthetic_iid!r} is invalid; it must be true or false"
            )
        if not isinstance(self.synthetic_shared_model, (bool, np.bool_)):
            raise DataError(
                f"synthetic.shared-model={self.synthetic_shared_model!r} is invalid; "
                "it must be true or false"
            )
        if self.synthetic_iid and self.synthetic_shared_model:
            raise DataError(
                "synthetic.shared-model=true applies to the non-IID generator only: with "
                "synthetic.iid=true every client already has the same model; set one of them "
                "to false"
            )
        if not _is_int(self.synthetic_max_samples) or self.synthetic_max_samples < 1:
            raise DataError(
                f"synthetic.max-samples={self.synthetic_max_samples!r} is invalid; "
                "it must be an integer >= 1"
            )
        if not _is_int(self.synthetic_min_samples) or not 1 <= self.synthetic_min_samples <= self.synthetic_max_samples:
            raise DataError(
                f"synthetic.min-samples={self.synthetic_min_samples!r} is invalid; it must be an "
                f"integer in [1, synthetic.max-samples={self.synthetic_max_samples}] (lower "
                "synthetic.min-samples or raise synthetic.max-samples)"
            )
        if not _is_number(self.synthetic_size_mu) or not math.isfinite(self.synthetic_size_mu):
            raise DataError(f"synthetic.size-mu={self.synthetic_size_mu!r} is invalid; it must be a finite number")
        if self.dataset == "synthetic" and not partition_available(self.dataset, self.partition):
            raise DataError(
                f"partition={self.partition!r} is not available for dataset 'synthetic': "
                "its data is generated per client (natural partition); use partition=auto "
                "or natural, and synthetic.iid=true for the IID variant"
            )
        if not partition_available(self.dataset, self.partition):
            raise DataError(
                f"partition='natural' is only available for dataset 'synthetic', not "
                f"{self.dataset!r}; use auto, iid, dirichlet, dirichlet-unbalanced or label-sorted"
            )

        # Normalise numpy / int scalars so equal configs hash equal (cache key).
        for name, kind in (("num_clients", int), ("seed", int), ("synthetic_max_samples", int),
                           ("synthetic_min_samples", int), ("synthetic_size_mu", float), ("train_samples", int),
                           ("dirichlet_alpha", float), ("local_test_fraction", float),
                           ("synthetic_alpha", float), ("synthetic_beta", float),
                           ("synthetic_iid", bool), ("synthetic_shared_model", bool)):
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of ``precision``."""
        return np.dtype(self.precision)

    @property
    def resolved_partition(self) -> str:
        """The partition scheme after resolving ``auto`` (:func:`resolve_partition`)."""
        return resolve_partition(self.dataset, self.partition)
