"""Which clients train in a round: seeded cohort samplers shared by every algorithm.

Both samplers work on partition ids (0..n-1), never on Flower's random node
ids, so the same seed selects the same clients in every runner.

- ``uniform``: each round, ``C`` clients drawn without replacement,
  independently of other rounds (FedAvg's sampling, seeded).
- ``reshuffle``: client reshuffling (FedCDR, Algorithm 1 lines 3-5): each
  meta-epoch draws a permutation of all ``n`` clients and splits it into
  ``R = ceil(n / C)`` consecutive cohorts, one per round, so every client
  trains exactly once per meta-epoch. When ``C`` does not divide ``n`` the
  last cohort of each meta-epoch is smaller (``n - (R - 1) C`` clients); no
  client is repeated or skipped.
"""

from __future__ import annotations

import math

import numpy as np

from fedaccel.torch_utils import derive_seed

SAMPLERS = ("auto", "uniform", "reshuffle")


def uniform_cohort(seed: int, server_round: int, num_clients: int, size: int) -> list[int]:
    """Seeded sampling without replacement of ``size`` partition ids, sorted."""
    rng = np.random.default_rng(derive_seed(seed, server_round, "cohort"))
    return sorted(int(p) for p in rng.choice(num_clients, size=size, replace=False))


def rounds_per_meta_epoch(num_clients: int, size: int) -> int:
    """R = ceil(n / C): rounds needed for every client to train once."""
    return math.ceil(num_clients / size)


def reshuffled_cohorts(seed: int, meta_epoch: int, num_clients: int, size: int) -> list[list[int]]:
    """The cohorts of one meta-epoch: a seeded permutation of all clients split
    into consecutive chunks of ``size`` (the last one shorter if needed)."""
    rng = np.random.default_rng(derive_seed(seed, meta_epoch, "reshuffle"))
    order = rng.permutation(num_clients)
    return [sorted(int(p) for p in order[i:i + size]) for i in range(0, num_clients, size)]


def reshuffle_cohort(seed: int, server_round: int, num_clients: int, size: int) -> list[int]:
    """The cohort of ``server_round`` (1-based) under client reshuffling."""
    per_epoch = rounds_per_meta_epoch(num_clients, size)
    meta_epoch, index = divmod(server_round - 1, per_epoch)
    return reshuffled_cohorts(seed, meta_epoch, num_clients, size)[index]


def cohort(sampler: str, seed: int, server_round: int, num_clients: int, size: int) -> list[int]:
    """Dispatch on the sampler name (``auto`` must be resolved by the caller)."""
    if sampler == "uniform":
        return uniform_cohort(seed, server_round, num_clients, size)
    if sampler == "reshuffle":
        return reshuffle_cohort(seed, server_round, num_clients, size)
    raise ValueError(f"unknown sampler {sampler!r}")
