"""Client partitions of a training pool, built with flwr-datasets partitioners."""

from __future__ import annotations

import warnings

import numpy as np

from .config import DataConfig, DataError

# Independent random streams derived from cfg.seed (np.random.default_rng([seed, k])).
STREAM_SYNTHETIC = 1
STREAM_IID = 2
STREAM_LOCAL_SPLIT = 3
STREAM_TRAIN_SUBSET = 4


def partition_pool(labels: np.ndarray, cfg: DataConfig, dataset_name: str) -> list[np.ndarray]:
    """Indices into the pool for each of ``cfg.num_clients`` clients.

    - ``iid``: ``IidPartitioner`` (contiguous shards; it has no seed, so the
      rows are permuted with the cfg.seed stream first).
    - ``dirichlet``: ``InnerDirichletPartitioner`` with equal client sizes and
      label priors ~ Dir(alpha) per client (as in FedRKMGC / FedACG).
    - ``dirichlet-unbalanced``: ``DirichletPartitioner`` (each class split
      over clients by Dir(alpha); sizes differ), as in GC-Fed / FedCDR.
    """
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        InnerDirichletPartitioner,
    )

    n, k = len(labels), cfg.num_clients
    scheme = cfg.resolved_partition
    if k > n:
        raise DataError(
            f"num-clients={k} exceeds the {n} training samples of {dataset_name!r}; "
            f"use at most {n} clients (fewer for non-IID partitions)"
        )
    # Dense label codes 0..C-1: InnerDirichletPartitioner assumes them.
    _, codes = np.unique(labels, return_inverse=True)
    idx = np.arange(n, dtype=np.int64)
    if scheme == "iid":
        idx = np.random.default_rng([cfg.seed, STREAM_IID]).permutation(n)
        codes = codes[idx]
    ds = datasets.Dataset.from_dict({"idx": idx, "label": codes.astype(np.int64)})

    alpha = float(cfg.dirichlet_alpha)
    if scheme == "iid":
        part = IidPartitioner(num_partitions=k)
    elif scheme == "dirichlet":
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        part = InnerDirichletPartitioner(
            partition_sizes=sizes, partition_by="label", alpha=alpha, seed=cfg.seed
        )
    elif scheme == "dirichlet-unbalanced":
        part = DirichletPartitioner(
            num_partitions=k,
            partition_by="label",
            alpha=alpha,
            # A floor keeps every client trainable; min(10, n // k) is always
            # reachable for moderate alpha, and the partitioner gives up
            # (ValueError) after 10 tries instead of looping forever.
            min_partition_size=min(10, n // k),
            self_balancing=False,
            seed=cfg.seed,
        )
    else:  # pragma: no cover - validated by DataConfig
        raise DataError(f"partition={scheme!r} cannot be applied to {dataset_name!r}")
    part.dataset = ds
    out: list[np.ndarray] = []
    try:
        with warnings.catch_warnings():
            # DirichletPartitioner warns on every failed try; we report once.
            warnings.simplefilter("ignore")
            for i in range(k):
                col = part.load_partition(i).with_format("arrow")["idx"]
                out.append(np.asarray(col, dtype=np.int64))
    except ValueError as e:
        need = (f"at least {min(10, n // k)} samples each in 10 Dirichlet draws"
                if scheme == "dirichlet-unbalanced" else "a valid label mix")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"partition={scheme!r} with dirichlet-alpha={cfg.dirichlet_alpha} could not "
            f"give the {k} clients of {dataset_name!r} {need} ({reason}); "
            "use a larger dirichlet-alpha or fewer clients"
        ) from e
    if any(len(o) == 0 for o in out):
        raise DataError(
            f"partition={scheme!r} left a client of {dataset_name!r} without samples; "
            "use a larger dirichlet-alpha or fewer clients"
        )
    return out


def split_local(
    client_indices: list[np.ndarray], fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's indices into (train, local test) with a seeded shuffle.

    ``round(n * fraction)`` samples go to the local test split, capped so that
    every client keeps at least one training sample (a 1-sample client has an
    empty local test split).
    """
    rng = np.random.default_rng([seed, STREAM_LOCAL_SPLIT])
    trains, tests = [], []
    for ind in client_indices:
        n = len(ind)
        n_test = min(int(np.floor(n * fraction + 0.5)), n - 1)
        perm = ind[rng.permutation(n)]
        tests.append(perm[:n_test])
        trains.append(perm[n_test:])
    return trains, tests
