"""What a round costs beyond the clients' own training: bare loop vs fast runner vs Ray.

For each workload and algorithm, one invocation times, on this machine:

(a) ``bare``: a plain single-process PyTorch loop written here, with no framework: the
    same data (the project's loaders and partitions), model, cohorts (the project's
    seeded samplers), per-client batch order, local epochs, and the same aggregation
    arithmetic (FedAvg's weighted mean; FedCDR's Douglas-Rachford client step and
    ``x += sum g / n``; FedPM's FOOF-preconditioned local steps and Cholesky
    preconditioned mixing in float64, as the strategy does; SCAFFOLD's corrected
    steps and control variates; FedDC's, with its drift ``h_i`` and the server's
    sum of drifts);
(a') ``tuned``: the same bare loop as a careful engineer tunes a sequential loop of tiny
    steps: each client's batches of an epoch gathered at once, the SGD update as foreach
    arithmetic instead of ``optimizer.step()`` (the same steps and numbers, to the bit);
    the table gives the batched round against it too (``cohort/tuned``);
(b) ``fast``: the project's in-process runner (``fedaccel-run``), clients one after
    another (``cohort-batching='off'``);
(b') ``cohort``: the same runner with the round's clients trained as one batched model
    (``cohort-batching='on'``);
(b'') ``no-steps``: the batched runner with the local steps taken out (every client replies
    the weights it received): what a batched round costs beyond its steps, the per-client
    framework work (messages, records, state, the server's checks and aggregation), which
    no faster step can remove (FedPM's FOOF pass before the steps still runs);
(c) ``ray``: ``flwr run .`` on Flower's Ray simulation engine (a private local SuperLink,
    started cold for every run, 1 CPU per client), one node per client;
(c') ``ray-cohort``: the same with cohort nodes: ``--cohort-nodes`` nodes (default 2, one
    per core here) serve the clients in slices (``logical-clients``), each node training
    its share of a round as one batched model (``cohort-batching='auto'``).

Workloads (100 clients, 10 per round unless ``--per-round``, 1 local epoch):
``mlp-synthetic`` (MLP 60-32-10 on Synthetic-(1,1), batch 16), ``mlp-fmnist`` (MLP
784-128-10 on Fashion-MNIST, batch 32), ``mlp200-fmnist`` (MLP 784-200-200-10, batch 32) and
``cnn-fmnist`` (the McMahan CNN on Fashion-MNIST, batch 32). Server evaluation happens
before round 1 and after the last round only (``eval-every`` = rounds), in all three.

Reported per (workload, algorithm, mode): seconds per round (median over rounds 2..R-1:
not the first, not the last, which carries the final evaluation), start-up (wall time of
the whole process minus the rounds: interpreter, imports, data, model, Ray, teardown),
peak resident memory (``ru_maxrss`` of the process for bare/fast; for ray the peak of the
summed RSS of every process started during the run, which counts shared memory more than
once), and the ratios fast/bare, cohort/bare and ray/bare. Also the cost of one evaluation of the
global model on the server test set.

    python bench/overhead.py --repeat 3                       # everything, ~45 min here
    python bench/overhead.py --workloads mlp-synthetic --modes bare fast --rounds 8
    python bench/overhead.py --scale                          # 100 vs 1,000 clients (fast runner)
    python bench/overhead.py --workloads mlp-synthetic --algos fedavg --modes bare fast cohort \
        --per-round 100 --repeat 3                            # a whole cohort of 100 per round
    python bench/overhead.py --phase table                    # re-tabulate results.jsonl
    python bench/overhead.py --modes bare fast cohort --device cuda   # the same on a GPU (rows say so)
    python bench/overhead.py --workloads mlp-synthetic --modes bare tuned cohort --per-round 100 \
        --repeat 3                                            # batched against both sequential loops
    python bench/overhead.py --workloads mlp-synthetic --algos fedavg --modes bare cohort no-steps \
        --per-round 100 --repeat 3                            # how much of a batched round is not steps
    python bench/overhead.py --workloads cnn-fmnist --algos fedavg --modes cohort --clients 1000 \
        --per-round 1000 --rounds 3 --profile --out /tmp/profiled  # where a round's time goes (cProfile)

Rounds per run: 20 on the MLP workloads, 5 on the CNN (``--rounds`` sets all). With
``--repeat N`` the bare and fast runs of a cell alternate N times (bare, fast, bare, fast...)
(on the MLPs; the CNN's multi-second rounds run once) and the cell reports the median of the
N per-run medians: on a shared 2-core machine a
single 0.06 s-per-round run varies by 10-20 %, and alternating cancels slow drifts. Ray
runs once per cell (its 25-40 s start-up dwarfs that noise).

Every measurement appends a JSON line to ``<out>/results.jsonl`` (a later measurement of
the same cell replaces an earlier one in the table); ``table.md`` is rewritten at the end.
Time it on a quiet machine: anything else running skews every number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp-synthetic": {"dataset": "synthetic", "model": "mlp", "batch-size": 16},
    "mlp-fmnist": {"dataset": "fashion-mnist", "model": "mlp", "batch-size": 32},
    "mlp200-fmnist": {"dataset": "fashion-mnist", "model": "mlp200", "batch-size": 32},
    "cnn-fmnist": {"dataset": "fashion-mnist", "model": "cnn", "batch-size": 32},
}
ALGOS = ("fedavg", "fedcdr", "fedpm", "scaffold", "feddc")
ROUNDS = {"mlp-synthetic": 20, "mlp-fmnist": 20, "mlp200-fmnist": 20, "cnn-fmnist": 5}  # default rounds per run
MODES = ("bare", "fast", "cohort", "ray", "ray-cohort", "no-steps", "tuned")
RAY_MODES = ("ray", "ray-cohort")
MODE_LABELS = {"no-steps": "cohort, no steps", "tuned": "bare, tuned"}  # the table's column names
UNBATCHED: tuple[str, ...] = ()  # algorithms without a cohort mode (none since FedPM batches its FOOF solves)
CONTROL_PORT, HTTP_PORT = "39493", "39491"  # a private local SuperLink (never the user's)


def overrides(workload: str, algo: str, rounds: int, clients: int, run_dir: Path, name: str,
              per_round: int = 10, mode: str = "fast", device: str = "cpu") -> dict[str, Any]:
    cohort_nodes = {"logical-clients": clients, "cohort-batching": "auto"} if mode == "ray-cohort" else {}
    # the bare loop's FedPM uploads the end-of-round FOOF matrix (what the
    # recorded measurements ran; FedPM's default is now upload 'used')
    fedpm = {"fedpm.upload": "end"} if algo == "fedpm" else {}
    return {**fedpm,
        **WORKLOADS[workload], "algo": algo, "num-server-rounds": rounds,
        "clients-per-round": per_round, "local-epochs": 1,
        "cohort-batching": "on" if mode in ("cohort", "no-steps") else "off", "eval-every": rounds, "accl-every": 0,
        "device": device, "seed": 0, "results-dir": str(run_dir), "run-name": name,
        # the bare loop does not clip (FedPM's default is now clip-norm 1.0)
        "clip-norm": 0, **cohort_nodes,
    }


# ----------------------------------------------------------------------------- (a) bare loop

def tuned_run(ov: dict[str, Any], clients: int) -> dict[str, Any]:
    """:func:`bare_run` with the two changes a careful engineer makes to a
    sequential loop of tiny steps (mode ``tuned``): each client's batches of
    an epoch gathered in one indexing of its data (not two small gathers a
    step), and the SGD update written as foreach arithmetic on the
    parameters (``optimizer.step()``'s wrapper costs more than its
    arithmetic on a step of the Synthetic MLP); gradients are dropped
    (``p.grad = None``) before each backward. The same steps, rules and
    numbers."""
    return bare_run(ov, clients, tuned=True)


def bare_run(ov: dict[str, Any], clients: int, tuned: bool = False) -> dict[str, Any]:
    """The reference: plain PyTorch, no messages, records, strategies or solvers
    (``tuned``: :func:`tuned_run`'s loop)."""
    import torch
    import torch.nn.functional as F

    from fedaccel.clients import foof  # FOOF matrix and layer-matrix helpers (pure tensor functions)
    from fedaccel.data import DataConfig, load_federated
    from fedaccel.samplers import cohort
    from fedaccel.torch_utils import seeded_generator, select_device
    from fedaccel.models import build_model

    from fedaccel.local_run import default_run_config, fuse
    cfg = fuse(default_run_config(), ov)
    algo, seed, rounds = cfg["algo"], cfg["seed"], cfg["num-server-rounds"]
    lr, bs, epochs, size = cfg["lr"], cfg["batch-size"], cfg["local-epochs"], cfg["clients-per-round"]
    data = load_federated(DataConfig(
        dataset=cfg["dataset"], num_clients=clients, partition=cfg["partition"],
        dirichlet_alpha=cfg["dirichlet-alpha"], seed=seed, local_test_fraction=cfg["local-test-fraction"]))
    parts = [data.client(i) for i in range(clients)]
    dev = select_device(cfg["device"], bool(cfg.get("tf32", False)))  # the fast runner's TF32 setting too
    train = [(torch.from_numpy(p.x_train).to(dev), torch.from_numpy(p.y_train).to(dev)) for p in parts]
    test_x, test_y = torch.from_numpy(data.test_x).to(dev), torch.from_numpy(data.test_y).to(dev)
    torch.manual_seed(seed)
    model = build_model(cfg["model"], data.input_shape, data.num_classes).to(dev)

    def synchronize() -> None:  # a GPU's queued kernels count in the round that queued them
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    x0 = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    glob = OrderedDict((k, v.clone()) for k, v in x0.items())
    params = dict(model.named_parameters())
    sampler = "reshuffle" if algo == "fedcdr" else "uniform"
    eta, alpha = cfg["fedcdr.eta"], cfg["fedcdr.alpha"]
    damping = cfg["fedpm.damping"]
    dr_state: dict[int, tuple[dict, dict, dict]] = {}
    cv_state: dict[int, dict[str, torch.Tensor]] = {}  # SCAFFOLD's c_i
    c_glob = {n: torch.zeros_like(p) for n, p in params.items()}  # SCAFFOLD's and FedDC's c
    drift_state: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # FedDC's c_i, h_i
    h_glob = {n: torch.zeros_like(p) for n, p in params.items()}  # FedDC's H, the sum of the h_i

    def evaluate() -> float:
        model.load_state_dict(glob)
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(test_x[i:i + 1000]).argmax(1) == test_y[i:i + 1000]).sum())
                      for i in range(0, len(test_y), 1000))
        model.train()
        return correct / len(test_y)

    def local_sgd(x, y, generator, grad_hook=None) -> None:
        if tuned:
            return tuned_sgd(x, y, generator, grad_hook)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg["momentum"],
                              weight_decay=cfg["weight-decay"])
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=generator).to(dev)
            for s in range(0, len(y), bs):
                idx = order[s:s + bs]
                opt.zero_grad(set_to_none=False)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                if grad_hook:
                    grad_hook()
                opt.step()

    def tuned_sgd(x, y, generator, grad_hook=None) -> None:
        """``local_sgd``'s steps and arithmetic (``torch.optim.SGD``'s: weight
        decay into the gradient, then momentum, first buffer the gradient
        itself), the batches of an epoch gathered at once, the update in
        foreach operations."""
        plist = list(model.parameters())
        momentum, decay = cfg["momentum"], cfg["weight-decay"]
        buffers = None
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=generator).to(dev)
            for xb, yb in zip(x[order].split(bs), y[order].split(bs)):
                for p in plist:
                    p.grad = None
                F.cross_entropy(model(xb), yb).backward()
                if grad_hook:
                    grad_hook()
                with torch.no_grad():
                    grads = [p.grad for p in plist]
                    if decay:
                        torch._foreach_add_(grads, plist, alpha=decay)
                    if momentum:
                        if buffers is None:
                            buffers = [g.detach().clone() for g in grads]
                        else:
                            torch._foreach_mul_(buffers, momentum)
                            torch._foreach_add_(buffers, grads)
                        grads = buffers
                    torch._foreach_add_(plist, grads, alpha=-lr)

    wd = cfg["weight-decay"]

    def control_variate_steps(x, y, pid, rnd, c_i, drift=None) -> dict[str, torch.Tensor]:
        """SCAFFOLD's local steps from the round's model on ``g + c - c_i``
        (FedDC's: ``drift = (h_i, alpha)`` adds ``alpha (w - x + h_i)`` to
        ``g`` first); the new ``c_i`` ('mean-gradient': the mean of the
        gradients without the correction, weight decay included)."""
        correction = {n: c_glob[n] - c_i[n] for n in params}
        grad_sum = {n: torch.zeros_like(p) for n, p in params.items()}
        steps = [0]
        model.load_state_dict(glob)

        def correct() -> None:
            steps[0] += 1
            for n, p in params.items():
                if drift is not None:
                    p.grad.add_(p.detach() - glob[n] + drift[0][n], alpha=drift[1])
                grad_sum[n].add_(p.grad)
                if wd:
                    grad_sum[n].add_(p.detach(), alpha=wd)
                p.grad.add_(correction[n])
        local_sgd(x, y, seeded_generator(seed, rnd, pid, "train"), correct)
        return {n: v / steps[0] for n, v in grad_sum.items()} if steps[0] else c_i

    t_eval = time.perf_counter()
    evaluate()  # the frameworks score the initial model too
    eval_seconds = time.perf_counter() - t_eval
    round_seconds = []
    for rnd in range(1, rounds + 1):
        start = time.perf_counter()
        ids = cohort(sampler, seed, rnd, clients, size)
        if algo == "fedavg":
            acc = OrderedDict((k, torch.zeros_like(v)) for k, v in glob.items())
            total = 0
            for pid in ids:
                x, y = train[pid]
                model.load_state_dict(glob)
                local_sgd(x, y, seeded_generator(seed, rnd, pid, "train"))
                for k, v in model.state_dict().items():
                    acc[k] += v * len(y)
                total += len(y)
            glob = OrderedDict((k, v / total) for k, v in acc.items())
        elif algo == "fedcdr":  # Algorithm 1: relax, inexact prox by SGD, reflect; x += sum g / n
            g_sum = OrderedDict((k, torch.zeros_like(v)) for k, v in glob.items())
            for pid in ids:
                x, y = train[pid]
                yy, xi, xhat = dr_state.get(pid) or (dict(x0), dict(x0), dict(x0))
                yy = {k: yy[k] + alpha * (glob[k] - xi[k]) for k in glob}
                model.load_state_dict(glob)
                pairs = [(p, yy[n]) for n, p in params.items()]

                def prox_pull(pairs=pairs) -> None:
                    for p, target in pairs:
                        p.grad.add_(p.detach() - target, alpha=1.0 / eta)
                local_sgd(x, y, seeded_generator(seed, rnd, pid, "train"), prox_pull)
                xi = {k: v.detach().clone() for k, v in model.state_dict().items()}
                new_hat = {k: 2 * xi[k] - yy[k] for k in glob}
                for k in glob:
                    g_sum[k] += new_hat[k] - xhat[k]
                dr_state[pid] = (yy, xi, new_hat)
            glob = OrderedDict((k, glob[k] + g_sum[k] / clients) for k in glob)
        elif algo == "scaffold":  # Algorithm 1: steps on g + c - c_i; c_i+ = mean of the uncorrected
            # gradients ('mean-gradient'); x = mean of the y_i (server lr 1); c += sum of dc / n
            y_sum = OrderedDict((k, torch.zeros_like(v)) for k, v in glob.items())
            dc_sum = {n: torch.zeros_like(p) for n, p in params.items()}
            for pid in ids:
                x, y = train[pid]
                c_i = cv_state.get(pid) or {n: torch.zeros_like(p) for n, p in params.items()}
                new = control_variate_steps(x, y, pid, rnd, c_i)
                for n in params:
                    dc_sum[n] += new[n] - c_i[n]
                cv_state[pid] = new
                for k, v in model.state_dict().items():
                    y_sum[k] += v
            glob = OrderedDict((k, v / len(ids)) for k, v in y_sum.items())
            c_glob = {n: c_glob[n] + dc_sum[n] / clients for n in params}
        elif algo == "feddc":  # the FedDC authors' code's rules, as fedaccel runs them: steps on
            # g + alpha (w - x + h_i) + c - c_i; c_i+ = mean of the gradients without the correction
            # ('mean-gradient'); h_i += theta_i - x; c += sum of dc / n; H += sum of (theta_i - x);
            # x = mean of the theta_i + H / n
            theta_sum = {n: torch.zeros_like(p) for n, p in params.items()}
            dc_sum = {n: torch.zeros_like(p) for n, p in params.items()}
            for pid in ids:
                x, y = train[pid]
                c_i, h_i = drift_state.get(pid) or ({n: torch.zeros_like(p) for n, p in params.items()},
                                                    {n: torch.zeros_like(p) for n, p in params.items()})
                new = control_variate_steps(x, y, pid, rnd, c_i, drift=(h_i, cfg["feddc.alpha"]))
                theta = {n: p.detach().clone() for n, p in params.items()}
                for n in params:
                    dc_sum[n] += new[n] - c_i[n]
                    theta_sum[n] += theta[n]
                drift_state[pid] = (new, {n: h_i[n] + (theta[n] - glob[n]) for n in params})
            h_glob = {n: h_glob[n] + (theta_sum[n] - len(ids) * glob[n]) for n in params}
            glob = OrderedDict((n, theta_sum[n] / len(ids) + h_glob[n] / clients) for n in params)
            c_glob = {n: c_glob[n] + dc_sum[n] / clients for n in params}
        else:  # fedpm: FOOF-preconditioned local steps, preconditioned mixing
            layers = OrderedDict(foof.foof_layers(model))
            total = sum(len(train[pid][1]) for pid in ids)
            m_sum: dict[str, torch.Tensor] = {}
            r_sum: dict[str, torch.Tensor] = {}
            rest = OrderedDict((k, torch.zeros_like(v, dtype=torch.float64)) for k, v in glob.items())
            for pid in ids:
                x, y = train[pid]
                model.load_state_dict(glob)
                factors = {n: foof.damped_cholesky(a, damping).float()
                           for n, a in foof.compute_foof(model, x).items()}

                def precondition() -> None:
                    for n, module in layers.items():
                        g = foof.weight_matrix(module, grad=True)
                        foof.write_matrix(module, foof.right_solve(g, factors[n]), grad=True)
                local_sgd(x, y, seeded_generator(seed, rnd, pid, "train"), precondition)
                a_end = foof.compute_foof(model, x)  # upload='end': FOOF at the final weights
                p = len(y) / total
                with torch.no_grad():
                    for n, module in layers.items():
                        m = a_end[n].to(torch.float64) + damping * torch.eye(a_end[n].shape[0], dtype=torch.float64,
                                                                             device=dev)
                        w = foof.weight_matrix(module).to(torch.float64)
                        m_sum[n] = m_sum[n] + p * m if n in m_sum else p * m
                        r_sum[n] = r_sum[n] + p * (w @ m) if n in r_sum else p * (w @ m)
                    for k, v in model.state_dict().items():
                        rest[k] += p * v.to(torch.float64)
            with torch.no_grad():
                model.load_state_dict(OrderedDict((k, v.float()) for k, v in rest.items()))
                for n, module in layers.items():
                    mixed = foof.right_solve(r_sum[n], torch.linalg.cholesky(m_sum[n]))
                    foof.write_matrix(module, mixed.float())
            glob = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
        if rnd == rounds:
            evaluate()
        synchronize()
        round_seconds.append(time.perf_counter() - start)
    return {"round_seconds": round_seconds, "eval_seconds": eval_seconds, "final": glob}


# ----------------------------------------------------------------------------- (b) fast runner

def fast_run(ov: dict[str, Any], clients: int) -> dict[str, Any]:
    from fedaccel.local_run import default_run_config, fuse, run_local

    folder = run_local(fuse(default_run_config(), ov), clients, quiet=True)
    return {"round_seconds": [r["seconds"] for r in _rows(folder)], "folder": str(folder)}


def no_steps_run(ov: dict[str, Any], clients: int) -> dict[str, Any]:
    """``fast_run`` with the batched trainer's local steps taken out: each client
    replies the weights it received and its real step count (mode ``no-steps``)."""
    import math

    import torch

    import fedaccel.clients.cohort as cohort

    def no_steps(model, members, lr, epochs, batch_size):  # train_stacked's results, no step taken
        if not members:
            return [], [], []
        starts = [torch.stack([m.start[i] for m in members]) for i in range(len(members[0].start))]
        return (starts, list(range(len(members))),
                [{"train-loss": 0.0, "local-steps": epochs * math.ceil(m.data.num_examples / batch_size)}
                 for m in members])
    trainer, cohort.train_stacked = cohort.train_stacked, no_steps
    try:
        return fast_run(ov, clients)
    finally:
        cohort.train_stacked = trainer


def _rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- (c) Ray

def _toml(v: Any) -> str:
    return f"'{v}'" if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


class TreeRSS:
    """Peak of the summed VmRSS of every process started after ``start()`` (sampled)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval, self.peak_kb, self._stop = interval, 0, threading.Event()
        with open("/proc/uptime") as f:
            self.t0_ticks = float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK") - 1
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> int:
        total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    start = int(f.read().rsplit(")", 1)[1].split()[19])
                if start < self.t0_ticks:
                    continue
                with open(f"/proc/{pid}/status") as f:
                    total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            except (OSError, IndexError, ValueError):
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def ray_env(home: Path) -> dict[str, str]:
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": HTTP_PORT,
           "FLWR_LOCAL_CONTROL_API_PORT": CONTROL_PORT, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "fedaccel.federations", "install"], env=env, check=True,
                   capture_output=True)
    return env


def ray_run(ov: dict[str, Any], nodes: int, env: dict[str, str]) -> dict[str, Any]:
    from fedaccel.superlink import stop_local_superlink

    stop_local_superlink(CONTROL_PORT)  # every run starts its SuperLink and Ray cold
    from fedaccel.federations import simulation_overrides

    text = " ".join(f"{k}={_toml(v)}" for k, v in ov.items())
    flwr = str(Path(sys.executable).parent / "flwr")
    # the profile's own resources per client (1 CPU: two Ray workers on 2 cores), passed
    # with the size: "num-supernodes=N" alone gives each client Flower's default 2 CPUs
    federation = simulation_overrides("local-simulation", nodes)
    start = time.perf_counter()
    with TreeRSS() as rss:
        proc = subprocess.run([flwr, "run", ".", "local-simulation", "--run-config", text, "--federation-config",
                               federation, "--stream"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600)
        folder = Path(ov["results-dir"]) / ov["run-name"]
        while proc.returncode == 0 and not (folder / "summary.json").is_file() \
                and time.perf_counter() - start < 600:
            time.sleep(0.2)  # the ServerApp may still be writing after the stream ends
    wall = time.perf_counter() - start
    stop_local_superlink(CONTROL_PORT)
    if proc.returncode != 0 or not (folder / "metrics.jsonl").is_file():
        raise SystemExit(f"flwr run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"round_seconds": [r["seconds"] for r in _rows(folder)], "wall": wall, "peak_rss_mb": rss.peak_kb / 1024,
            "federation_config": federation}


# ----------------------------------------------------------------------------- driver

def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    ov = json.loads(args.child_overrides)
    run = {"bare": bare_run, "tuned": tuned_run, "no-steps": no_steps_run}.get(args.child, fast_run)  # fast and cohort: fast_run
    if args.child_profile:  # the whole run under cProfile: its timings are inflated, its record says so
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        out = profiler.runcall(run, ov, args.clients)
        args.child_profile.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(args.child_profile.with_suffix(".prof"))  # the raw profile, for pstats' callers
        with open(args.child_profile, "w") as f:
            f.write(f"# {args.child} {ov.get('run-name')}: cProfile of the whole run "
                    "(set-up, rounds, evaluation), by cumulative time, then by own time\n")
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(40)
        out["profiled"] = True
    else:
        out = run(ov, args.clients)
    out.pop("final", None)
    out["environment"] = _environment(ov.get("device", "cpu"))  # the measuring process's own
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out), flush=True)


def measure(mode: str, workload: str, algo: str, rounds: int, clients: int, tmp: Path,
            env: dict[str, str] | None, per_round: int = 10, cohort_nodes: int = 2,
            device: str = "cpu", profile_dir: Path | None = None) -> dict[str, Any]:
    name = f"{workload}-{algo}-{mode}-{clients}-{per_round}-{device}"
    ov = overrides(workload, algo, rounds, clients, tmp, name, per_round, mode, device)
    start = time.perf_counter()
    if mode in ("ray", "ray-cohort"):
        res = ray_run(ov, clients if mode == "ray" else cohort_nodes, env)
    else:
        profile = ([] if profile_dir is None
                   else ["--child-profile", str(profile_dir / f"{name}-{time.strftime('%H%M%S')}.txt")])
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--child-overrides", json.dumps(ov),
                               "--clients", str(clients), *profile], capture_output=True, text=True, timeout=3600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        res = json.loads(lines[-1][len("RESULT "):])
        res["wall"] = time.perf_counter() - start
    secs = res["round_seconds"]
    middle = secs[1:-1] if len(secs) > 2 else secs
    return {"workload": workload, "algo": algo, "mode": mode, "clients": clients, "per_round": per_round,
            "rounds": rounds, "device": device,
            "median_round_s": statistics.median(middle), "startup_s": res["wall"] - sum(secs),
            "round_seconds": [round(s, 4) for s in secs], "peak_rss_mb": round(res["peak_rss_mb"], 1),
            "eval_s": res.get("eval_seconds"), "wall_s": round(res["wall"], 2), "when": time.strftime("%F %T"),
            **({"profiled": True} if res.get("profiled") else {}),
            # the Ray modes: the simulation's size, backend and resources per client
            **({"federation_config": res["federation_config"]} if res.get("federation_config") else {}),
            # the measuring child's; the Ray modes': this process's (their workers run on this machine)
            "environment": res.get("environment") or _environment(device)}


def _environment(device: str) -> dict[str, Any]:
    """Where the cell was measured (CPU model and dispatch, libraries): timings
    of different machines are not comparable, only ratios within one invocation."""
    import torch

    from fedaccel.torch_utils import environment

    return environment(torch.device(device))


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a cell measured several times: median of the per-run medians."""
    if len(runs) == 1:
        return runs[0]
    rec = dict(runs[-1])
    rec["run_medians"] = [r["median_round_s"] for r in runs]
    rec["median_round_s"] = statistics.median(rec["run_medians"])
    rec["startup_s"] = statistics.median(r["startup_s"] for r in runs)
    rec["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    rec["round_seconds"] = [r["round_seconds"] for r in runs]
    rec["wall_s"] = round(sum(r["wall_s"] for r in runs), 2)
    evals = [r["eval_s"] for r in runs if r.get("eval_s")]
    rec["eval_s"] = statistics.median(evals) if evals else None
    return rec


def same_invocation(bare: dict[str, Any] | None, other: dict[str, Any]) -> bool:
    """Whether two records were measured by one invocation of this script
    (both carry the same ``invocation``): only then is their ratio a
    comparison on one machine at one time."""
    return bool(bare) and bare.get("invocation") is not None and bare.get("invocation") == other.get("invocation")


def same_invocation_runs(bare: dict[str, Any] | None, other: dict[str, Any]) -> list[float]:
    """The bare loop's run medians when its cell was measured in the same
    invocation as ``other`` (the two records carry the same ``invocation``),
    else none: a cell's latest record can come from another day than the
    bare loop's, and its runs are then no repetitions of the same ones."""
    return list(bare.get("run_medians", ())) if same_invocation(bare, other) else []


def paired_ratios(bare_runs: list[float], runs: list[float]) -> str:
    """``bare_i / run_i`` for each repetition ``i`` (the runs of one repetition
    follow one another), and their median: ``"9.1x, 10.4x, 10.8x (median
    10.4x)"``; ``"-"`` without as many bare runs as runs."""
    if len(bare_runs) != len(runs) or not runs:
        return "-"
    ratios = [b / r for b, r in zip(bare_runs, runs)]
    return f"{', '.join(f'{x:.1f}x' for x in ratios)} (median {statistics.median(ratios):.1f}x)"


def load(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    if not path.is_file():
        return []
    latest: dict[tuple, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            latest[(r["workload"], r["algo"], r["mode"], r["clients"], r.get("per_round", 10),
                    bool(r.get("scale")), r.get("device", "cpu"))] = r
    return list(latest.values())


def write_table(out: Path) -> None:
    recs = load(out)
    cells = {(r["workload"], r["algo"], r["mode"], r["clients"], r.get("per_round", 10), r.get("device", "cpu")): r
             for r in recs if not r.get("scale")}
    lines = ["# Per-round overhead: bare PyTorch loop vs fast runner (per client, and cohort-batched) "
             "vs Flower's Ray simulation", "",
             "Seconds per round: median over rounds 2..R-1 (with --repeat: the median of the runs' medians). "
             "Start-up: process wall time minus the rounds. "
             "Peak RSS: bare/fast/cohort = the process's ru_maxrss; ray = peak of the summed RSS of every process "
             "of the run (SuperLink, Ray, ServerApp, workers; shared memory counted more than once). "
             "Ratios are time per round over the bare loop's: below 1 is faster than the bare loop.", "",
             "| workload | algo | per round | "
             + " | ".join(f"{MODE_LABELS.get(m, m)} s/round" for m in MODES) + " | "
             + " | ".join(f"{m}/bare" for m in MODES[1:]) + " | cohort/tuned | "
             f"start-up {' / '.join(MODES)} (s) | peak RSS {' / '.join(MODES)} (MB) |",
             "|---|---|" + "---:|" * (1 + len(MODES) + len(MODES) - 1 + 1 + 2)]
    per_rounds = sorted({key[4] for key in cells})
    devices = sorted({key[5] for key in cells}, key=lambda d: (d != "cpu", d))  # CPU rows first
    populations = sorted({key[3] for key in cells}, key=lambda n: (n != 100, n))  # 100 clients first
    repeated = []  # (row label, algo, per round, mode, each run's median) of cells measured more than once
    for n, d, w, a, k in ((n, d, w, a, k) for n in populations for d in devices for w in WORKLOADS
                          for a in ALGOS for k in per_rounds):
        row = {m: cells.get((w, a, m, n, k, d)) for m in MODES}
        if not any(row.values()):
            continue

        def f(m: str, key: str, fmt: str = "{:.3f}") -> str:
            if not row[m]:
                return "-"
            one_worker = m in RAY_MODES and key == "median_round_s" and not row[m].get("federation_config")
            return fmt.format(row[m][key]) + ("†" if one_worker else "")

        def ratio(m: str, to: str = "bare") -> str:
            if not (row[m] and row[to]):
                return "-"
            mixed = m != to and not same_invocation(row[to], row[m])  # see the note below the table
            return f"{row[m]['median_round_s'] / row[to]['median_round_s']:.2f}x" + ("*" if mixed else "")
        label = w + (f" ({d})" if d != "cpu" else "") + (f", {n:,} clients" if n != 100 else "") + (
            ", under cProfile" if any(r and r.get("profiled") for r in row.values()) else "")
        lines.append(
            f"| {label} | {a} | {k} | " + " | ".join(f(m, "median_round_s") for m in MODES) + " | "
            + " | ".join(ratio(m) for m in MODES[1:]) + f" | {ratio('cohort', 'tuned')} | "
            + " / ".join(f(m, "startup_s", "{:.1f}") for m in MODES) + " | "
            + " / ".join(f(m, "peak_rss_mb", "{:.0f}") for m in MODES) + " |")
        repeated += [(label, a, k, m, row[m]["run_medians"], same_invocation_runs(row["bare"], row[m]),
                      same_invocation_runs(row["tuned"], row[m]))
                     for m in MODES if row[m] and len(row[m].get("run_medians", ())) > 1]
    if any(line.count("x*") for line in lines):
        lines += ["", "\\* The cell and the bare loop of this row come from different invocations of this script "
                  "(or from records made before invocations were recorded): their ratio compares runs made at "
                  "different times, possibly on different machines (each record's `when` and `environment` "
                  "say which). Run both modes in one invocation for a ratio that means something."]
    if any("†" in line for line in lines):
        lines += ["", "† A Ray cell recorded before the benchmark passed the profile's resources per client "
                  "(records without `federation_config`): `--federation-config \"num-supernodes=N\"` alone gave "
                  "every client Flower's default 2 CPUs, so on a 2-core machine one Ray worker served every "
                  "node, one message at a time."]
    if repeated:  # a cell's median hides how far its runs were apart on a shared machine
        lines += ["", "Each run of the cells measured more than once (`--repeat`): its median s/round, in the "
                  "order run, the slowest over the fastest, and, for a cell measured in the same invocation "
                  "as the bare loop, how many times faster than the bare loop each run was against the bare "
                  "run of the same repetition (measured just before it, with only the repetition's other "
                  "modes in between, so a machine that slows down for a while slows both), with the median "
                  "of those ratios; the same against the tuned bare loop (mode `tuned`) where it ran.", "",
                  "| workload | algo | per round | mode | runs s/round | slowest / fastest | "
                  "bare / this, run by run | tuned / this, run by run |", "|---|---|---:|---|---|---:|---|---|"]
        for label, a, k, m, runs, bare_runs, tuned_runs in repeated:
            lines.append(f"| {label} | {a} | {k} | {m} | {', '.join(f'{x:.3f}' for x in runs)} | "
                         f"{max(runs) / min(runs):.2f} | {paired_ratios(bare_runs, runs) if m != 'bare' else '-'} | "
                         f"{paired_ratios(tuned_runs, runs) if m not in ('bare', 'tuned') else '-'} |")
    evals = {r["workload"]: r["eval_s"] for r in recs if r["mode"] == "bare" and r.get("eval_s")}
    if evals:
        lines += ["", "One evaluation of the global model on the server test set (bare loop, batches of 1,000): "
                  + ", ".join(f"{w} {s:.2f} s" for w, s in evals.items()) + "."]
    scale = sorted((r for r in recs if r.get("scale")), key=lambda r: (r["algo"], r["clients"]))
    if scale:
        lines += ["", "## Scale (fast runner, mlp-synthetic)", "",
                  "| algo | clients | s/round | start-up s | peak RSS MB |", "|---|---:|---:|---:|---:|"]
        for r in scale:
            lines.append(f"| {r['algo']} | {r['clients']} | {r['median_round_s']:.3f} | {r['startup_s']:.1f} | "
                         f"{r['peak_rss_mb']:.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    invocation = f"{time.strftime('%F %T')} pid {os.getpid()}"  # this invocation's records share it
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["run", "table"], default="run")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per run (default: 20 on the MLPs, 5 on the CNN)")
    p.add_argument("--repeat", type=int, default=1,
                   help="alternate the bare and fast runs of each cell N times; report the median")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10, help="clients per round (default 10)")
    p.add_argument("--cohort-nodes", type=int, default=2,
                   help="ray-cohort: the Flower nodes that serve the clients (default 2)")
    p.add_argument("--scale", action="store_true",
                   help="fast runner, mlp-synthetic, FedAvg and FedCDR at 100 and 1,000 clients")
    p.add_argument("--device", default="cpu",
                   help="where bare, fast and cohort runs train: cpu (default) or cuda[:N]; their rows are "
                        "labelled with it (the Ray modes run on the CPU)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead")
    p.add_argument("--profile", action="store_true",
                   help="run bare, fast, cohort and no-steps runs under cProfile and write each one's "
                        "profile to <out>/profiles/ (a .txt summary and the raw .prof for pstats; their timings are inflated; their records say "
                        "\"profiled\": true)")
    p.add_argument("--child", choices=["bare", "tuned", "fast", "cohort", "no-steps"], help=argparse.SUPPRESS)
    p.add_argument("--child-overrides", help=argparse.SUPPRESS)
    p.add_argument("--child-profile", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device != "cpu":  # checked here, not in a child's traceback (torch only for a device other than the CPU)
        import torch

        try:
            device = torch.device(args.device)
        except RuntimeError:
            p.error(f"--device {args.device}: not a torch device; use cpu or cuda[:N]")
        if device.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: this machine has no CUDA GPU that torch can use; use --device cpu")
    if args.device != "cpu" and {"ray", "ray-cohort"} & set(args.modes):
        p.error(f"--device {args.device}: the Ray modes run on the CPU here; use --modes bare fast cohort")
    if args.child:
        child(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "run":
        with tempfile.TemporaryDirectory(prefix="fedaccel-overhead-") as tmp:
            env = (ray_env(Path(tmp) / "flwr-home")
                   if {"ray", "ray-cohort"} & set(args.modes) and not args.scale else None)
            if args.scale:
                groups = [[("fast", "mlp-synthetic", a, n)] for a in ("fedavg", "fedcdr") for n in (100, 1000)]
            else:
                groups = [[(m, w, a, args.clients) for m in args.modes
                           if not (m in ("cohort", "no-steps") and a in UNBATCHED)]
                          for w in args.workloads for a in args.algos]
            for i, group in enumerate(groups, 1):
                runs: dict[str, list[dict[str, Any]]] = {}
                repeats = 1 if group[0][1] == "cnn-fmnist" else max(args.repeat, 1)  # CNN rounds: seconds
                for rep in range(repeats):
                    for mode, w, a, n in group:
                        if rep and mode in ("ray", "ray-cohort"):
                            continue
                        rounds = args.rounds or ROUNDS[w]
                        rec = measure(mode, w, a, rounds, n, Path(tmp), env, args.per_round, args.cohort_nodes,
                                      args.device, args.out / "profiles" if args.profile else None)
                        runs.setdefault(mode, []).append(rec)
                        print(f"[overhead] {i}/{len(groups)} {w} {a} {mode} n={n} per round {args.per_round} "
                              f"run {rep + 1}: "
                              f"{rec['median_round_s']:.3f} s/round, start-up {rec['startup_s']:.1f} s, "
                              f"peak RSS {rec['peak_rss_mb']:.0f} MB", flush=True)
                for mode, recs in runs.items():
                    rec = combine_runs(recs)
                    rec["scale"] = args.scale
                    rec["invocation"] = invocation  # the table pairs repetitions within one invocation only
                    with open(args.out / "results.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
    write_table(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
