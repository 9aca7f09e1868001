"""How much memory a fast-runner run needs, estimated before anything is built.

``fedaccel-run --num-clients 10000000`` used to run out of memory after three
minutes of generating data. The two costs that grow with the number of
clients are estimated from measurements on this project (numbers below), and a
run that cannot fit in the memory the machine has available is refused at
once with the estimate, the limit and what to change. Image datasets are a
fixed size (at most a few hundred MB) whatever the number of clients, so only
their per-client cost counts. Written by hand: no library estimates this.
"""

from __future__ import annotations

import numpy as np
import torch

from fedaccel.config import RunConfig
from fedaccel.errors import ResourceError

# Measured: peak RSS of fedaccel.runtime.load_data for 20,000 and 100,000
# clients of the default Synthetic-(1,1) was 568 and 567 bytes per sample (x
# drawn in float64, its float32 copy, labels, the train/test split).
SYNTHETIC_BYTES_PER_SAMPLE = 570
# precision='float64' keeps the 60 features in 8 bytes each instead of 4 (not measured: the arithmetic)
FLOAT64_EXTRA_BYTES_PER_SAMPLE = 60 * 4
# Measured: a LocalGrid of 10,000 clients takes 21 MB (Context, node config, RNG state).
CLIENT_BYTES = 2_200
USABLE_FRACTION = 0.9  # of MemAvailable: leave room for torch, the model and the OS


def expected_synthetic_samples(cfg: RunConfig, num_clients: int) -> float:
    """E[samples] of FedProx's synthetic sizes (LogNormal(size-mu, 2) + min-samples,
    clipped to max-samples, fedaccel/data/sources.py), from 200,000 seeded draws."""
    syn = cfg.synthetic
    draws = np.minimum(np.random.default_rng(0).lognormal(syn.size_mu, 2, 200_000), syn.max_samples)  # as the generator
    return float(np.minimum(draws.astype(np.int64) + syn.min_samples, syn.max_samples).mean()) * num_clients


def estimate_bytes(cfg: RunConfig, num_clients: int, client_contexts: bool = True) -> tuple[int, str]:
    """Estimated peak bytes that grow with ``num_clients``, and a breakdown in
    words; ``client_contexts``: the clients live in this process (fast runner)."""
    clients = CLIENT_BYTES * num_clients if client_contexts else 0
    parts = [f"{gib(clients)} for {num_clients:,} client contexts"] if client_contexts else []
    total = clients
    if cfg.dataset == "synthetic":
        samples = expected_synthetic_samples(cfg, num_clients)
        per_sample = SYNTHETIC_BYTES_PER_SAMPLE + (FLOAT64_EXTRA_BYTES_PER_SAMPLE if cfg.precision == "float64" else 0)
        data = int(samples * per_sample)
        total += data
        parts.insert(0, f"{gib(data)} to generate about {samples:,.0f} synthetic samples")
    return total, ", ".join(parts)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes_on(device: torch.device) -> int | None:
    """The memory free for new tensors on ``device``: on a CUDA device the
    GPU's free memory (``torch.cuda.mem_get_info``) plus what PyTorch's
    caching allocator holds unused; elsewhere the host's :func:`available_bytes`.
    None where it cannot be read."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        except RuntimeError:
            return None
    return available_bytes()


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def require_memory(cfg: RunConfig, num_clients: int, client_contexts: bool = True,
                   available: int | None = None) -> None:
    """Refuse, before anything is built, a run whose estimate exceeds
    ``USABLE_FRACTION`` of the memory available (read from the machine unless
    given); no check where the machine does not say."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    need, parts = estimate_bytes(cfg, num_clients, client_contexts)
    if need > USABLE_FRACTION * available:
        raise ResourceError(
            f"{num_clients:,} clients need about {gib(need)} of memory ({parts}), but this machine "
            f"has {gib(available)} available: use fewer clients ("
            + ("lower logical-clients" if cfg.logical_clients else
               "fedaccel-run --num-clients, fedaccel-federations size local-simulation N") + ")"
            + (" or a smaller synthetic.max-samples" if cfg.dataset == "synthetic" else ""))
