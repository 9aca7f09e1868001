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

import functools

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedaccel.config import ConfigError


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
    if x.shape[0] == 0:
        raise no_input_rows()
    return OrderedDict((name, sums[name] / counts[name]) for name, _ in layers)


@torch.no_grad()
def stacked_foof(layer_inputs: Callable[[dict[str, torch.Tensor], torch.Tensor], list[torch.Tensor]],
                 layers: list[str], weights: dict[str, torch.Tensor], xs: list[torch.Tensor],
                 batch_size: int = 128, max_bytes: int = 64 << 20,
                 only: Collection[str] | None = None) -> OrderedDict[str, torch.Tensor]:
    """:func:`compute_foof` of C clients at once: client ``c``'s model has the
    weights ``weights[name][c]`` (stacked by parameter name), its inputs are
    ``xs[c]``; returns each layer's ``A`` stacked, ``[C, d, d]`` float64.

    For models whose layers are a chain of ``Linear`` layers with biases
    (:class:`fedaccel.models.nets.LinearChain`): ``layer_inputs(p, x)`` (its
    ``batched_layer_inputs``) gives every layer's input feature-major,
    ``[N, features, B]`` for N models' weights ``p`` and inputs ``x``
    ``[N, B, ...]``, in the order of ``layers``; the first is ``x`` itself,
    flattened (so the first layer's matrix does not depend on the weights).

    The arithmetic is :func:`compute_foof`'s: each client's rows in chunks of
    ``batch_size`` (its last chunk padded with zero rows, which add nothing,
    to the widest of a group of last chunks of about its size,
    :func:`_chunk_groups`),
    each chunk's ``R^T R`` a product in the model's dtype, a client's chunks
    summed in float64 in order (the same order on any device), then divided
    by its rows. Here every chunk of every client is one row of a batch (its
    client's weights gathered for it), as many chunks at a time as fit in
    ``max_bytes``, and ``R^T R`` is formed by blocks (the bias column, all
    ones, gives the row sums and the row count) so that no copy of a layer's
    input with a column of ones is made. Equal to :func:`compute_foof` to
    the model dtype's rounding (the batched layers sum in another order),
    not bit for bit. ``only``: form these layers' matrices alone (the
    others' inputs are still computed: later layers need them). Written here
    because no library forms per-client Gram matrices of a ragged batch."""
    if not xs:
        return OrderedDict()
    counts = np.array([int(x.shape[0]) for x in xs])
    if not counts.all():
        raise no_input_rows()
    per_client = -(-counts // batch_size)  # chunks of each client
    owner = np.repeat(np.arange(len(xs)), per_client)  # each chunk's client
    position = np.arange(len(owner)) - np.repeat(np.cumsum(per_client) - per_client, per_client)
    real = np.minimum(counts[owner] - position * batch_size, batch_size)  # each chunk's rows
    first_row = (np.cumsum(counts) - counts)[owner] + position * batch_size  # its first row in x_all
    x_all = torch.cat(xs + [xs[0].new_zeros((1,) + xs[0].shape[1:])])  # a padded slot reads the zero row
    device, dtype = x_all.device, weights[f"{layers[0]}.weight"].dtype
    dims = [int(weights[f"{name}.weight"][0][0].numel()) for name in layers]  # inputs, without the bias
    size = torch.finfo(dtype).bits // 8
    fixed = sum(d * d for d in dims) * (size + 8) + sum(int(w[0].numel()) for w in weights.values()) * size
    wanted = [only is None or name in only for name in layers]
    sums = [torch.zeros(len(xs), d + 1, d + 1, dtype=torch.float64, device=device) if want else None
            for d, want in zip(dims, wanted)]
    for chunks, width in _chunk_groups(real, batch_size):
        per_chunk = width * (int(x_all[0].numel()) + 2 * sum(dims)) * size + fixed
        step = max(1, max_bytes // per_chunk)
        slot = np.arange(width)
        for begin in range(0, len(chunks), step):
            group = chunks[begin:begin + step]
            valid = slot < real[group][:, None]  # [K, width]
            row_index = np.where(valid, first_row[group][:, None] + slot, x_all.shape[0] - 1)
            group_owner = torch.from_numpy(owner[group]).to(device)
            # the group's chunks by their position within their client, added one
            # position at a time: each index_add_ adds at most one chunk to a client,
            # so its sums come in chunk order on any device (all of a client's
            # chunks in one index_add_ would be summed in no fixed order on a GPU)
            if len(np.unique(owner[group])) == len(group):  # no client twice (the last chunks): one add
                by_position = [(None, group_owner)]
            else:  # two positions at least (a client has one chunk at each), so none holds all the group
                by_position = []
                for k in np.unique(position[group]):
                    at = torch.from_numpy(np.flatnonzero(position[group] == k)).to(device)
                    by_position.append((at, group_owner[at]))
            x = x_all.index_select(0, torch.from_numpy(row_index.reshape(-1)).to(device)).to(dtype)
            p = {k: v.index_select(0, group_owner) for k, v in weights.items()}
            inputs = layer_inputs(p, x.view((len(group), width) + x_all.shape[1:]))
            mask = (torch.from_numpy(valid).to(device=device, dtype=dtype).unsqueeze(1)
                    if not valid.all() else None)  # [K, 1, width]
            rows = torch.from_numpy(real[group]).to(device=device, dtype=torch.float64)
            for i, (a, d) in enumerate(zip(inputs, dims)):
                if not wanted[i]:
                    continue
                if i and mask is not None:  # a padded row's input to a later layer is not zero (the biases)
                    a = a * mask
                full = torch.empty(len(group), d + 1, d + 1, dtype=torch.float64, device=device)
                full[:, :d, :d] = torch.bmm(a, a.mT)  # model dtype product, float64 sum
                full[:, :d, d] = a.sum(dim=2)  # the bias column of R^T R: row sums, and the row count
                full[:, d, :d] = full[:, :d, d]
                full[:, d, d] = rows
                for at, owners in by_position:  # a client's chunks in order; no client twice in one add
                    sums[i].index_add_(0, owners, full if at is None else full.index_select(0, at))
    divisor = torch.from_numpy(counts).to(device=device, dtype=torch.float64)[:, None, None]
    return OrderedDict((name, s.div_(divisor)) for name, s in zip(layers, sums) if s is not None)


def _chunk_groups(real: np.ndarray, batch_size: int, partial_groups: int = 4) -> list[tuple[np.ndarray, int]]:
    """The chunks of a FOOF pass (``real``: each chunk's rows, clients' chunks
    in order) as groups of equal width, in the order they are added: first
    every full chunk (``batch_size`` rows), in chunk order; then every
    client's last, partial chunk, sorted by rows and cut into at most
    ``partial_groups`` groups of about equal count, each padded only to its
    own widest (a power-law cohort's partial chunks, 40 to 127 rows in
    chunks of 128, would waste a third of a pass padded to 128). A client's
    partial chunk is its last, so its chunks are still added in order."""
    full = np.flatnonzero(real == batch_size)
    groups = [(full, batch_size)] if len(full) else []
    partial = np.flatnonzero(real < batch_size)
    partial = partial[np.argsort(real[partial], kind="stable")]
    for part in np.array_split(partial, min(partial_groups, len(partial))) if len(partial) else []:
        groups.append((part, int(real[part].max())))
    return groups


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
def damped_cholesky(a: torch.Tensor, damping: float, algo: str = "fedpm") -> torch.Tensor:
    """Lower Cholesky factor of ``a + damping I`` (float64); without one,
    :func:`not_positive_definite` for ``algo``."""
    factor, info = damped_cholesky_ex(a, damping)
    if int(info) != 0:
        raise preconditioner_error(a, damping, algo)
    return factor


def damped_cholesky_ex(a: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factors of ``a + damping I`` (float64) and
    ``cholesky_ex``'s ``info`` (0 where a factor exists); leading dims of
    ``a`` are batch dims (a cohort's clients)."""
    a = a.to(torch.float64)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.cholesky_ex(a + damping * eye)


def damped_inverse_ex(a: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a + damping I)^-1`` (float64) of every matrix of ``a`` (leading dims
    are batch dims: a cohort's clients) and ``cholesky_ex``'s ``info`` (0 where
    a factor exists; the other inverses are not to be used)."""
    factor, info = damped_cholesky_ex(a, damping)
    eye = torch.eye(a.shape[-1], dtype=factor.dtype, device=factor.device)
    factor[info != 0] = eye  # no factor: an identity stands in, so the batched call runs
    return torch.cholesky_inverse(factor), info


def no_input_rows() -> ConfigError:
    """The error of a FOOF pass over no rows (a client without samples):
    :func:`compute_foof`'s and :func:`stacked_foof`'s, and a batched
    cohort's for such a client alone. A user error (that client's one-line
    error reply, batched or not, as :func:`not_positive_definite`): the
    data pipeline gives every client a sample, so only data of a user's
    own reaches it."""
    return ConfigError("a client without training samples has no rows for its FOOF preconditioner (a FOOF pass "
                       "needs at least one input row); give every client at least one sample")


def preconditioner_error(matrix: torch.Tensor, damping: float, algo: str = "fedpm") -> ConfigError:
    """The error of a client's preconditioner ``matrix`` whose damped form has
    no Cholesky factor: NaN or inf entries (non-finite values in the
    client's data, the model it received, or its own diverged steps when the
    matrix is formed mid-round, which no damping mends),
    else :func:`not_positive_definite`."""
    if not bool(torch.isfinite(matrix).all()):
        return ConfigError(
            f"{algo}: preconditioner of size {matrix.shape[-1]} has NaN or inf entries: this client's training "
            "data, the model it received or its own local steps (diverged: lower lr) hold non-finite values; no "
            "damping can mend that")
    return not_positive_definite(matrix.shape[-1], damping, algo)


def not_positive_definite(size: int, damping: float, algo: str = "fedpm") -> ConfigError:
    """The error of a preconditioner without a Cholesky factor: a user
    error (the client's one-line error reply, batched or not), fixed in
    the run config (``algo``'s keys: FedPM's or LocalNewton's)."""
    return ConfigError(
        f"{algo}: preconditioner of size {size} is not positive definite "
        f"(damping={damping}); increase {algo}.damping (or weight-decay in the exact mode)")


def right_multiply(g: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``g M^-1`` given ``M^-1`` (leading dims of both are batch dims: the
    cohort trainer's clients). The FOOF step's product: one matrix product
    per step where a solve with ``M``'s factor is two triangular solves
    (FOOF itself inverts once per refresh: Benzing, "Gradient Descent on
    Neurons and its Link to Approximate Second-order Optimization", ICML
    2022, PMLR 162)."""
    return g.to(inverse.dtype) @ inverse


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


@functools.lru_cache(maxsize=64)
def diagonal_of_packed(d: int) -> np.ndarray:
    """Where a ``d x d`` matrix's diagonal lies in its :func:`pack_upper`
    triangle (row ``i`` starts at ``i d - i (i - 1) / 2``, its diagonal
    first); read-only, made once per size."""
    i = np.arange(d)
    where = i * d - i * (i - 1) // 2
    where.flags.writeable = False
    return where


def pack_upper(a: torch.Tensor) -> torch.Tensor:
    """Upper triangle (diagonal included) of a symmetric matrix, row by row."""
    flat_index, _ = _upper_triangle(a.shape[0], a.device)
    return a.reshape(-1).index_select(0, flat_index)


def pack_upper_stacked(a: torch.Tensor) -> torch.Tensor:
    """:func:`pack_upper` of every matrix of ``a`` ``[C, d, d]``: ``[C, d (d + 1) / 2]``."""
    flat_index, _ = _upper_triangle(a.shape[-1], a.device)
    return a.reshape(a.shape[0], -1).index_select(1, flat_index)


def unpack_upper_stacked(values: torch.Tensor, d: int) -> torch.Tensor:
    """:func:`unpack_upper` of every row of ``values`` ``[C, d (d + 1) / 2]``: ``[C, d, d]``."""
    flat_index, mask = _upper_triangle(d, values.device)
    upper = values.new_zeros(values.shape[0], d * d).scatter_(
        1, flat_index.expand(values.shape[0], -1), values).view(-1, d, d)
    return torch.where(mask, upper, upper.mT)


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
