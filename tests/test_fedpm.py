"""FedPM / LocalNewton: FOOF statistics, preconditioned mixing, exact Newton mode.

Every reference here is computed independently of the code under test
(explicit patch loops, manual forwards, autograd Hessians, a long centralized
Newton run).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord
from torch import nn

from fedaccel.arrays import DeferredArray
from fedaccel.clients import foof
from fedaccel.clients.base import LocalSolver, TrainData
from fedaccel.clients.fedpm import PRECOND_KEY, FedPMSolver, LocalNewtonSolver, logreg_hessian, with_bias_column
from fedaccel.contract import train_config_record
from fedaccel.config import ConfigError
from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse, run_local
from fedaccel.torch_utils import payload_bytes
from fedaccel.models import MODELS, LogReg
from fedaccel.strategies.preconditioned_mixing import preconditioned_mix


def run_cfg(**overrides):
    return parse_run_config(fuse(default_run_config(), overrides))


def flat(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def client_round(solver, model, global_state, x, y, lr, epochs=1):
    """One client's round from ``global_state``: (arrays, packed preconditioners, n)."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in global_state.items()})
    result = solver.fit(model, TrainData(x, y), train_config_record(1, lr, epochs), None,
                        torch.Generator().manual_seed(0))
    arrays = {k: a.numpy() for k, a in result.arrays.items()}
    packed = {k: a.numpy() for k, a in result.extra[PRECOND_KEY].items()} if result.extra else {}
    return arrays, packed, result.metrics["num-examples"]


# ------------------------------------------------------------------ FOOF
def test_conv_unfolding_matches_explicit_patch_loop():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
    x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    a = foof.compute_foof(nn.Sequential(conv).double(), x)["0"]
    xp = F.pad(x, (0, 0, 1, 1))  # padding (1, 0): rows only
    kh, kw = conv.kernel_size
    out = conv.double()(x)
    rows = []
    for b in range(x.shape[0]):
        for i in range(out.shape[2]):
            for j in range(out.shape[3]):
                patch = xp[b, :, i * 2:i * 2 + kh, j:j + 2 * (kw - 1) + 1:2]  # dilation 2 in width
                rows.append(torch.cat([patch.reshape(-1), torch.ones(1, dtype=x.dtype)]))
    rows = torch.stack(rows)
    assert a.shape == (2 * kh * kw + 1,) * 2
    torch.testing.assert_close(a, rows.T @ rows / rows.shape[0])
    # The unfolded patch order is the order of weight.reshape(out, -1): conv == matmul.
    w = foof.weight_matrix(conv)
    torch.testing.assert_close((rows @ w.T).reshape(2, out.shape[2], out.shape[3], 3).permute(0, 3, 1, 2), out)


def test_linear_foof_has_bias_column_and_no_bias_layer_has_none():
    x = torch.randn(7, 4, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False)).double()
    a = foof.compute_foof(net, x)
    xt = torch.cat([x, torch.ones(7, 1, dtype=x.dtype)], 1)
    torch.testing.assert_close(a["0"], xt.T @ xt / 7)
    h = net[0](x).detach()
    torch.testing.assert_close(a["1"], h.T @ h / 7)


def test_upper_triangle_round_trip():
    m = torch.randn(6, 6, dtype=torch.float64)
    s = m + m.T
    packed = foof.pack_upper(s)
    assert packed.numel() == 6 * 7 // 2
    assert torch.equal(foof.unpack_upper(packed), s)
    assert foof.triangle_side(packed.numel()) == 6
    sym = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    assert foof.pack_upper(sym).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # row by row
    assert torch.equal(foof.unpack_upper(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])), sym)


# ---------------------------------------------------------------- mixing
def test_damped_inverses_of_a_batch_with_a_matrix_without_a_factor():
    """``damped_inverse_ex``: each matrix's ``(A + damping I)^-1`` (the
    FOOF step multiplies by it), and a matrix without a Cholesky factor is
    flagged in ``info`` without spoiling the others' inverses."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    a = rows.mT @ rows / 7
    a[1] = -torch.eye(4, dtype=torch.float64)  # -1 + 0.5: no factor
    inverse, info = foof.damped_inverse_ex(a, 0.5)
    assert info.tolist() == [0, 1, 0]
    eye = torch.eye(4, dtype=torch.float64)
    for c in (0, 2):
        torch.testing.assert_close(inverse[c], torch.linalg.inv(a[c] + 0.5 * eye), rtol=1e-12, atol=1e-14)
        grad = torch.randn(3, 4, generator=g, dtype=torch.float64)
        torch.testing.assert_close(foof.right_multiply(grad, inverse[c]),
                                   torch.linalg.solve(a[c] + 0.5 * eye, grad.mT).mT, rtol=1e-12, atol=1e-14)
    # an exactly singular matrix (dead units at damping 0): flagged, the batch not stopped
    inverse, info = foof.damped_inverse_ex(torch.stack([2 * eye, torch.zeros(4, 4, dtype=torch.float64)]), 0.0)
    assert info.tolist()[0] == 0 and info.tolist()[1] != 0
    torch.testing.assert_close(inverse[0], eye / 2)


@pytest.mark.parametrize("batched", [False, True])
def test_each_step_preconditions_in_the_layers_dtype(monkeypatch, batched):
    """The float64 inverse (batched) or factor (one client after another)
    is kept in the layer's dtype, so float32 steps run in float32; the
    batched trainer multiplies by inverses, one client alone solves with
    factors (docs/fedpm.md)."""
    from fedaccel.clients.cohort import fit_cohort

    seen = []
    for name in ("right_multiply", "right_solve"):
        real = getattr(foof, name)
        monkeypatch.setattr(foof, name, lambda g, m, real=real, name=name: seen.append((name, m.dtype)) or real(g, m))
    cfg = run_cfg(algo="fedpm", **{"batch-size": 4})
    model, datas = ragged_mlp_clients()
    if batched:
        fit_cohort(copy.deepcopy(model), fedpm_jobs(cfg, model, datas), 4)
    else:
        FedPMSolver(cfg).fit(copy.deepcopy(model), datas[0], train_config_record(1, 0.1, 1), None,
                             torch.Generator().manual_seed(0))
    assert seen and set(seen) == {("right_multiply" if batched else "right_solve", torch.float32)}


def test_identity_preconditioners_give_the_weighted_mean():
    rng = np.random.default_rng(0)
    clients = []
    for n in (3, 10, 7):
        arrays = {"fc.weight": rng.normal(size=(2, 4)), "fc.bias": rng.normal(size=2),
                  "norm.weight": rng.normal(size=5)}
        clients.append((arrays, {"fc": foof.pack_upper(torch.eye(5)).numpy()}, n))
    for damping in (0.0, 0.7):
        mixed = preconditioned_mix(clients, damping)
        for key in ("fc.weight", "fc.bias", "norm.weight"):
            expected = sum(n * a[key] for a, _, n in clients) / 20
            np.testing.assert_allclose(mixed[key], expected, rtol=1e-12, atol=1e-12)


def make_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()


def centralized_foof_step(model, shards, lr, wd, damping):
    """Independent reference: W~ - lr (sum p_i G~_i)(sum p_i (A_i + damping I))^-1 per layer,
    with A_i and the regularised gradients from a manual forward pass."""
    n = sum(len(y) for _, y in shards)
    w1, b1, w2, b2 = (p.detach().clone().requires_grad_(True) for p in model.parameters())
    g_sum, m_sum = [0, 0], [0, 0]
    for x, y in shards:
        p = len(y) / n
        h = torch.relu(x @ w1.T + b1)
        loss = F.cross_entropy(h @ w2.T + b2, y)
        grads = torch.autograd.grad(loss, (w1, b1, w2, b2))
        for k, (inp, w, b, gw, gb) in enumerate(((x, w1, b1, grads[0], grads[1]), (h.detach(), w2, b2, grads[2], grads[3]))):
            it = torch.cat([inp, torch.ones(len(y), 1, dtype=x.dtype)], 1)
            a = it.T @ it / len(y)
            g = torch.cat([gw + wd * w.detach(), (gb + wd * b.detach())[:, None]], 1)
            g_sum[k] = g_sum[k] + p * g
            m_sum[k] = m_sum[k] + p * (a + damping * torch.eye(a.shape[0], dtype=a.dtype))
    out = {}
    for k, (w, b, name) in enumerate(((w1, b1, "1"), (w2, b2, "3"))):
        wt = torch.cat([w.detach(), b.detach()[:, None]], 1)
        new = wt - lr * g_sum[k] @ torch.linalg.inv(m_sum[k])
        out[f"{name}.weight"], out[f"{name}.bias"] = new[:, :-1].numpy(), new[:, -1].numpy()
    return out


@pytest.mark.parametrize("identical", [True, False])
def test_one_local_step_is_the_centralized_damped_foof_step(identical):
    """One full-batch local step + preconditioned mixing (mixing with the A the
    client used) == the global damped FOOF step; with identical clients any
    upload choice gives it."""
    lr, wd, damping = 0.5, 0.01, 0.3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=g)
    shards = [(x, y)] * 3 if identical else [(x[:6], y[:6]), (x[6:17], y[6:17]), (x[17:], y[17:])]
    upload = "end" if identical else "used"
    cfg = run_cfg(algo="fedpm", **{"batch-size": 64, "momentum": 0.0, "weight-decay": wd,
                                   "fedpm.damping": damping, "fedpm.upload": upload,
                                   "clip-norm": 0})  # a clipped step is not the centralized one
    model = make_mlp()
    start = flat(model)
    clients = [client_round(FedPMSolver(cfg), model, start, xs, ys, lr) for xs, ys in shards]
    mixed = preconditioned_mix(clients, damping)
    expected = centralized_foof_step(make_mlp(), shards, lr, wd, damping)
    for key, value in expected.items():
        np.testing.assert_allclose(mixed[key], value, rtol=1e-10, atol=1e-12)


def make_cnn() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(2, 3, kernel_size=2), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)).double()


def patches(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """Every ``kh x kw`` patch of ``x`` [N, C, H, W] (stride 1, no padding) as
    a row in the order of ``weight.reshape(out, -1)`` (C, then kh, then kw),
    by an explicit loop over samples and positions."""
    n, _, h, w = x.shape
    return torch.stack([x[i, :, r:r + kh, c:c + kw].reshape(-1)
                        for i in range(n) for r in range(h - kh + 1) for c in range(w - kw + 1)])


def centralized_conv_foof_step(model, shards, lr, wd, damping):
    """Independent reference for a conv layer and a linear one: A_i from
    explicit patches (the conv) and the flattened activations (the linear
    layer), the gradients by autograd through ``F.conv2d``, then
    W~ - lr (sum p_i G~_i)(sum p_i (A_i + damping I))^-1 per layer, the conv's
    W~ its weight as ``[out, C kh kw]`` with the bias column."""
    n = sum(len(y) for _, y in shards)
    wc, bc, wl, bl = (p.detach().clone().requires_grad_(True) for p in model.parameters())
    g_sum, m_sum = [0, 0], [0, 0]
    for x, y in shards:
        p = len(y) / n
        h = torch.relu(F.conv2d(x, wc, bc)).flatten(1)
        loss = F.cross_entropy(h @ wl.T + bl, y)
        grads = torch.autograd.grad(loss, (wc, bc, wl, bl))
        inputs = (patches(x, 2, 2), h.detach())
        for k, (inp, w, b, gw, gb) in enumerate(((inputs[0], wc, bc, grads[0], grads[1]),
                                                  (inputs[1], wl, bl, grads[2], grads[3]))):
            it = torch.cat([inp, torch.ones(len(inp), 1, dtype=x.dtype)], 1)
            a = it.T @ it / len(inp)  # the conv: the mean over every patch of every sample
            g = torch.cat([(gw + wd * w.detach()).reshape(len(gb), -1), (gb + wd * b.detach())[:, None]], 1)
            g_sum[k] = g_sum[k] + p * g
            m_sum[k] = m_sum[k] + p * (a + damping * torch.eye(a.shape[0], dtype=a.dtype))
    out = {}
    for k, (w, b, name) in enumerate(((wc, bc, "0"), (wl, bl, "3"))):
        wt = torch.cat([w.detach().reshape(len(b), -1), b.detach()[:, None]], 1)
        new = wt - lr * g_sum[k] @ torch.linalg.inv(m_sum[k])
        out[f"{name}.weight"], out[f"{name}.bias"] = new[:, :-1].reshape(w.shape).numpy(), new[:, -1].numpy()
    return out


def test_one_local_step_of_a_cnn_is_the_centralized_damped_foof_step():
    """The conv layer's FOOF step and its mixing: its gradient and A in
    ``weight.reshape(out, -1)``'s column order, its mixed ``[out, C kh kw]``
    matrix reshaped back to the 4-D weight (two clients of unequal size)."""
    lr, wd, damping = 0.5, 0.01, 0.3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(14, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (14,), generator=g)
    shards = [(x[:5], y[:5]), (x[5:], y[5:])]
    cfg = run_cfg(algo="fedpm", **{"batch-size": 64, "momentum": 0.0, "weight-decay": wd,
                                   "fedpm.damping": damping, "fedpm.upload": "used", "clip-norm": 0})
    model = make_cnn()
    start = flat(model)
    clients = [client_round(FedPMSolver(cfg), model, start, xs, ys, lr) for xs, ys in shards]
    mixed = preconditioned_mix(clients, damping)
    expected = centralized_conv_foof_step(make_cnn(), shards, lr, wd, damping)
    assert mixed["0.weight"].shape == (3, 2, 2, 2)
    for key, value in expected.items():
        np.testing.assert_allclose(mixed[key], value, rtol=1e-10, atol=1e-12)


def test_foof_samples_draws_a_seeded_random_subset_of_the_rows():
    """``fedpm.foof-samples = k``: the round's A is formed from the rows
    ``randperm(n)[:k]`` of the client's generator (its first draw of the
    round), not from the first k rows: the upload equals the mean of
    ``[a; 1][a; 1]^T`` over those rows, by hand (a logistic regression,
    whose one layer's input is the data)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=g)
    cfg = run_cfg(algo="fedpm", **{"batch-size": 8, "fedpm.foof-samples": 6, "fedpm.upload": "used"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    _, packed, _ = client_round(FedPMSolver(cfg), model, flat(model), x, y, lr=0.1)
    got = foof.unpack_upper(torch.from_numpy(packed["0"]))

    def by_hand(rows):
        it = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
        return it.T @ it / len(rows)

    chosen = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:6]
    torch.testing.assert_close(got, by_hand(x[chosen]), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, by_hand(x[:6]))


def test_localnewton_uploads_nothing_extra_and_refresh_changes_the_steps():
    cfg = run_cfg(algo="localnewton", **{"batch-size": 4, "localnewton.refresh-every": 1})
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    model = make_mlp()
    arrays, packed, _ = client_round(LocalNewtonSolver(cfg), model, flat(model), x, y, 0.1)
    assert packed == {}
    cfg0 = run_cfg(algo="localnewton", **{"batch-size": 4})
    arrays0, _, _ = client_round(LocalNewtonSolver(cfg0), make_mlp(), flat(make_mlp()), x, y, 0.1)
    assert not np.allclose(arrays["1.weight"], arrays0["1.weight"])


def test_bytes_up_counts_the_packed_preconditioners(tmp_path):
    """bytes_up - bytes_down == cohort x serialized upper triangles (MLP 60-32-10)."""
    cfg = fuse(default_run_config(), {"algo": "fedpm", "num-server-rounds": 2, "clients-per-round": 3,
                                      "local-epochs": 1, "accl-every": 0, "synthetic.max-samples": 120,
                                      "results-dir": str(tmp_path), "run-name": "bytes"})
    run_dir = run_local(cfg, num_clients=6, quiet=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    packed = ArrayRecord({"fc1": Array(np.zeros(61 * 62 // 2, np.float32)),
                          "fc": Array(np.zeros(33 * 34 // 2, np.float32))})
    for row in rows:
        assert row["bytes_up"] - row["bytes_down"] == 3 * payload_bytes(packed)
    assert payload_bytes(packed) < (61 * 61 + 33 * 33) * 4  # less than full matrices


# ------------------------------------------------------------ exact mode
def test_exact_hessian_matches_autograd():
    g = torch.Generator().manual_seed(0)
    xt = with_bias_column(torch.randn(9, 4, generator=g, dtype=torch.float64), True)
    y = torch.randint(0, 3, (9,), generator=g)
    theta = torch.randn(3, 5, generator=g, dtype=torch.float64)
    f = lambda t: F.cross_entropy(xt @ t.reshape(3, 5).T, y) + 0.05 * t.pow(2).sum()
    ref = torch.autograd.functional.hessian(f, theta.reshape(-1))
    torch.testing.assert_close(logreg_hessian(theta, xt, 0.1), ref)


def test_exact_mode_rejects_other_models():
    with pytest.raises(ConfigError, match="logreg"):
        from fedaccel.strategies.fedpm import check_exact_mode
        check_exact_mode(run_cfg(algo="fedpm", model="mlp", **{"fedpm.mode": "exact"}))


def breast_cancer_clients(num_clients=10):
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    order = np.lexsort((x[:, 0], y))  # sorted by label: most clients see one class
    sizes = np.random.default_rng(0).dirichlet(np.ones(num_clients) * 2) * len(y)
    cuts = np.clip(np.cumsum(np.maximum(sizes, 20)).astype(int), 0, len(y))[:-1]
    parts = np.split(order, cuts)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    return [(xt[p], yt[p]) for p in parts if len(p)], xt, yt


def objective_terms(theta, x, y, wd):
    """Gradient (autograd) and Hessian (explicit per-sample Kronecker sum) of the global
    objective mean CE + wd/2 ||theta||^2: independent of the code under test."""
    xt = torch.cat([x, torch.ones(len(y), 1, dtype=x.dtype)], 1)
    t = theta.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(xt @ t.reshape(2, -1).T, y) + 0.5 * wd * t.pow(2).sum()
    (grad,) = torch.autograd.grad(loss, t)
    p = torch.softmax(xt @ theta.reshape(2, -1).T, dim=1)
    hess = sum(torch.kron(torch.diag(pn) - torch.outer(pn, pn), torch.outer(xn, xn)) for pn, xn in zip(p, xt))
    return grad, hess / len(y) + wd * torch.eye(theta.numel(), dtype=theta.dtype)


def newton_step(theta, x, y, wd):
    grad, hess = objective_terms(theta, x, y, wd)
    return theta - torch.linalg.solve(hess, grad)


def optimum(x, y, wd, iters=15):
    """A long centralized Newton run from zero."""
    theta = torch.zeros(2 * (x.shape[1] + 1), dtype=torch.float64)
    for _ in range(iters):
        theta = newton_step(theta, x, y, wd)
    assert float(objective_terms(theta, x, y, wd)[0].norm()) < 1e-12
    return theta


def as_theta(state):
    return torch.from_numpy(np.concatenate([state["fc.weight"], state["fc.bias"][:, None]], 1).reshape(-1))


def test_exact_mode_is_a_global_newton_step_and_converges_superlinearly():
    wd = 1e-2
    shards, x, y = breast_cancer_clients()
    assert len(shards) >= 8
    theta_star = optimum(x, y, wd)
    model = LogReg(30, 2).double()
    # The paper's Test 1 starts near the optimum (the theorem is local); pure
    # Newton from far away overshoots on this nearly separable data.
    torch.manual_seed(0)
    theta0 = (theta_star + 0.1 * torch.randn_like(theta_star)).reshape(2, 31)
    start = {"fc.weight": theta0[:, :30].numpy().copy(), "fc.bias": theta0[:, 30].numpy().copy()}

    cfg = run_cfg(algo="fedpm", model="logreg", **{"weight-decay": wd, "fedpm.mode": "exact",
                                                   "fedpm.damping": 0.0})
    state, errors = dict(start), []
    for rnd in range(7):
        theta = as_theta(state)
        errors.append(float((theta - theta_star).norm()))
        clients = [client_round(FedPMSolver(cfg), model, state, xs, ys, lr=1.0) for xs, ys in shards]
        state = preconditioned_mix(clients, 0.0)
        if rnd == 0:  # the round is exactly one global Newton step
            torch.testing.assert_close(as_theta(state), newton_step(theta, x, y, wd), rtol=1e-9, atol=1e-11)
    ratios = [b / a for a, b in zip(errors, errors[1:5])]
    assert errors[-1] < 1e-12, errors
    assert ratios[-1] < 1e-3 and ratios[3] < ratios[2] < ratios[1], (errors, ratios)

    # LocalNewton (plain mixing of the same Newton steps) is biased: no exact step.
    lcfg = run_cfg(algo="localnewton", model="logreg", **{"weight-decay": wd,
                                                          "localnewton.mode": "exact",
                                                          "localnewton.damping": 0.0})
    clients = [client_round(LocalNewtonSolver(lcfg), model, start, xs, ys, 1.0) for xs, ys in shards]
    ln = sum(n * as_theta(a) for a, _, n in clients) / sum(n for _, _, n in clients)
    assert float((ln - theta_star).norm()) > 5 * errors[1]

    # FedAvg (full-batch local GD, one step, lr 1): at best linear.
    fcfg = run_cfg(algo="fedavg", model="logreg", **{"weight-decay": wd, "batch-size": 1000,
                                                     "momentum": 0.0})
    state, avg_errors = dict(start), []
    for _ in range(30):
        avg_errors.append(float((as_theta(state) - theta_star).norm()))
        clients = [client_round(LocalSolver(fcfg), model, state, xs, ys, 1.0) for xs, ys in shards]
        total = sum(n for _, _, n in clients)
        state = {k: sum(n * a[k] for a, _, n in clients) / total for k in start}
    avg_ratios = [b / a for a, b in zip(avg_errors, avg_errors[1:])]
    assert min(avg_ratios[5:]) > 0.5, avg_ratios
    assert avg_errors[-1] > 1e3 * errors[4]


# no FOOF pass uploads it (eigenvalues 51, 1, -49: indefinite even after damping 1, and so is a mix that holds it
# beside two sound matrices of similar weight), though its diagonal is positive
INDEFINITE = np.array([[1.0, 50.0, 0.0], [50.0, 1.0, 0.0], [0.0, 0.0, 1.0]])


def fedpm_round(precond_of, weight_of, pids=(0, 1, 2)):
    """One FedPM round's aggregation over hand-made replies: client ``pid``
    uploads weights, ``precond_of(pid)`` as its fc preconditioner and
    ``weight_of(pid)`` samples. Returns (the strategy, the new model or
    None, what each reply sent)."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedaccel.membership import Federation
    from fedaccel.registry import get_algorithm
    from fakes import StubGrid

    cfg = parse_run_config(fuse(default_run_config(), {"algo": "fedpm", "clients-per-round": len(pids)}))
    nodes = {pid: 11 + pid for pid in pids}
    strategy = get_algorithm("fedpm").build_strategy(cfg, Federation(dict(nodes)))
    start = {"fc.weight": np.ones((2, 2), dtype=np.float32), "fc.bias": np.zeros(2, dtype=np.float32)}
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(
        1, ArrayRecord({k: Array(v) for k, v in start.items()}), ConfigRecord(), StubGrid(nodes.values()))}
    rng = np.random.default_rng(0)
    sent, replies = {}, []
    for pid, node in nodes.items():
        msgs[node].metadata.__dict__["_message_id"] = f"m{pid}"
        arrays = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in start.items()}
        packed = foof.pack_upper(torch.from_numpy(np.asarray(precond_of(pid), dtype=np.float32))).numpy()
        sent[pid] = (arrays, {"fc": packed}, float(weight_of(pid)))
        replies.append(Message(RecordDict({
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": weight_of(pid), "train-loss": 1.0}),
            PRECOND_KEY: ArrayRecord({"fc": Array(packed)}),
        }), reply_to=msgs[node]))
    out, _ = strategy.aggregate_train(1, replies)
    return strategy, out, sent


@pytest.mark.parametrize("weight", [5, 100])
def test_a_reply_with_a_negative_diagonal_is_rejected_alone_whatever_the_others(server_identity, caplog, weight):
    """A FOOF matrix's diagonal holds means of squares: a reply whose matrix
    has a negative diagonal entry (here -2 I: indefinite even after damping
    1) is rejected by the reply checks, logged and not committed, and the
    other two are mixed exactly as if only they had replied, whether its
    weight is small against theirs (its mix would have stayed positive
    definite, and used to take it in) or large."""
    sound = np.array([[2.0, 0.5, 0.1], [0.5, 1.0, 0.2], [0.1, 0.2, 1.0]])
    strategy, out, sent = fedpm_round(lambda pid: -2.0 * np.eye(3) if pid == 1 else sound,
                                      lambda pid: weight if pid == 1 else 100)
    expected = preconditioned_mix([sent[0], sent[2]], float(strategy.run_cfg.algo_params.damping))
    for key, value in expected.items():
        np.testing.assert_array_equal(out[key].numpy(), value)
    assert (strategy.rounds[1].rejected, strategy.rounds[1].replies) == (1, 2)
    assert any("rejected the reply of node 12" in r.getMessage() and "negative diagonal entry (-2)" in r.getMessage()
               for r in caplog.records)
    assert strategy.accepted_round.get(1) is None and strategy.accepted_round[0] == strategy.accepted_round[2] == 1


def test_a_mixed_preconditioner_that_is_not_positive_definite_stops_the_round_in_one_line(server_identity):
    """A diverged (or malformed) client whose preconditioner makes the damped sum
    indefinite stops the run with a RoundFailedError naming the fix, not a
    ValueError traceback from the Cholesky factorisation."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedaccel.errors import RoundFailedError
    from fedaccel.registry import get_algorithm
    from fedaccel.membership import Federation
    from fakes import StubGrid

    cfg = parse_run_config(fuse(default_run_config(), {"algo": "fedpm", "clients-per-round": 2}))
    strategy = get_algorithm("fedpm").build_strategy(cfg, Federation({0: 11, 1: 12}))
    model = ArrayRecord({"fc.weight": Array(np.ones((2, 2), dtype=np.float32)),
                         "fc.bias": Array(np.zeros(2, dtype=np.float32))})
    msgs = list(strategy.configure_train(1, model, ConfigRecord(), StubGrid([11, 12])))
    replies = []
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"m{i}"
        precond = INDEFINITE.astype(np.float32)  # indefinite even after damping 1
        replies.append(Message(RecordDict({
            "arrays": model,
            "metrics": MetricRecord({"num-examples": 10, "train-loss": 1.0}),
            PRECOND_KEY: ArrayRecord({"fc": Array(foof.pack_upper(torch.from_numpy(precond)).numpy())}),
        }), reply_to=m))
    with pytest.raises(RoundFailedError) as info:
        strategy.aggregate_train(1, replies)
    msg = str(info.value)
    assert "round 1" in msg and "not positive definite" in msg and "fedpm.damping" in msg
    assert "\n" not in msg


def test_a_reply_whose_own_preconditioner_has_no_factor_is_rejected_alone(server_identity, caplog):
    """One client uploads a matrix no FOOF pass makes (indefinite even after
    damping, its diagonal positive): the mix fails, that reply is rejected
    as a malformed one is (logged, counted, its client not committed) and
    the other two are mixed, exactly as if only they had replied."""
    rng = np.random.default_rng(1)
    sound = {pid: (lambda a: a @ a.T / 3)(rng.normal(size=(3, 3))) for pid in (0, 2)}
    strategy, out, sent = fedpm_round(lambda pid: sound.get(pid, INDEFINITE), lambda pid: 10 + pid)
    expected = preconditioned_mix([sent[0], sent[2]], float(strategy.run_cfg.algo_params.damping))
    for key, value in expected.items():
        np.testing.assert_array_equal(out[key].numpy(), value)
    log = strategy.rounds[1]
    assert (log.rejected, log.failures, log.replies) == (1, 1, 2)
    said = [r.getMessage() for r in caplog.records]
    assert any("rejected the reply of node 12" in m and "no FOOF pass uploads" in m for m in said)
    assert any("1 of 3 sampled clients failed or were rejected in all; aggregating the other 2" in m for m in said)
    assert strategy.accepted_round.get(1) is None and strategy.accepted_round[0] == strategy.accepted_round[2] == 1


# ------------------------------------------------- FOOF passes per round
def count_foof(monkeypatch) -> list[int]:
    """Count calls of fedaccel.clients.foof.compute_foof (the solver calls it through the module)."""
    calls = []
    real = foof.compute_foof

    def counting(model, x, *args, **kwargs):
        calls.append(int(x.shape[0]))
        return real(model, x, *args, **kwargs)

    monkeypatch.setattr(foof, "compute_foof", counting)
    return calls


@pytest.mark.parametrize("algo", ["fedpm", "localnewton"])
def test_foof_is_computed_once_per_round(monkeypatch, algo):
    """Default settings: one FOOF pass per round (6 local steps), at the received
    model, and FedPM uploads that very matrix (the one it stepped with)."""
    calls = count_foof(monkeypatch)
    cfg = run_cfg(algo=algo, **{"batch-size": 4})
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    model = make_mlp()
    start = flat(model)
    solver = (FedPMSolver if algo == "fedpm" else LocalNewtonSolver)(cfg)
    arrays, packed, _ = client_round(solver, model, start, x, y, 0.1, epochs=2)
    assert calls == [12]
    assert not np.allclose(arrays["1.weight"], start["1.weight"])  # it did train
    if algo == "fedpm":  # A of layer 1 at the received model, by hand: [x | 1]^T [x | 1] / n
        xt = torch.cat([x, torch.ones(12, 1, dtype=x.dtype)], 1)
        torch.testing.assert_close(foof.unpack_upper(torch.from_numpy(packed["1"])), xt.T @ xt / 12)


@pytest.mark.parametrize("overrides, passes", [
    ({"fedpm.upload": "end"}, 2),            # + the paper's end-of-round matrix
    ({"fedpm.refresh-every": 2}, 3),          # steps 0, 2, 4 of 6
    ({"fedpm.refresh-every": 2, "fedpm.upload": "end"}, 4),
])
def test_extra_foof_passes_only_when_asked(monkeypatch, overrides, passes):
    calls = count_foof(monkeypatch)
    cfg = run_cfg(algo="fedpm", **{"batch-size": 4, **overrides})
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    model = make_mlp()
    client_round(FedPMSolver(cfg), model, flat(model), x, y, 0.1, epochs=2)
    assert len(calls) == passes


# ------------------------------------------------------- gradient clipping
def raw_gradient_norm(x, y, state, wd):
    """Norm of the regularised full-batch gradient (all parameters) at ``state``."""
    model = make_mlp()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return float(torch.sqrt(sum(((g + wd * p.detach()) ** 2).sum()
                                for g, p in zip(grads, model.parameters()))))


def test_fedpm_clips_the_preconditioned_direction():
    """One full-batch FOOF step with clip-norm c below the direction's norm moves
    the weights by exactly lr * c along the unclipped step (all parameters
    together): the clip acts on G~ (A + damping I)^-1, not on the raw gradient."""
    g = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(20, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (20,), generator=g)
    lr, common = 0.5, {"batch-size": 64, "momentum": 0.0, "weight-decay": 0.01, "fedpm.damping": 0.1}
    start = flat(make_mlp())

    def delta(clip):
        arrays, _, _ = client_round(FedPMSolver(run_cfg(algo="fedpm", **{"clip-norm": clip, **common})),
                                    make_mlp(), start, x, y, lr)
        return np.concatenate([(arrays[k] - start[k]).ravel() for k in start])

    free = delta(0)
    norm = float(np.linalg.norm(free)) / lr  # the preconditioned direction's norm
    clip = norm / 4
    # torch scales by clip / (norm + 1e-6): a relative 1.5e-6 here.
    np.testing.assert_allclose(delta(clip), free * clip / norm, rtol=1e-5, atol=1e-12)
    # Clipping the raw gradient instead would scale by clip / ||G~||, another factor:
    assert abs(raw_gradient_norm(x, y, start, 0.01) - norm) > 0.1 * norm


def test_exact_mode_refuses_clipping():
    from fedaccel.strategies.fedpm import check_exact_mode

    for algo in ("fedpm", "localnewton"):
        cfg = run_cfg(algo=algo, model="logreg", **{f"{algo}.mode": "exact", "clip-norm": 1.0,
                                                    "weight-decay": 0.01})
        for check in (check_exact_mode, {"fedpm": FedPMSolver, "localnewton": LocalNewtonSolver}[algo]):
            with pytest.raises(ConfigError) as info:
                check(cfg)
            msg = str(info.value)
            assert "clip-norm" in msg and "exact" in msg and "\n" not in msg


# ---------------------------------------- exact mode with several local steps
def hessian_count(monkeypatch) -> list[int]:
    import fedaccel.clients.fedpm as module

    calls = []
    real = module.logreg_hessian

    def counting(theta, xt, wd, *args, **kwargs):
        calls.append(1)
        return real(theta, xt, wd, *args, **kwargs)

    monkeypatch.setattr(module, "logreg_hessian", counting)
    return calls


@pytest.mark.parametrize("refresh", [0, 1])
def test_exact_mode_several_steps_by_hand(monkeypatch, refresh):
    """Two local Newton steps per round (lr 0.5, damping 0.1, three clients).

    refresh-every = 0: both steps use M_i = H_i(theta) + damping I (the Hessian
    at the received model: one Hessian per round), FedPM uploads H_i(theta)
    and the round is exactly theta - lr (sum p_i M_i)^-1 sum_i p_i (g_i(theta) +
    g_i(theta_i^1)). refresh-every = 1: the second step uses the Hessian at the
    first local iterate, which is also what is uploaded."""
    calls = hessian_count(monkeypatch)
    wd, damping, lr = 1e-2, 0.1, 0.5
    shards, _, _ = breast_cancer_clients()
    shards = shards[2:5]
    model = LogReg(30, 2).double()
    torch.manual_seed(0)
    theta = 0.1 * torch.randn(62, dtype=torch.float64)
    w = theta.reshape(2, 31)
    start = {"fc.weight": w[:, :30].numpy().copy(), "fc.bias": w[:, 30].numpy().copy()}
    cfg = run_cfg(algo="fedpm", model="logreg", **{"weight-decay": wd, "fedpm.mode": "exact",
                                                   "fedpm.damping": damping,
                                                   "fedpm.refresh-every": refresh})
    eye = torch.eye(62, dtype=torch.float64)
    clients, m_sum, r_sum, n = [], 0, 0, sum(len(ys) for _, ys in shards)
    for xs, ys in shards:
        arrays, packed, n_i = client_round(FedPMSolver(cfg), model, start, xs, ys, lr, epochs=2)
        clients.append((arrays, packed, n_i))
        g0, h0 = objective_terms(theta, xs, ys, wd)
        theta1 = theta - lr * torch.linalg.solve(h0 + damping * eye, g0)
        g1, h1 = objective_terms(theta1, xs, ys, wd)
        h_step2 = h0 if refresh == 0 else h1
        theta2 = theta1 - lr * torch.linalg.solve(h_step2 + damping * eye, g1)
        torch.testing.assert_close(as_theta(arrays), theta2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(foof.unpack_upper(torch.from_numpy(packed["fc"])), h_step2,
                                   rtol=1e-10, atol=1e-12)
        p = len(ys) / n
        m_sum = m_sum + p * (h0 + damping * eye)
        r_sum = r_sum + p * (g0 + g1)
    assert len(calls) == (1 if refresh == 0 else 2) * len(shards)
    mixed = as_theta(preconditioned_mix(clients, damping))
    if refresh == 0:  # appendix B, eq. (16), with a constant preconditioner per client
        torch.testing.assert_close(mixed, theta - lr * torch.linalg.solve(m_sum, r_sum),
                                   rtol=1e-9, atol=1e-11)


# ------------------------------------- Test 1 as run config (fast runner, float64)
@pytest.fixture
def one_torch_thread():
    """One torch thread, as bench/fedpm_test1.py runs (and fast on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_test1_run_of_the_fast_runner_is_the_bench_scripts_run_in_float64(monkeypatch, tmp_path, one_torch_thread):
    """The run config bench/fedpm_test1.py gives its FedPM run, run by the fast
    runner (breast-cancer, label-sorted, float64, near-optimum start,
    optimality): the global model stays float64, the optimum, the start and
    every round's gap and distance are the script's own (its client runtime
    replaced, its optimum by its own Newton run), here bit for bit; a float32
    run of the same keys is 1e-8 away."""
    from test_configs import _bench

    bench = _bench(monkeypatch, "fedpm_test1")
    rounds = 3
    prob = bench.problem(10)
    run = next(r for r in bench.make_runs(rounds, 10) if r["method"] == "FedPM (exact)")
    dist, gap, status = bench.run_method(run["algo"], run["method_overrides"], prob["shards"], prob["start"],
                                         rounds, prob["measure"])
    assert status == "ok"

    def fast_run(**changes):
        config = fuse(default_run_config(), {**run["overrides"], **changes, "results-dir": str(tmp_path),
                                             "run-name": "-".join(map(str, changes.values())) or "cell"})
        run_dir = run_local(config, num_clients=10, quiet=True)
        optimum = json.loads((run_dir / "config.json").read_text())["resolved"]["optimum"]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        final = np.load(run_dir / "final_model.npz")
        return (optimum, [optimum["start-gap"]] + [r["gap"] for r in rows],
                [optimum["start-dist"]] + [r["dist"] for r in rows], final)

    optimum, gaps, dists, final = fast_run()
    assert {k: final[k].dtype for k in final.files} == {"fc.weight": np.float64, "fc.bias": np.float64}
    assert optimum["f-star"] == prob["f_star"] and optimum["start-dist"] == prob["start_dist"]
    assert len(gaps) == len(gap) == rounds + 1
    np.testing.assert_allclose(gaps, gap, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dists, dist, rtol=0, atol=1e-12)
    assert gaps == gap and dists == dist  # in fact the same bits
    assert dists[3] < 1e-3 * dists[0]  # superlinear: 0.837, 0.125, 1.2e-2, 1.9e-4

    _, gaps32, _, final32 = fast_run(precision="float32")
    assert final32["fc.weight"].dtype == np.float32
    assert 1e-12 < max(abs(a - b) for a, b in zip(gaps32[1:], gap[1:])) < 1e-5


# ------------------------------------------------- the cohort's FOOF pass
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
# all chunks at once, a few chunks at a time (70 kB: 2 to 4 chunks of these
# models, by stacked_foof's estimate), or one chunk at a time
@pytest.mark.parametrize("max_bytes", [64 << 20, 70_000, 1])
@pytest.mark.parametrize("batch_size", [4, 32])  # chunks across clients' sizes, or every client in one chunk
def test_stacked_foof_is_each_clients_compute_foof(dtype, rtol, max_bytes, batch_size):
    """C clients' FOOF matrices at once, each at its own weights: ragged sizes
    across chunk boundaries (1, 5, 7, 8, 9, 20 rows in chunks of 4), or every
    client in one chunk padded to the largest (20 rows, in chunks of 32), the
    hidden layer's input included (relu of the client's first layer)."""
    from fedaccel.models import build_model

    torch.manual_seed(0)
    template = build_model("mlp", (6,), 3).to(dtype)
    sizes = [9, 1, 20, 8, 5, 7]
    models, xs = [], []
    for n in sizes:
        m = build_model("mlp", (6,), 3).to(dtype)  # a different random model per client
        models.append(m)
        xs.append(torch.randn(n, 6, dtype=dtype))
    weights = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
               for name, _ in template.named_parameters()}
    layers = [name for name, _ in foof.foof_layers(template)]
    got = foof.stacked_foof(template.batched_layer_inputs, layers, weights, xs, batch_size=batch_size, max_bytes=max_bytes)
    assert list(got) == layers
    for c, (m, x) in enumerate(zip(models, xs)):
        want = foof.compute_foof(m, x, batch_size=batch_size)
        for name in layers:
            assert got[name][c].dtype == torch.float64
            torch.testing.assert_close(got[name][c], want[name], rtol=rtol, atol=rtol, msg=f"client {c} {name}")
    # and independently of compute_foof: the first layer's matrix is [x | 1]^T [x | 1] / n
    x = xs[2].to(torch.float64)
    xt = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    torch.testing.assert_close(got[layers[0]][2], xt.T @ xt / len(x), rtol=rtol, atol=rtol)
    # `only`: the later layers' matrices alone, the same bits (the first layer's input
    # is the data, so the trainer's pass at the trained weights reuses that one)
    later = foof.stacked_foof(template.batched_layer_inputs, layers, weights, xs, batch_size=batch_size,
                              max_bytes=max_bytes, only=layers[1:])
    assert list(later) == layers[1:] and all(torch.equal(later[n], got[n]) for n in layers[1:])
    moved = {name: w + 1.0 for name, w in weights.items()}  # other weights: the first layer's matrix stays
    again = foof.stacked_foof(template.batched_layer_inputs, layers, moved, xs, batch_size=batch_size, max_bytes=max_bytes)
    assert torch.equal(again[layers[0]], got[layers[0]]) and not torch.equal(again[layers[1]], got[layers[1]])


@pytest.mark.parametrize("max_bytes", [64 << 20, 65_000, 1])  # all chunks, 3 at a time, or 1
def test_stacked_foof_sums_each_clients_chunks_in_order(max_bytes):
    """The float64 sum of a client's chunks in chunk order, as compute_foof
    adds them, to the bit: each chunk has one nonzero row of +-2^k entries, so
    every chunk's matrix is exact and only the order of the sums can move the
    bits (checked: the reversed order does, for this draw)."""
    from fedaccel.models import build_model

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    sizes, batch_size = [9, 1, 20, 8, 5, 7, 13], 2

    def one_row_per_chunk(n: int) -> torch.Tensor:
        x = torch.zeros(n, 6, dtype=torch.float64)
        for start in range(0, n, batch_size):
            row = rng.choice([-1.0, 1.0], size=6) * np.exp2(rng.integers(-26, 27, size=6))
            x[start + rng.integers(0, min(batch_size, n - start))] = torch.from_numpy(row)
        return x

    template = build_model("mlp", (6,), 3).double()
    models = [build_model("mlp", (6,), 3).double() for _ in sizes]
    xs = [one_row_per_chunk(n) for n in sizes]
    weights = {name: torch.stack([dict(m.named_parameters())[name].detach() for m in models])
               for name, _ in template.named_parameters()}
    layers = [name for name, _ in foof.foof_layers(template)]
    got = foof.stacked_foof(template.batched_layer_inputs, layers, weights, xs, batch_size=batch_size,
                            max_bytes=max_bytes, only=layers[:1])
    sensitive = 0
    for c, (m, x) in enumerate(zip(models, xs)):
        want = foof.compute_foof(m, x, batch_size=batch_size)[layers[0]]
        assert torch.equal(got[layers[0]][c], want), f"client {c}"
        backwards = torch.cat(list(torch.split(x, batch_size))[::-1])
        sensitive += not torch.equal(foof.compute_foof(m, backwards, batch_size=batch_size)[layers[0]], want)
    assert sensitive >= 2  # the check can see the order


def test_a_foof_pass_pads_each_group_of_last_chunks_to_its_own_widest():
    """The chunks of a power-law cohort (the benchmark's 100 Synthetic
    clients have 40 to 800 rows): full chunks first, in order, then the
    clients' last chunks by size in up to four groups, each padded to its
    widest; every chunk once, a client's last chunk after its full ones,
    and far fewer padded rows than padding every chunk to 128."""
    rng = np.random.default_rng(0)
    counts = np.minimum(40 + rng.pareto(1.2, size=100) * 60, 800).astype(int)
    batch = 128
    per_client = -(-counts // batch)
    owner = np.repeat(np.arange(len(counts)), per_client)
    position = np.arange(len(owner)) - np.repeat(np.cumsum(per_client) - per_client, per_client)
    real = np.minimum(counts[owner] - position * batch, batch)
    groups = foof._chunk_groups(real, batch)
    order = np.concatenate([chunks for chunks, _ in groups])
    assert sorted(order.tolist()) == list(range(len(real)))  # every chunk once
    for chunks, width in groups:
        assert real[chunks].max() == width  # padded to its own widest, no more
    first, *rest = groups
    assert first[1] == batch and np.array_equal(first[0], np.flatnonzero(real == batch))  # full ones, in order
    assert len(rest) == 4 and all(len(set(owner[c])) == len(c) for c, _ in rest)  # one last chunk a client
    slots = sum(len(chunks) * width for chunks, width in groups)
    assert slots - counts.sum() < 0.5 * (len(real) * batch - counts.sum())


@pytest.mark.parametrize("d", [1, 2, 5, 62])
def test_unpacking_a_stack_of_upper_triangles_is_unpack_upper_of_each(d):
    rng = np.random.default_rng(d)
    a = torch.from_numpy(rng.standard_normal((3, d, d)))
    a = a + a.mT
    packed = foof.pack_upper_stacked(a)
    assert packed.shape == (3, d * (d + 1) // 2)
    got = foof.unpack_upper_stacked(packed, d)
    assert torch.equal(got, a)
    assert all(torch.equal(got[c], foof.unpack_upper(packed[c])) for c in range(3))


def fedpm_jobs(cfg, model, datas):
    from fedaccel.clients.cohort import CohortJob
    from fedaccel.clients.state import ContextState
    from fedaccel.torch_utils import state_to_arrays
    from flwr.app import RecordDict

    start = state_to_arrays(model)
    return [CohortJob(solver=FedPMSolver(cfg), data=data, arrays=start, config=train_config_record(1, 0.1, 1),
                      state=ContextState(RecordDict()), generator=torch.Generator().manual_seed(c))
            for c, data in enumerate(datas)]


def ragged_mlp_clients() -> tuple[nn.Module, list[TrainData]]:
    """Three clients of 5, 12 and 3 samples (6 features, 3 classes) and the
    6-32-3 MLP, seeded."""
    from fedaccel.models import build_model

    torch.manual_seed(0)
    datas = [TrainData(torch.randn(n, 6), torch.randint(0, 3, (n,))) for n in (5, 12, 3)]
    return build_model("mlp", (6,), 3), datas


@pytest.mark.parametrize("upload", ["auto", "end"])
def test_a_batched_fedpm_round_makes_no_per_client_foof_pass(monkeypatch, upload):
    """With an MLP the cohort trainer forms every client's FOOF matrices in
    one batched pass before the steps (and one after them for
    ``upload='end'``), not one pass per client; a CNN has no batched layer
    inputs and keeps the per-client pass (its equivalence: test_cohort)."""
    from fedaccel.clients.cohort import fit_cohort
    from fedaccel.models import build_model

    calls = count_foof(monkeypatch)
    stacked = []
    real = foof.stacked_foof
    monkeypatch.setattr(foof, "stacked_foof", lambda *a, **k: stacked.append(len(a[3])) or real(*a, **k))
    cfg = run_cfg(algo="fedpm", **{"batch-size": 4, "fedpm.upload": upload})
    model, datas = ragged_mlp_clients()
    jobs = fedpm_jobs(cfg, model, datas)
    shown = []  # each client's matrices as the per-client upload would pack them
    real_end = FedPMSolver.end_round

    def end_round(self, model, state):
        matrices = self.used if self.upload_which == "used" else self._end_matrices
        shown.append(self._precond_record(matrices, torch.float32)[PRECOND_KEY])
        return real_end(self, model, state)
    monkeypatch.setattr(FedPMSolver, "end_round", end_round)
    results = fit_cohort(build_model("mlp", (6,), 3), jobs, 4)
    monkeypatch.setattr(FedPMSolver, "end_round", real_end)
    assert all(PRECOND_KEY in r.extra for r in results)
    # the uploads are rows of one packed stack per layer, byte for byte the per-client packing
    for r, want in zip(results, shown):
        got = r.extra[PRECOND_KEY]
        assert list(got.keys()) == list(want.keys()) and all(type(got[k]) is DeferredArray for k in got.keys())
        assert all((got[k].dtype, got[k].shape, got[k].data) == (want[k].dtype, want[k].shape, want[k].data)
                   for k in got.keys())
    assert calls == []
    assert stacked == ([3, 3] if upload == "end" else [3])
    cnn = build_model("cnn-small", (1, 8, 8), 3)
    images = [TrainData(torch.randn(n, 1, 8, 8), torch.randint(0, 3, (n,))) for n in (5, 3)]
    stacked.clear()
    fit_cohort(cnn, fedpm_jobs(cfg, cnn, images), 4)
    assert stacked == [] and len(calls) == 2 * (2 if upload == "end" else 1)


@pytest.mark.parametrize("bug", [False, True])
def test_a_batched_client_without_a_cholesky_factor_fails_alone(monkeypatch, bug):
    """A client whose damped FOOF matrix has no Cholesky factor gets the
    error its own before_steps raises; the other clients of the batch train
    and reply as usual. Not only a user error: whatever the batched FOOF
    pass returns for one client (``bug``: a RuntimeError in place of the
    missing factor's error) is that client's result alone."""
    from fedaccel.clients.cohort import fit_cohort

    real = foof.damped_cholesky_ex

    def second_client_fails(a, damping):
        factor, info = real(a, damping)
        if a.dim() == 3:
            info = info.clone()
            info[1] = 2
        return factor, info
    monkeypatch.setattr(foof, "damped_cholesky_ex", second_client_fails)
    if bug:
        monkeypatch.setattr(foof, "not_positive_definite", lambda size, damping, algo="fedpm": RuntimeError("boom"))
    cfg = run_cfg(algo="fedpm", **{"batch-size": 4})
    model, datas = ragged_mlp_clients()
    jobs = fedpm_jobs(cfg, model, datas)
    results = fit_cohort(copy.deepcopy(model), jobs, 4)
    if bug:
        assert isinstance(results[1], RuntimeError) and str(results[1]) == "boom"
    else:
        assert isinstance(results[1], ConfigError) and "not positive definite" in str(results[1])
        assert "fedpm.damping" in str(results[1])
    assert not getattr(jobs[1].solver, "used", None) and getattr(jobs[1].solver, "_x_foof", None) is None  # holds nothing
    assert [r.metrics["num-examples"] for r in (results[0], results[2])] == [5, 3]


@pytest.mark.parametrize("name", MODELS)
def test_the_server_expects_the_preconditioners_a_client_uploads_for_every_model(name):
    """``preconditioner_layout`` (what the server accepts, read from the
    model's arrays) names exactly the layers FOOF preconditions
    (``foof_layers``) with their triangles' sizes, for every registered
    model; and the full Hessian's for the logistic regression."""
    from fedaccel.models import build_model
    from fedaccel.strategies.preconditioned_mixing import preconditioner_layout

    shape = (3, 32, 32) if name in ("cifar-cnn", "resnet18", "resnet20") else (1, 28, 28)
    model = build_model(name, (12,) if name in ("logreg", "mlp", "mlp200") else shape, 10)
    arrays = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    uploaded = [(layer, (foof.input_dim(m) * (foof.input_dim(m) + 1) // 2,)) for layer, m in foof.foof_layers(model)]
    assert uploaded and preconditioner_layout(arrays, full=False) == uploaded
    if name == "logreg":
        d = 10 * 13  # out x (in + 1): the exact mode's Hessian
        assert preconditioner_layout(arrays, full=True) == [("fc", (d * (d + 1) // 2,))]


@pytest.mark.parametrize("algo", ["fedpm", pytest.param("localnewton", marks=pytest.mark.slow)])
def test_a_run_whose_clients_have_no_cholesky_factor_fails_them_alone_batched_or_not(tmp_path, caplog, algo):
    """The fast runner's batched round fails exactly the clients the
    per-client round fails (damping 0: the FOOF matrices of the clients
    with fewer samples than inputs are singular), with the same one-line
    user error naming the algorithm's own key; the others train, and both
    runs finish with the same metrics to float32 rounding. (A batched
    failure was once raised for the whole cohort: every client failed and
    the run stopped.)"""
    rows, models, causes = {}, {}, {}
    for batching in ("off", "on"):
        cfg = fuse(default_run_config(), {
            "algo": algo, "model": "logreg", f"{algo}.damping": 0.0, "synthetic.min-samples": 20,
            "synthetic.size-mu": 3.0, "num-server-rounds": 2, "clients-per-round": 10, "accl-every": 0,
            "cohort-batching": batching, "results-dir": str(tmp_path), "run-name": batching})
        caplog.clear()
        run_dir = run_local(cfg, num_clients=10, quiet=True)
        rows[batching] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        models[batching] = np.load(run_dir / "final_model.npz")
        causes[batching] = {r.getMessage().split("): ", 1)[1] for r in caplog.records
                            if "client failed in round" in r.getMessage()}
    assert causes["on"] == causes["off"] == {
        f"{algo}: preconditioner of size 61 is not positive definite (damping=0.0); "
        f"increase {algo}.damping (or weight-decay in the exact mode)"}
    for off, on in zip(rows["off"], rows["on"]):
        assert 0 < on["failures"] == off["failures"] < 10 and on["clients"] == off["clients"]
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-4)
    for key in models["off"].files:  # undamped solves magnify float32 rounding (1.5e-4 seen)
        np.testing.assert_allclose(models["on"][key], models["off"][key], rtol=0, atol=1e-3)


@pytest.mark.parametrize("upload", ["used", "end"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_uploads_are_each_clients_packing_across_chunks_and_a_failed_client(monkeypatch, upload, dtype):
    """The batched uploads are rows of per-chunk packed stacks; with a client
    of a chunk failing before its steps (so its stack has a row nobody
    uploads) and a three-layer chain, each reply still holds, byte for byte,
    what packing its own matrices gives (the matrix it stepped with, or the
    one at its trained weights); a subclass that packs its own way gets its
    own packing."""
    from fedaccel.clients.cohort import fit_cohort
    from fedaccel.models import build_model

    real = foof.damped_cholesky_ex

    def client_1_fails(a, damping):  # the second client of the first chunk
        factor, info = real(a, damping)
        if a.dim() == 3 and a.shape[0] == 3:
            info = info.clone()
            info[1] = 2
        return factor, info
    monkeypatch.setattr(foof, "damped_cholesky_ex", client_1_fails)
    shown = {}  # each client's own packing of the matrices it uploads
    real_end = FedPMSolver.end_round

    def end_round(self, model, state):
        matrices = self.used if self.upload_which == "used" else self._end_matrices
        shown[id(self)] = self._precond_record(matrices, dtype)[PRECOND_KEY]
        return real_end(self, model, state)
    monkeypatch.setattr(FedPMSolver, "end_round", end_round)

    class Half(FedPMSolver):  # packs its uploads in float16
        def _precond_record(self, matrices, dtype):
            return super()._precond_record(matrices, torch.float16)

    cfg = run_cfg(algo="fedpm", **{"batch-size": 4, "fedpm.upload": upload})
    torch.manual_seed(0)
    datas = [TrainData(torch.randn(n, 6, dtype=dtype), torch.randint(0, 3, (n,))) for n in (5, 12, 3, 9, 2)]
    model = build_model("mlp200", (6,), 3).to(dtype)  # three preconditioned layers
    for solver_type in (FedPMSolver, Half):
        jobs = fedpm_jobs(cfg, model, datas)
        for job in jobs:
            job.solver.__class__ = solver_type
        results = fit_cohort(copy.deepcopy(model), jobs, 4, max_clients=3)
        assert isinstance(results[1], ConfigError)
        for job, r in zip(jobs, results):
            if isinstance(r, BaseException):
                continue
            got, want = r.extra[PRECOND_KEY], shown[id(job.solver)]
            assert list(got.keys()) == list(want.keys()) == ["fc1", "fc2", "fc"]
            assert all(type(got[k]) is (DeferredArray if solver_type is FedPMSolver else Array)
                       for k in got.keys())
            assert all((got[k].dtype, got[k].shape, got[k].data) == (want[k].dtype, want[k].shape, want[k].data)
                       for k in got.keys())
        if solver_type is Half:
            assert all(r.extra[PRECOND_KEY]["fc"].dtype == "float16" for r in results if not isinstance(r, Exception))


def test_a_batched_run_says_when_its_foof_matrices_are_formed_client_by_client():
    """The issue's rule: a part the cohort trainer cannot batch is done per
    client with one line saying why. FedPM's and LocalNewton's FOOF passes
    are batched for chains of Linear layers only; on a CNN the run's line
    says they are formed one client at a time; nothing is said where they
    are batched, or where the whole round trains per client anyway."""
    from fedaccel.clients.cohort import own_batched
    from fedaccel.models import build_model
    from fedaccel.registry import get_algorithm

    def note(algo, name, shape, **changes):
        model = build_model(name, shape, 3)
        solver = get_algorithm(algo).solver(run_cfg(algo=algo, **changes))
        return solver.cohort_note(model, own_batched(model, "batched_layer_inputs"))
    for algo in ("fedpm", "localnewton"):
        assert note(algo, "cnn-small", (1, 8, 8)) == (
            f"{algo}'s FOOF matrices are formed one client at a time: the batched pass covers chains of "
            "Linear layers with biases (the MLPs, the logistic regression)")
        assert note(algo, "mlp", (6,)) is None and note(algo, "logreg", (6,)) is None
    assert note("fedpm", "cnn-small", (1, 8, 8), **{"fedpm.refresh-every": 2}) is None  # per client anyway
    assert note("fedavg", "cnn-small", (1, 8, 8)) is None

    class OwnPass(FedPMSolver):  # its own before_steps: FOOF per client on any model, and the line says why
        def before_steps(self, model, data, generator):
            super().before_steps(model, data, generator)
    model = build_model("mlp", (6,), 3)
    assert OwnPass(run_cfg(algo="fedpm")).cohort_note(model, own_batched(model, "batched_layer_inputs")) == (
        "fedpm's FOOF matrices are formed one client at a time: OwnPass has round hooks of its own")


def test_a_cohort_nodes_line_carries_the_note(monkeypatch):
    """A cohort node's line for the server's log ends with the same note."""
    import fedaccel.apps.client_app as client_app

    monkeypatch.setattr(client_app, "cohort_fallback", lambda context: None)
    monkeypatch.setattr(client_app, "cohort_note", lambda context: "fedpm's FOOF matrices are formed ...")
    monkeypatch.setattr(client_app, "train_cohort", lambda items: ["replies"])
    assert client_app._train_slice([("message", "context")]) == (
        ["replies"], "each node trains its clients of a round as one batched model; "
                     "fedpm's FOOF matrices are formed ...")
    monkeypatch.setattr(client_app, "cohort_note", lambda context: None)
    assert client_app._train_slice([("message", "context")])[1] == (
        "each node trains its clients of a round as one batched model")


def client_by_client_mix(clients, damping):
    """The mixing of eq. (12)/(10) written client by client, for one layer
    ``l`` (FOOF or full) and the weighted mean of the rest."""
    total = sum(n for _, _, n in clients)
    m_sum = r_sum = None
    for arrays, pre, n in clients:
        p = n / total
        w = torch.cat([torch.from_numpy(arrays["l.weight"].astype(np.float64)),
                       torch.from_numpy(arrays["l.bias"].astype(np.float64)).reshape(-1, 1)], 1)
        packed = torch.from_numpy(pre["l"].astype(np.float64))
        m = foof.unpack_upper(packed) + damping * torch.eye(foof.triangle_side(packed.numel()), dtype=torch.float64)
        r = w @ m if m.shape[0] == w.shape[1] else m @ w.reshape(-1)
        m_sum = p * m if m_sum is None else m_sum + p * m
        r_sum = p * r if r_sum is None else r_sum + p * r
    factor = torch.linalg.cholesky(m_sum)
    mixed = (foof.right_solve(r_sum, factor) if r_sum.dim() == 2
             else torch.cholesky_solve(r_sum.reshape(-1, 1), factor).reshape(w.shape))
    rest = sum(n / total * torch.from_numpy(arrays["other"].astype(np.float64)) for arrays, _, n in clients)
    dtype = clients[0][0]["l.weight"].dtype
    return {"l.weight": mixed[:, :-1].numpy().astype(dtype), "l.bias": mixed[:, -1].numpy().astype(dtype),
            "other": rest.numpy().astype(dtype)}


@pytest.mark.parametrize("group", [None, 1, 2, 3])  # all clients' matrices at once, or so many at a time
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("out, inp, full", [(5, 7, False), (128, 60, False), (2, 3, True)])
def test_the_grouped_mix_is_bit_for_bit_the_client_by_client_sums(monkeypatch, group, dtype, out, inp, full):
    """The server unpacks, damps and scales a group of clients' matrices at
    once; products and sums stay client by client in reply order, so the
    mixed model is the client-by-client one to the bit."""
    import fedaccel.strategies.preconditioned_mixing as mixing

    d = out * (inp + 1) if full else inp + 1
    if group is not None:  # MIX_GROUP_BYTES // (2 d^2 8) clients a group
        monkeypatch.setattr(mixing, "MIX_GROUP_BYTES", group * 2 * d * d * 8)
    rng = np.random.default_rng(0)
    clients = []
    for _ in range(9):
        arrays = {"l.weight": rng.standard_normal((out, inp)).astype(dtype),
                  "l.bias": rng.standard_normal(out).astype(dtype),
                  "other": rng.standard_normal(4).astype(dtype)}
        a = torch.from_numpy(rng.standard_normal((d, d)))
        clients.append((arrays, {"l": foof.pack_upper(a @ a.T / d).numpy().astype(dtype)},
                        float(rng.integers(1, 50))))
    got, want = preconditioned_mix(clients, 0.3), client_by_client_mix(clients, 0.3)
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


def test_preconditioners_of_different_sizes_are_refused_in_one_line():
    arrays = {"l.weight": np.zeros((2, 3), np.float32), "l.bias": np.zeros(2, np.float32)}
    foof4 = {"l": foof.pack_upper(torch.eye(4)).numpy()}
    full8 = {"l": foof.pack_upper(torch.eye(8)).numpy()}
    with pytest.raises(ValueError, match="sizes 4 and 8"):
        preconditioned_mix([(arrays, foof4, 1.0), (arrays, full8, 1.0)], 0.1)
    with pytest.raises(ValueError, match="size 5 fits neither 4 .FOOF. nor 8 .full."):
        preconditioned_mix([(arrays, foof4, 1.0), (arrays, {"l": foof.pack_upper(torch.eye(5)).numpy()}, 1.0)], 0.1)


def test_a_subclass_with_its_own_round_hooks_gets_the_per_client_calls():
    """The cohort hooks stand in for FedPM's own ``before_steps`` and
    ``end_round``: a subclass that changes one of them is called per client
    and uploads through its own ``upload``."""
    from fedaccel.clients.cohort import fit_cohort
    from fedaccel.models import build_model

    calls = []

    class Logged(FedPMSolver):
        def before_steps(self, model, data, generator):
            calls.append("before_steps")
            super().before_steps(model, data, generator)

    cfg = run_cfg(algo="fedpm", **{"batch-size": 4})
    torch.manual_seed(0)
    datas = [TrainData(torch.randn(n, 6), torch.randint(0, 3, (n,))) for n in (5, 3)]
    model = build_model("mlp", (6,), 3)
    jobs = fedpm_jobs(cfg, model, datas)
    for job in jobs:
        job.solver = Logged(cfg)
    assert Logged(cfg).reads_trained_model() and not FedPMSolver(cfg).reads_trained_model()
    fit_cohort(copy.deepcopy(model), jobs, 4)
    assert calls == ["before_steps"] * 2


def test_a_foof_pass_without_rows_is_refused_by_both_passes():
    from fedaccel.models import build_model

    model = build_model("mlp", (6,), 3)
    with pytest.raises(ConfigError, match="at least one input row"):
        foof.compute_foof(model, torch.zeros(0, 6))
    weights = {n: p.detach()[None] for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="at least one input row"):
        foof.stacked_foof(model.batched_layer_inputs, ["fc1", "fc"], weights, [torch.zeros(0, 6)])
