"""Preconditioned mixing of local parameters (FedPM's server rule); registers no algorithm.

"FedPM: Federated Learning Using Second-order Optimization with Preconditioned
Mixing of Local Parameters" (Ishii et al., 2025, arXiv:2511.09100), eq. (10)
(full preconditioners) and eq. (12) (per-layer FOOF). For every layer whose
clients uploaded a preconditioner (the ArrayRecord
:data:`fedaccel.clients.fedpm.PRECOND_KEY`, ``{layer: upper triangle}``), with
``p_i = n_i / n`` (sample counts of the replies) and ``M_i = P_i + damping I``
(with ``<algo>.upload='used'``, the default, the damped matrix the client
stepped with; with ``'end'`` the one recomputed at its final weights):

- FOOF (``P_i = A_i`` of size ``in + 1``, acting on the input side of
  ``W~ = [W | b]``, shape ``(out, in + 1)``)::

      W~ = (sum_i p_i W~_i M_i) (sum_i p_i M_i)^-1

- full (``P_i = H_i`` of size ``out * (in + 1)``, acting on
  ``vec(W~)`` row-major; the exact logistic-regression mode)::

      vec(W~) = (sum_i p_i M_i)^-1 sum_i p_i M_i vec(W~_i)

The kind is read from the matrix size. Solves use a Cholesky factor of
``sum_i p_i M_i`` in float64 (never an explicit inverse). Every other tensor
(GroupNorm weights, layers without a matrix) is the sample-weighted mean
``sum_i p_i x_i``. Results keep the clients' dtype.

With one local step ``W~_i = W~ - lr G~_i M_i^-1`` this gives exactly
``W~ - lr (sum p_i G~_i) (sum p_i M_i)^-1``: the global damped step. That
needs the mixing matrix to be the one the step used (``upload='used'``) and
the step to be unclipped: a client whose direction was clipped (``clip-norm``)
contributes ``c_i G~_i`` with its own factor ``c_i <= 1``. With ``K`` steps
and a preconditioner constant within the round (``refresh-every = 0``,
``upload='used'``) every local model is ``W~_i = W~ - lr D_i M_i^-1``, ``D_i``
the sum of its steps' regularised gradients (scaled by momentum and clipping
factors), and the round is exactly ``W~ - lr (sum_i p_i D_i)(sum_i p_i M_i)^-1``
(the paper's appendix B, eq. (16), with constant local preconditioners).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedaccel.clients import foof


MIX_GROUP_BYTES = 64 << 20  # the damped matrices of a group of clients, and their scaled copies


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float64))  # a copy: views may be read-only


def layer_matrix(arrays: Mapping[str, np.ndarray], layer: str) -> tuple[torch.Tensor, list[str]]:
    """``[W | b]`` of ``layer`` from flat arrays (float64) and the keys it covers."""
    w = _t(arrays[f"{layer}.weight"])
    keys = [f"{layer}.weight"]
    mat = w.reshape(w.shape[0], -1)
    if f"{layer}.bias" in arrays:
        mat = torch.cat([mat, _t(arrays[f"{layer}.bias"]).reshape(-1, 1)], dim=1)
        keys.append(f"{layer}.bias")
    return mat, keys


def group_matrices(group: Sequence[Mapping[str, np.ndarray]], keys: list[str], rows: int) -> torch.Tensor:
    """:func:`layer_matrix` of every client of ``group`` (``keys``: the layer's
    weight and bias), stacked ``[G, rows, cols]`` in float64 from one copy of
    each key's arrays; row ``i`` holds client ``i``'s values in
    :func:`layer_matrix`'s layout."""
    parts = [torch.from_numpy(np.stack([np.asarray(arrays[key]) for arrays in group]).astype(np.float64, copy=False))
             .reshape(len(group), rows, -1) for key in keys]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2)


def in_order_sum(total: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``total + rows[0] + rows[1] + ...`` added one row at a time, in order
    (``rows[0] + rows[1] + ...`` without ``total``), into one accumulator:
    the client-by-client sums to the bit, on any dtype and device, without
    a new tensor per client."""
    acc = rows[0].clone() if total is None else total + rows[0]
    for row in rows[1:]:
        acc.add_(row)
    return acc


def preconditioner_layout(model: Sequence[tuple[str, tuple[int, ...]]], full: bool) -> list[tuple[str, tuple[int]]]:
    """The packed preconditioners a FedPM client uploads for a model of
    ``model``'s keys and shapes: one upper triangle ``(d (d + 1) / 2,)``
    per layer with a weight of two or more dims (the ``Linear`` and
    ``Conv2d`` layers FOOF preconditions, ``fedaccel.clients.foof.foof_layers``),
    ``d`` its ``[W | b]`` column count (FOOF) or ``rows * cols`` (``full``:
    the exact mode's Hessian)."""
    shapes = dict(model)
    out = []
    for key, shape in model:
        if not key.endswith(".weight") or len(shape) < 2:
            continue
        layer = key[:-len(".weight")]
        cols = int(np.prod(shape[1:])) + (1 if f"{layer}.bias" in shapes else 0)
        d = shape[0] * cols if full else cols
        out.append((layer, (d * (d + 1) // 2,)))
    return out


def preconditioned_mix(
    clients: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray], float]],
    damping: float,
) -> OrderedDict[str, np.ndarray]:
    """Mix ``(arrays, packed preconditioners, n_i)`` of every client (see module doc).

    Each layer's matrices are unpacked, damped and scaled for all clients at
    once (data movement and elementwise products: the same values as client
    by client); each client's product ``W~_i M_i`` stays one ``mm`` of its
    own (a batched ``bmm`` rounds some shapes differently) and the sums run
    client by client in reply order, so the result is bit for bit the
    client-by-client loop's."""
    if not clients:
        raise ValueError("preconditioned_mix needs at least one client")
    total = float(sum(n for _, _, n in clients))
    weights = [float(n) / total for _, _, n in clients]
    first_arrays, first_pre, _ = clients[0]
    layers = list(first_pre)
    for _, pre, _ in clients:
        if list(pre) != layers:
            raise ValueError(f"clients uploaded preconditioners for different layers: {list(pre)} vs {layers}")
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    covered: dict[str, torch.Tensor] = {}
    for layer in layers:
        first_matrix, keys = layer_matrix(first_arrays, layer)
        rows, cols = first_matrix.shape
        sizes = [foof.triangle_side(int(np.asarray(pre[layer]).size)) for _, pre, _ in clients]
        d = sizes[0]
        for size in sizes:
            if size not in (cols, rows * cols):
                raise ValueError(f"layer {layer}: preconditioner of size {size} fits neither "
                                 f"{cols} (FOOF) nor {rows * cols} (full)")
            if size != d:
                raise ValueError(f"layer {layer}: clients uploaded preconditioners of sizes {d} and {size}")
        full = d == rows * cols != cols
        eye = damping * torch.eye(d, dtype=torch.float64)
        m_sum, r_sum = None, None
        # clients a group at a time (a group's matrices at most MIX_GROUP_BYTES), the sums client by client
        group = max(1, MIX_GROUP_BYTES // (2 * d * d * 8))
        for begin in range(0, len(clients), group):
            part = clients[begin:begin + group]
            packed = _t(np.stack([np.asarray(pre[layer]).reshape(-1) for _, pre, _ in part]))
            m = foof.unpack_upper_stacked(packed, d).add_(eye)  # [G, d, d]
            scale = torch.tensor(weights[begin:begin + group], dtype=torch.float64)[:, None, None]
            w = group_matrices([arrays for arrays, _, _ in part], keys, rows)  # [G, rows, cols]
            r = torch.stack([m_i @ w_i.reshape(-1) if full else w_i @ m_i for w_i, m_i in zip(w, m)])
            scaled_m = m.mul_(scale)  # p * m_i, elementwise (m is not read again)
            scaled_r = r.mul_(scale[:, :, 0] if full else scale)
            m_sum = in_order_sum(m_sum, scaled_m)
            r_sum = in_order_sum(r_sum, scaled_r)
        factor, info = torch.linalg.cholesky_ex(m_sum)
        if int(info) != 0:
            raise ValueError(f"layer {layer}: mixed preconditioner is not positive definite; "
                             "increase the damping")
        if r_sum.dim() == 2:
            mixed = foof.right_solve(r_sum, factor)
        else:
            mixed = torch.cholesky_solve(r_sum.reshape(-1, 1), factor).reshape(rows, cols)
        w_shape = np.asarray(first_arrays[f"{layer}.weight"]).shape
        n_w = int(np.prod(w_shape[1:]))
        covered[keys[0]] = mixed[:, :n_w].reshape(w_shape)
        if len(keys) == 2:
            covered[keys[1]] = mixed[:, n_w]
    for key, first in first_arrays.items():
        first = np.asarray(first)
        if key in covered:
            value = covered[key]
        else:
            value = sum(p * _t(arrays[key]) for (arrays, _, _), p in zip(clients, weights))
        out[key] = np.asarray(value.numpy(), dtype=first.dtype).reshape(first.shape)
    return out
