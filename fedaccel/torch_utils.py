"""Small torch helpers shared by the server and every local solver."""

from __future__ import annotations

import hashlib
import platform

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from fedaccel.arrays import payload_size, tensors_to_record
from fedaccel.config import config_error


def require_visible_device(name: str) -> None:
    """``device='cuda'`` where this process sees no GPU: a :class:`ConfigError`
    (what :func:`select_device` refuses, checked alone by ``fedaccel-run --check``)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise config_error("device", name, "no CUDA device is visible here; use 'auto' or 'cpu'")


def select_device(name: str, tf32: bool = False) -> torch.device:
    """``auto`` picks CUDA when a GPU is visible to this process, else CPU.

    On CUDA it also sets whether convolutions (cuDNN) and matrix products may
    round their inputs to TF32 (``tf32``; this process's torch flags). PyTorch's
    own default lets cuDNN use it and not matrix products; fedaccel's default
    is IEEE float32 for both, so that a float32 run means the same on a GPU as
    on a CPU: on an H200, one batched round of the McMahan CNN differed from
    the same round client by client by up to 1.6e-3 with cuDNN's TF32 and
    7.3e-5 without (docs/cohort-batching-measurements.md, "Measured on a GPU")."""
    require_visible_device(name)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return device


def environment(device: torch.device) -> dict[str, str | int]:
    """What a run's numbers depend on beyond its config and seed: library
    versions, the CPU's vector instruction set that torch dispatches to, the
    CPU model and torch's thread count (float sums are split across threads),
    and the GPU when the run uses one. The same seed gives the same bits where
    these are the same; elsewhere the last bits may differ and grow over a
    long run (docs/measurements.md)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    out: dict[str, str | int] = {
        "python": platform.python_version(), "torch": torch.__version__, "numpy": version("numpy"),
        "flwr": version("flwr"), "torch-threads": torch.get_num_threads(),
        "cpu-capability": torch.backends.cpu.get_cpu_capability(), "cpu": _cpu_model(),
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["tf32"] = " and ".join(name for name, on in (("convolutions", torch.backends.cudnn.allow_tf32),
                                                         ("matrix products", torch.backends.cuda.matmul.allow_tf32))
                                   if on) or "off"
    return out


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from parts (run seed, round, partition id, purpose).

    Python's ``hash`` is salted per process, so it cannot be used: the same
    client must draw the same batches in Ray workers and in the fast runner.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(*parts: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`derive_seed`."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(*parts))
    return gen


def state_to_arrays(model: torch.nn.Module) -> ArrayRecord:
    """The model's state dict as an ArrayRecord (copied to CPU)."""
    return tensors_to_record(model.state_dict())


def payload_bytes(arrays: ArrayRecord) -> int:
    """Serialized size of an ArrayRecord's arrays: what actually crosses the wire."""
    return sum(payload_size(a) for a in arrays.values())


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 2048,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (a fraction) of ``model`` on (x, y)."""
    n = int(y.shape[0])
    if n == 0:
        return float("nan"), float("nan")
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, n, batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        logits = model(xb)
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return loss_sum / n, correct / n
