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

# label-sorted: the smallest drawn shard size (the last shard takes the rest)
LABEL_SORTED_MIN_SIZE = 20


def label_sorted_order(labels: np.ndarray, first_feature: np.ndarray) -> np.ndarray:
    """The pool's rows sorted by label, ties by the first input feature's value,
    then by pool order (``np.lexsort``, stable)."""
    return np.lexsort((first_feature, labels))


def label_sorted_sizes(n: int, k: int, alpha: float, seed: int) -> list[int]:
    """Shard sizes of ``label-sorted``: ``n * Dirichlet(alpha, ..., alpha)``
    drawn with ``np.random.default_rng(seed)``, each floored at
    :data:`LABEL_SORTED_MIN_SIZE`, cut at the running sums (clipped to ``n``);
    the last shard takes the rest. Exactly the split of FedPM's Test 1 bench
    script (``bench/fedpm_test1.py``, ``breast_cancer_clients``), so its
    stream is ``default_rng(seed)``, not one of the ``[seed, k]`` streams."""
    draws = np.random.default_rng(seed).dirichlet(np.ones(k) * alpha) * n
    cuts = np.clip(np.cumsum(np.maximum(draws, LABEL_SORTED_MIN_SIZE)).astype(int), 0, n)[:-1]
    return [int(v) for v in np.diff(np.concatenate([[0], cuts, [n]]))]


def partition_pool(labels: np.ndarray, cfg: DataConfig, dataset_name: str,
                   first_feature: np.ndarray | None = None) -> list[np.ndarray]:
    """Indices into the pool for each of ``cfg.num_clients`` clients.

    - ``iid``: ``IidPartitioner`` (contiguous shards; it has no seed, so the
      rows are permuted with the cfg.seed stream first).
    - ``dirichlet``: ``InnerDirichletPartitioner`` with equal client sizes and
      label priors ~ Dir(alpha) per client (as in FedRKMGC / FedACG).
    - ``dirichlet-unbalanced``: ``DirichletPartitioner`` (each class split
      over clients by Dir(alpha); sizes differ), as in GC-Fed / FedCDR.
    - ``label-sorted``: ``SizePartitioner`` (contiguous shards of given
      sizes) over the pool sorted by label (:func:`label_sorted_order`, which
      needs ``first_feature``, each row's first input value), with sizes
      drawn by :func:`label_sorted_sizes`: most clients hold one class
      (FedPM's Test 1 split). flwr-datasets has neither the sort with its
      tie-break nor Dirichlet-drawn sizes, so those two are written here;
      its ``ShardPartitioner`` sorts by label but deals out equal shards.
      A client's indices come in the sorted order (kept for its training
      split: :func:`in_partition_order`).
    """
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        InnerDirichletPartitioner,
        SizePartitioner,
    )

    n, k = len(labels), cfg.num_clients
    scheme = cfg.resolved_partition
    if k > n:
        raise DataError(
            f"{cfg.clients_key}={k} exceeds the {n} training samples of {dataset_name!r}; "
            f"use at most {n} clients (fewer for non-IID partitions)"
        )
    # Dense label codes 0..C-1: InnerDirichletPartitioner assumes them.
    _, codes = np.unique(labels, return_inverse=True)
    idx = np.arange(n, dtype=np.int64)
    if scheme == "iid":
        idx = np.random.default_rng([cfg.seed, STREAM_IID]).permutation(n)
        codes = codes[idx]
    elif scheme == "label-sorted":
        if first_feature is None:  # pragma: no cover - every pooled source passes it
            raise DataError(f"partition='label-sorted' needs the inputs of {dataset_name!r}")
        idx = label_sorted_order(labels, first_feature)
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
    elif scheme == "label-sorted":
        sizes = label_sorted_sizes(n, k, alpha, cfg.seed)
        if min(sizes) < 1:
            fits = next(j for j in range(k - 1, 0, -1) if min(label_sorted_sizes(n, j, alpha, cfg.seed)) >= 1)
            raise DataError(
                f"partition='label-sorted' leaves {sum(s < 1 for s in sizes)} of the {k} clients of "
                f"{dataset_name!r} without samples (every drawn shard but the last takes at least "
                f"{LABEL_SORTED_MIN_SIZE} of the {n} samples); with this seed and dirichlet-alpha the most "
                f"clients that fit is {fits} (the sizes are drawn anew for each number of clients, so not "
                "every smaller number fits), or a larger dirichlet-alpha draws more even sizes")
        part = SizePartitioner(partition_sizes=sizes)
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


def in_partition_order(parts: list[np.ndarray], subsets: list[np.ndarray]) -> list[np.ndarray]:
    """Each client's ``subsets[i]`` (e.g. its training split) in the order its
    rows have in ``parts[i]``: ``label-sorted`` keeps a client's training rows
    sorted, as the shards of FedPM's Test 1 script are (full-batch sums then
    add in the same order: its runs are reproduced bit for bit)."""
    return [part[np.isin(part, subset)] for part, subset in zip(parts, subsets)]


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
