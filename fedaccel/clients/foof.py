"""FOOF statistics and the per-layer matrix algebra shared by FedPM and LocalNewton.

FOOF ("Gradient Descent on Neurons and its Link to Approximate Second-order
Optimization", Frederik Benzing, ICML 2022), as FedPM uses it ("FedPM:
Federated Learning Using Second-order Optimization with Preconditioned Mixing
of Local Parameters", Ishii et al., 2025, arXiv:2511.09100, section 3.3),
approximates each layer's block of the Fisher matrix by the uncentered
covariance of the layer's *input*::

    A = mean_a (a a^T)

- ``nn.Linear``: ``a`` is one input row (leading dimensions flattened);
- ``nn.Conv2d``: ``a`` is one unfolded input patch
  (``torch.nn.functional.unfold`` with the layer's kernel, stride, padding and
  dilation: ``C_in * kh * kw`` values, channel-major, which is the order of
  ``weight.reshape(out, -1)``); the mean runs over every patch of every
  sample (``B * L`` rows);
- a layer with a bias gets a constant 1 appended to ``a``, so ``A`` has
  ``in + 1`` rows and the bias is the last column of the layer's weight
  matrix ``W~ = [W | b]`` of shape ``(out, in + 1)``.

The local FOOF step is ``W~ <- W~ - lr * G~ (A + damping I)^-1`` (FedPM's
eq. (11); the server's mixing, eq. (12), is in
:mod:`fedaccel.strategies.preconditioned_mixing`); every solve goes through a Cholesky
factor, never an explicit inverse. How often ``A`` is computed is the
solver's choice (:mod:`fedaccel.clients.fedpm`: once per round by default).

Symmetric matrices travel as their upper triangle (:func:`pack_upper`,
``d (d + 1) / 2`` values instead of ``d^2``).

Grouped convolutions, non-zero padding modes and string paddings
(``'same'``) are not preconditioned (they keep the plain gradient); the
project's models have none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------- layers
def supported(module: nn.Module) -> bool:
    """Layers that get a FOOF preconditioner."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, nn.Conv2d):
        return (module.groups == 1 and module.padding_mode == "zeros"
                and not isinstance(module.padding, str))
    return False


def foof_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module name, module) of every preconditioned layer, in definition order."""
    for name, module in model.named_modules():
        if supported(module):
            yield name, module


def input_dim(module: nn.Module) -> int:
    """Size of ``A`` for a layer: inputs (or patch size) + 1 if it has a bias."""
    cols = module.weight[0].numel()
    return cols + (1 if module.bias is not None else 0)


def input_rows(module: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """The layer input as rows ``a`` (bias column appended): shape (rows, input_dim)."""
    if isinstance(module, nn.Conv2d):
        patches = F.unfold(inp, module.kernel_size, dilation=module.dilation,
                           padding=module.padding, stride=module.stride)  # (B, C*kh*kw, L)
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        rows = inp.reshape(-1, inp.shape[-1])
    if module.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


@torch.no_grad()
def compute_foof(model: nn.Module, x: torch.Tensor, batch_size: int = 128) -> OrderedDict[str, torch.Tensor]:
    """FOOF matrix ``A = mean(a a^T)`` (float64) of every supported layer on inputs ``x``.

    One forward pass in chunks of ``batch_size``; each chunk's ``R^T R`` is a
    matmul in the model's dtype, chunks are summed in float64, then divided
    by the number of rows (samples, or samples x patch positions for a
    convolution).
    """
    layers = list(foof_layers(model))
    sums = {name: None for name, _ in layers}
    counts = {name: 0 for name, _ in layers}
    handles = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            rows = input_rows(module, args[0].detach())
            ata = (rows.T @ rows).to(torch.float64)  # model dtype product, float64 sum
            sums[name] = ata if sums[name] is None else sums[name] + ata
            counts[name] += rows.shape[0]
        return hook

    for name, module in layers:
        handles.append(module.register_forward_hook(hook_for(name)))
    was_training = model.training
    model.eval()  # no dropout/batch-stat updates while measuring (the models have none)
    try:
        for start in range(0, int(x.shape[0]), batch_size):
            model(x[start:start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return OrderedDict((name, sums[name] / max(counts[name], 1)) for name, _ in layers)


# ------------------------------------------------- weight matrix views
def weight_matrix(module: nn.Module, grad: bool = False) -> torch.Tensor:
    """``[W | b]`` (or its gradient) as an ``(out, input_dim)`` matrix (a copy)."""
    w = module.weight.grad if grad else module.weight.detach()
    mat = w.reshape(w.shape[0], -1)
    if module.bias is not None:
        b = module.bias.grad if grad else module.bias.detach()
        mat = torch.cat([mat, b.reshape(-1, 1)], dim=1)
    return mat


def write_matrix(module: nn.Module, mat: torch.Tensor, grad: bool = False) -> None:
    """Inverse of :func:`weight_matrix`: copy ``mat`` into the weights (or grads)."""
    w = module.weight.grad if grad else module.weight.data
    cols = module.weight[0].numel()
    w.copy_(mat[:, :cols].reshape(w.shape).to(w.dtype))
    if module.bias is not None:
        b = module.bias.grad if grad else module.bias.data
        b.copy_(mat[:, cols].to(b.dtype))


# ------------------------------------------------------------- algebra
def damped_cholesky(a: torch.Tensor, damping: float) -> torch.Tensor:
    """Lower Cholesky factor of ``a + damping I`` (float64)."""
    a = a.to(torch.float64)
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    factor, info = torch.linalg.cholesky_ex(a + damping * eye)
    if int(info) != 0:
        raise ValueError(
            f"FedPM: preconditioner of size {a.shape[0]} is not positive definite "
            f"(damping={damping}); increase fedpm.damping (or weight-decay in the exact mode)")
    return factor


def right_solve(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``g M^-1`` for symmetric ``M = factor factor^T``: ``(M^-1 g^T)^T``
    (leading dims of both are batch dims: the cohort trainer's clients)."""
    return torch.cholesky_solve(g.to(factor.dtype).mT, factor).mT


def stacked_matrix(w: torch.Tensor, b: torch.Tensor | None, leading: int = 0) -> torch.Tensor:
    """``[W | b]`` of a layer's tensors (weights or gradients) as
    ``(..., out, input_dim)``, with ``leading`` batch dims in front
    (:func:`weight_matrix` of one layer for ``leading=0``)."""
    lead, out = w.shape[:leading], w.shape[leading]
    mat = w.reshape(*lead, out, -1)
    if b is not None:
        mat = torch.cat([mat, b.reshape(*lead, out, 1)], dim=-1)
    return mat


def write_stacked(w: torch.Tensor, b: torch.Tensor | None, mat: torch.Tensor, leading: int = 0) -> None:
    """Inverse of :func:`stacked_matrix`: copy ``mat`` into ``w`` and ``b``."""
    cols = math.prod(w.shape[leading + 1:])
    w.copy_(mat[..., :cols].reshape(w.shape).to(w.dtype))
    if b is not None:
        b.copy_(mat[..., cols].to(b.dtype))


@lru_cache(maxsize=16)
def _upper_triangle(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the upper triangle of a ``d x d`` matrix (row by row)
    and its boolean mask, built once per size (rebuilding them cost 5x the
    packing itself on a 785-wide layer)."""
    i, j = torch.triu_indices(d, d, device=device)
    mask = torch.ones(d, d, dtype=torch.bool, device=device).triu()
    return i * d + j, mask


def pack_upper(a: torch.Tensor) -> torch.Tensor:
    """Upper triangle (diagonal included) of a symmetric matrix, row by row."""
    flat_index, _ = _upper_triangle(a.shape[0], a.device)
    return a.reshape(-1).index_select(0, flat_index)


def triangle_side(count: int) -> int:
    """``d`` such that ``d (d + 1) / 2 == count``."""
    d = int(round(((8 * count + 1) ** 0.5 - 1) / 2))
    if d * (d + 1) // 2 != count:
        raise ValueError(f"{count} values are not the upper triangle of a square matrix")
    return d


def unpack_upper(values: torch.Tensor, d: int | None = None) -> torch.Tensor:
    """The symmetric matrix whose upper triangle is ``values`` (inverse of :func:`pack_upper`)."""
    d = triangle_side(int(values.numel())) if d is None else d
    flat_index, mask = _upper_triangle(d, values.device)
    upper = values.new_zeros(d * d).scatter_(0, flat_index, values).view(d, d)
    return torch.where(mask, upper, upper.T)
