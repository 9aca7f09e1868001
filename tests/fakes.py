"""Test doubles and test problems shared by the tests (imported as ``from fakes import ...``)."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid


class StubGrid(Grid):
    """A Grid that only knows its node ids: strategies build their messages
    against it and the tests deliver replies by hand."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self._node_ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def set_run(self, run):  # pragma: no cover - unused
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover - unused
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover - unused
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover - unused
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover - unused
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - unused
        raise NotImplementedError


def heterogeneous_least_squares(n: int = 10, d: int = 5, m: int = 20, seed: int = 0):
    """Client i: f_i(z) = 0.5/m ||A_i z - b_i||^2 with b_i = A_i w_i, the w_i far
    apart. Returns (H_i, c_i, z*, w_i) with H_i = A_i^T A_i / m, c_i = A_i^T b_i / m
    and z* the minimizer of sum_i f_i."""
    import numpy as np

    rng = np.random.default_rng(seed)
    A = [rng.standard_normal((m, d)) for _ in range(n)]
    w = [3 * rng.standard_normal(d) for _ in range(n)]
    H = [a.T @ a / m for a in A]
    c = [a.T @ (a @ wi) / m for a, wi in zip(A, w)]
    return H, c, np.linalg.solve(sum(H), sum(c)), w


def quadratic_local_steps(solver, model, lr: float, h, c, steps: int) -> None:
    """``steps`` local steps of ``solver`` on f(z) = 0.5 z^T h z - c^T z for a
    one-row linear ``model`` (exact gradient, then the solver's gradient hook,
    then its optimizer), after the caller's ``begin_round``."""
    import torch

    opt = solver.make_optimizer(model, lr)
    for _ in range(steps):
        z = model.weight.detach().numpy()[0]
        model.weight.grad = torch.tensor((h @ z - c)[None])
        solver.transform_gradients(model)
        opt.step()
    solver.local_steps = steps  # what close_round() sets from the trainer's report


def train_config(server_round: int = 1, lr: float = 1.0, local_epochs: int = 1, **values):
    """The typed config a solver's ``begin_round`` receives (:class:`fedaccel.contract.TrainConfig`);
    ``values`` are an algorithm's declared extras, e.g. ``**{"proximal-mu": 0.5}``."""
    from fedaccel.contract import TrainConfig

    return TrainConfig(server_round=server_round, lr=lr, local_epochs=local_epochs,
                       accepted_round=None, values=values)


# --------------------------------------------------------------------------- #
# Strategies driven by hand: built through the registry from the default run
# config, fed real Flower Messages (tests that use these need the
# ``server_identity`` fixture).
# --------------------------------------------------------------------------- #
NODES = {0: 101, 1: 102, 2: 103}


def run_cfg(algo: str = "fedavg", **changes):
    from fedaccel.local_run import default_run_config
    from fedaccel.run_config import parse_run_config

    cfg = default_run_config()
    cfg.update({"algo": algo, "clients-per-round": 3, "momentum": 0.0, "weight-decay": 0.0})
    cfg.update(changes)
    return parse_run_config(cfg)


def build(algo: str = "fedavg", nodes: dict[int, int] = NODES, **changes):
    from fedaccel.membership import Federation
    from fedaccel.registry import get_algorithm

    cfg = run_cfg(algo, **changes)
    return get_algorithm(algo).build_strategy(cfg, Federation(dict(nodes)))


def arrays(**named) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float64)) for k, v in named.items()})


def configure(strategy, server_round: int, record: ArrayRecord, nodes=NODES) -> list[Message]:
    msgs = list(strategy.configure_train(server_round, record, ConfigRecord(), StubGrid(nodes.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
    return msgs


def reply(instruction: Message, n: int, loss: float = 1.0, **named) -> Message:
    content = RecordDict({
        "arrays": arrays(**named),
        "metrics": MetricRecord({"num-examples": n, "train-loss": loss}),
    })
    return Message(content, reply_to=instruction)


def by_node(msgs: list[Message]) -> dict[int, Message]:
    return {m.metadata.dst_node_id: m for m in msgs}


def eval_record(n: int, acc: float, loss: float) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({"num-examples": n, "accuracy": acc, "loss": loss})})


def bench_script(name: str):
    """``bench/<name>.py`` loaded as a module (the bench scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def selected_ids(request, test: str) -> set[str]:
    """The ids of ``test``'s cases selected in this pytest session ("" for a
    test without parameters; empty when it was not selected): what a module
    fixture that starts runs for several tests at once should start."""
    return {getattr(getattr(item, "callspec", None), "id", "") for item in request.session.items
            if getattr(item, "originalname", "") == test}


def kill_unfinished(procs: Iterable[subprocess.Popen]) -> None:
    """Kill and reap every process of ``procs`` still running (a fixture's clean-up)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
