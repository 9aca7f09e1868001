"""fedaccel ClientApp (Flower Message API).

Three handlers: ``train`` runs the algorithm's local solver, ``evaluate``
scores the received global model on this client's local test split (for
ACCL), ``query`` tells the server which data partition this node holds.
Config, dataset, model and solver are built once per process and run, and
shared by the clients it simulates; each client's data tensors are built
once (:func:`_shared`, :func:`_runtime`).

An error the user can fix on this node (``USER_ERRORS``: a missing or
corrupted data file, a bad node config, a model that does not fit the data)
makes ``train`` and ``evaluate`` reply with a Flower error whose reason is one
line naming the node and the cause (:func:`user_error_reply`); the server logs
it and goes on with the other clients. Any other exception is a bug: one
client at a time it is raised, and Flower logs its traceback on this node
and replies with an error itself; where this node trains many clients (a
batched round, a cohort node's slice) the client whose code raised gets
that same reply alone and its traceback is logged here (:func:`_bug_reply`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace
from functools import lru_cache
from logging import DEBUG, INFO
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from fedaccel.clients.base import LocalResult, LocalSolver, SamplePool, TrainData
from fedaccel.clients.cohort import (MEMORY_FRACTION, CohortJob, chunk_size, fallback_reason, fit_cohort,
                                     own_batched, slower_reason, unbatchable_error)
from fedaccel.memory import available_bytes_on
from fedaccel.clients.state import ClientState, choose_backend, open_client_state
from fedaccel.cohort_nodes import (COHORT_ACTION, client_states, keep_client_states, logical_messages,
                                   logical_node_id, pack_replies)
from fedaccel.client_errors import exception_reply, log_raised, node_label
from fedaccel.data.device_file import DATASET_SPECS, load_device_file
from fedaccel.arrays import load_into, metric_record, record_dict, records_of
from fedaccel.contract import ContractError
from fedaccel.config import RunConfig, config_error
from fedaccel.registry import get_algorithm
from fedaccel.run_config import is_whole_number, parse_client_config
from fedaccel.errors import USER_ERRORS
from fedaccel.runtime import build_model_for, data_config_for, load_data
from fedaccel.torch_utils import evaluate as evaluate_model, seeded_generator, select_device

# Errors that become an error reply naming this node and the cause: the user's,
# and a message that does not match the algorithm's contract (another version).
REPLY_ERRORS = (*USER_ERRORS, ContractError)

app = ClientApp()


@dataclass
class ClientRuntime:
    """Everything a client keeps between messages in one process."""

    cfg: RunConfig
    partition_id: int
    device: torch.device
    model: torch.nn.Module
    solver: LocalSolver
    train: TrainData
    test_x: torch.Tensor
    test_y: torch.Tensor
    state_mode: str  # where persistent client state lives: context or disk


def node_data_path(context: Context) -> str:
    """``data-path`` from the node config: a device's own .npz ('' = a partition
    of the run's dataset, as in simulation and rehearsals)."""
    return str(context.node_config.get("data-path", ""))


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, validated."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise config_error("node-config", dict(nc),
                           "needs partition-id and num-partitions (flower-supernode --node-config)")
    pid, n = int(nc["partition-id"]), int(nc["num-partitions"])
    if not 0 <= pid < n:
        raise config_error("partition-id", pid, f"must be in [0, num-partitions={n})")
    return pid, n


_last_frozen: tuple[dict[str, Any], tuple] = ({}, ())  # the last run config seen and its key


def _freeze(run_config: dict[str, Any]) -> tuple:
    """The run config as a hashable key (of the caches below): its sorted items.

    Every client of a round has its own ``Context`` with an equal run config;
    comparing with the last one (a dict comparison, in C) is a tenth of
    sorting and hashing it again per client (8 % of a batched round of 100
    clients, no local steps, MLP 60-32-10). Equal dicts give equal keys, so
    the caches see exactly what they saw before."""
    global _last_frozen
    last, key = _last_frozen  # one tuple: consistent across threads
    if run_config == last and key:
        return key
    key = tuple(sorted(run_config.items()))
    _last_frozen = (dict(run_config), key)
    return key


@dataclass
class _Shared:
    """What every client simulated by one process shares for one run."""

    cfg: RunConfig
    device: torch.device
    dataset: Any
    model: torch.nn.Module
    solver: LocalSolver
    state_mode: str
    # partition -> its training data as rows of one SamplePool, and its
    # local test split (filled by pool_training_data, read by _runtime)
    pooled: dict[int, tuple[TrainData, Any, Any]] = field(default_factory=dict)


@lru_cache(maxsize=4)
def _shared(frozen_config: tuple, num_partitions: int, data_path: str) -> _Shared:
    """Config, dataset, model and solver: built once per process and run.

    A process simulates many clients (the fast runner all of them, a Ray
    worker whichever it is handed), so these are shared by partition: each
    round loads the received weights into the one model, and solvers keep
    nothing between rounds outside :class:`fedaccel.clients.state.ClientState`.
    Building them per partition cost a fifth of every client round for small
    models (under cProfile: 3.4 ms of a 16 ms client round on the 60-32-10
    MLP).
    """
    cfg = parse_client_config(dict(frozen_config))
    device = select_device(cfg.device, cfg.tf32)
    if data_path:  # a real device with its own data file
        shape, classes, augment = DATASET_SPECS[cfg.dataset]
        dataset = SimpleNamespace(input_shape=shape, num_classes=classes, augment=augment)
    else:
        dataset = load_data(data_config_for(cfg, num_partitions))
    model = build_model_for(cfg, dataset).to(device)
    solver = get_algorithm(cfg.algo).solver(cfg)
    solver.initial_model = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return _Shared(cfg=cfg, device=device, dataset=dataset, model=model, solver=solver,
                   state_mode=choose_backend(cfg.client_state, num_partitions,
                                             solver.state_copies * model_bytes))


RUNTIME_CACHE_SIZE = 1024  # clients whose data tensors one process keeps


@lru_cache(maxsize=RUNTIME_CACHE_SIZE)
def _runtime(frozen_config: tuple, partition_id: int, num_partitions: int,
             data_path: str = "") -> ClientRuntime:
    """One client's runtime: the shared pieces plus its own data as tensors
    (kept, so a client trained again does not rebuild them)."""
    shared = _shared(frozen_config, num_partitions, data_path)
    cfg, device = shared.cfg, shared.device
    pooled = None if data_path else shared.pooled.get(partition_id)
    if pooled is not None:
        train, x_test, y_test = pooled
        if x_test is None:  # handed to a runtime that the cache has dropped since
            part = shared.dataset.client(partition_id)
            x_test, y_test = part.x_test, part.y_test
        shared.pooled[partition_id] = (train, None, None)  # the runtime holds the test split now
    else:
        if data_path:
            part = load_device_file(data_path, cfg.dataset, cfg.local_test_fraction, cfg.seed,
                                    np.dtype(cfg.precision))
        else:
            part = shared.dataset.client(partition_id)
        train = TrainData(x=torch.from_numpy(part.x_train).to(device), y=torch.from_numpy(part.y_train).to(device),
                          augment=shared.dataset.augment)
        x_test, y_test = part.x_test, part.y_test
    return ClientRuntime(
        cfg=cfg,
        partition_id=partition_id,
        device=device,
        model=shared.model,
        solver=shared.solver,
        train=train,
        test_x=torch.from_numpy(x_test).to(device),
        test_y=torch.from_numpy(y_test).to(device),
        state_mode=shared.state_mode,
    )


def pool_training_data(contexts: list[Context]) -> None:
    """The training data of the clients of ``contexts`` (partitions of the
    run's dataset; a device's own file is left alone) as one
    :class:`SamplePool` per run and process, each client's
    :class:`TrainData` its rows: the same values, one tensor. Called before
    their runtimes are built (:func:`prepare_clients`); a runtime built
    before keeps its own tensors. The pool is filled one client at a time,
    so about one client's arrays live beside it (1.25 times the largest
    client's, measured; concatenated, every client's arrays and the pool
    lived at once: 2.3 times the pool)."""
    groups: dict[tuple, list[int]] = {}
    for context in contexts:
        if not node_data_path(context):
            pid, n = node_partition(context)
            groups.setdefault((_freeze(context.run_config), n), []).append(pid)
    for (frozen, n), pids in groups.items():
        shared = _shared(frozen, n, "")
        pids = sorted(set(pids) - set(shared.pooled))
        if not pids:
            continue
        sizes = shared.dataset.train_sizes()
        total, pool, start, filled = sum(sizes[pid] for pid in pids), None, 0, []
        try:
            for pid in pids:
                part = shared.dataset.client(pid)
                x, y = torch.from_numpy(part.x_train), torch.from_numpy(part.y_train)
                if pool is None:  # the samples' dtype and shape: the first client's
                    pool = SamplePool(x=torch.empty((total, *x.shape[1:]), dtype=x.dtype, device=shared.device),
                                      y=torch.empty((total,), dtype=y.dtype, device=shared.device))
                end = start + sizes[pid]
                if len(y) != sizes[pid] or len(x) != sizes[pid]:  # (copy_ would broadcast a single row)
                    raise RuntimeError(f"client {pid} has {len(y)} training samples, its dataset said {sizes[pid]}")
                pool.x[start:end].copy_(x)
                pool.y[start:end].copy_(y)
                train = TrainData(x=pool.x[start:end], y=pool.y[start:end], augment=shared.dataset.augment,
                                  pool=pool, pool_start=start)
                shared.pooled[pid] = (train, part.x_test, part.y_test)
                filled.append(pid)
                start = end
        except BaseException:
            for pid in filled:  # a pool filled in part is not kept: its clients get tensors of their own
                del shared.pooled[pid]
            raise


def client_runtime(context: Context) -> ClientRuntime:
    pid, n = node_partition(context)
    return _runtime(_freeze(context.run_config), pid, n, node_data_path(context))


def _logical_clients_of(run_config: dict[str, Any]) -> int:
    """The run's ``logical-clients`` (0: each node is one client), read
    without building the node's runtime, as the server reads it (an integer,
    or a float with an integral value); any other value is 0 here (the
    server refuses it with its one line)."""
    value = run_config.get("logical-clients", 0)
    return int(value) if is_whole_number(value) and value > 0 else 0


def _logical_context(context: Context, partition_id: int, num_partitions: int, node_id: int,
                     state: RecordDict) -> Context:
    """The Context of logical client ``partition_id`` served by the node of ``context``."""
    return Context(run_id=context.run_id, node_id=node_id,
                   node_config={**dict(context.node_config), "partition-id": partition_id,
                                "num-partitions": num_partitions},
                   state=state, run_config=context.run_config)


def served_contexts(context: Context) -> list[Context]:
    """The clients the node of ``context`` serves, each as a Context naming
    its partition: the node itself, or on a cohort node (``logical-clients =
    N``, slot ``k`` of ``W``) the logical clients ``p < N`` with ``p % W ==
    k`` (:mod:`fedaccel.cohort_nodes`), whose envelopes it will get."""
    served = _served_partitions(context)
    if served is None:
        return [context]
    # served.stop: the run's number of logical clients
    return [_logical_context(context, pid, served.stop, logical_node_id(pid), RecordDict()) for pid in served]


def _served_partitions(context: Context) -> range | None:
    """The partition ids of the logical clients the cohort node of
    ``context`` serves (:func:`served_contexts`), or None for a node that is
    one client itself."""
    num_logical = _logical_clients_of(context.run_config)
    if not num_logical or node_data_path(context):
        return None
    slot, num_nodes = node_partition(context)
    return range(slot, num_logical, num_nodes)


def prepare_clients(contexts: list[Context]) -> None:
    """Build every client's data tensors now, if all fit in the runtime cache.

    The fast runner calls this before round 1, so a client's first round does
    not pay for turning its images into float tensors (0.75 ms per
    Fashion-MNIST client, a twentieth of an MLP round; the bare loop of
    ``bench/overhead.py`` prepares its data up front too). Best effort: a
    bad config or missing data stops here silently and is reported, with the
    ServerApp's one-line message, when the first round reaches the client.
    With more than ``RUNTIME_CACHE_SIZE`` clients nothing is built: the cache
    would evict most of them before their first round. The clients of a
    cohort node are the logical clients it serves (:func:`served_contexts`).
    """
    try:  # counted before any logical client's Context is built (100k of them cost tenths of a second)
        served = [_served_partitions(context) for context in contexts]
        if sum(1 if s is None else len(s) for s in served) > RUNTIME_CACHE_SIZE:
            return
        contexts = [client for context in contexts for client in served_contexts(context)]
    except Exception:  # noqa: BLE001 - a bad node config: reported by the normal path, see docstring
        return
    try:
        pool_training_data(contexts)
    except Exception:  # noqa: BLE001 - the same error comes again below, or the clients go without a pool
        pass
    try:
        for context in contexts:
            client_runtime(context)
    except Exception:  # noqa: BLE001 - reported by the normal path, see docstring
        return


def _message_config(msg: Message) -> dict[str, Any]:
    return dict(records_of(msg.content, ConfigRecord).get("config", ConfigRecord()))


def _load_global(rt: ClientRuntime, msg: Message) -> dict[str, Any]:
    load_into(rt.model, msg.content["arrays"])
    return _message_config(msg)


def _round_inputs(rt: ClientRuntime, context: Context, config: dict[str, Any]) -> tuple[ClientState, torch.Generator]:
    """This client's state store and its seeded generator for the round in ``config``."""
    server_round = int(config.get("server-round", 0))
    state = open_client_state(rt.state_mode, rt.cfg.state_dir, context.run_id, rt.partition_id, context.state)
    return state, seeded_generator(rt.cfg.seed, server_round, rt.partition_id, "train")


def one_line(text: str) -> str:
    """``text`` on one line (a message that spans lines keeps its words)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip()) or "no reason given"


_REPORTED: set[str] = set()  # reasons this process has logged (once each at INFO)


def user_error_reply(msg: Message, context: Context, err: BaseException) -> Message:
    """The error reply for a user error: ``node 123 (partition 4): <cause>``
    (for a cohort node's envelope, ``cohort node 123 (slot 1): <cause>``:
    its ``partition-id`` is the slot it serves, not a client's partition).

    Flower's code for an exception in the ClientApp, so the server treats it as
    it treats a raised exception, but with a reason the user can act on and no
    traceback. Also logged on this node (at INFO once per distinct reason).
    """
    reason = f"{node_label(context, msg)}: {one_line(str(err))}"
    log(DEBUG if reason in _REPORTED else INFO, "[fedaccel] %s failed: %s", msg.metadata.message_type, reason)
    _REPORTED.add(reason)
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training; a user error becomes an error reply (:func:`user_error_reply`).

    Nothing of a failed round is committed: the solver seals a new state
    version only after training succeeded, and an unsealed version is dropped
    when the client next trains (fedaccel/clients/state.py).
    """
    try:
        return _train(msg, context)
    except REPLY_ERRORS as err:
        return user_error_reply(msg, context, err)


def _train(msg: Message, context: Context) -> Message:
    """Local training with the algorithm's solver; replies weights + metrics."""
    rt = client_runtime(context)
    config = _load_global(rt, msg)
    state, generator = _round_inputs(rt, context, config)
    result = rt.solver.fit(rt.model, rt.train, config, state, generator, _received(msg))
    return _train_reply(msg, result)


def _received(msg: Message) -> dict:
    """The message's ArrayRecords other than the model (e.g. SCAFFOLD's ``c``)."""
    return {k: v for k, v in records_of(msg.content, ArrayRecord).items() if k != "arrays"}


def _train_reply(msg: Message, result: LocalResult) -> Message:
    return Message(content=record_dict({"arrays": result.arrays, "metrics": metric_record(result.metrics),
                                        **result.extra}), reply_to=msg)


def cohort_fallback(context: Context) -> str | None:
    """Why this run's clients cannot train as one batched model (one line), or
    None; ``cohort-batching='off'`` is a reason too."""
    rt = client_runtime(context)
    if rt.cfg.cohort_batching == "off":
        return "cohort-batching='off'"
    return fallback_reason(rt.solver, rt.cfg, rt.model) or (
        slower_reason(rt.model) if rt.cfg.cohort_batching == "auto" else None)


def cohort_note(context: Context) -> str | None:
    """What a batched run of these clients still does one client at a time
    (one line, for the log), or None."""
    rt = client_runtime(context)
    return rt.solver.cohort_note(rt.model, own_batched(rt.model, "batched_layer_inputs"))


def cohort_chunk(rt: ClientRuntime) -> int:
    """The most clients of a round that train as one batch: ``cohort-chunk``,
    or (0) as many as fit in a quarter of the memory available now on the
    device the clients train on (the GPU's own on CUDA, not the host's)."""
    if rt.cfg.cohort_chunk > 0:
        return rt.cfg.cohort_chunk
    # a mini-batch holds at most the samples of the pool every client's rows come from (the trainer pads
    # to the largest client's); without a pool this client's size says nothing of the others'
    rows = rt.train.pool.x.shape[0] if rt.train.pool is not None else rt.cfg.batch_size
    return chunk_size(rt.model, rt.train.x.new_zeros(rt.train.x.shape[1:]), max(1, min(rt.cfg.batch_size, rows)),
                      available_bytes_on(rt.train.x.device), extra=rt.solver.cohort_bytes(rt.model))


def upload_room(rt: ClientRuntime) -> int | None:
    """The bytes a round's uploads may keep on a GPU until the server has
    checked and averaged them there: a quarter of its memory available now,
    beside the quarter a chunk trains in (:func:`cohort_chunk`). None on the
    CPU, where the uploads are host memory anyway."""
    device = rt.train.x.device
    if device.type == "cpu":
        return None
    available = available_bytes_on(device)
    return None if available is None else int(MEMORY_FRACTION * available)


def train_cohort(items: list[tuple[Message, Context]]) -> list[Message]:
    """The ``train`` handler for every client of a round at once, in one process.

    Each client goes through the same steps as :func:`train` (its own solver
    instance, state, generator, contract checks, error replies), only the
    local steps of all of them run as one batched model
    (:func:`fedaccel.clients.cohort.fit_cohort`). The fast runner calls it
    when :func:`cohort_fallback` found no reason against."""
    replies: list[Message | None] = [None] * len(items)
    jobs, where = [], []
    shared = None
    # the clients in partition order, whatever order the messages came in
    # (Flower's sampling orders them at random): a batched kernel may round a
    # client's rows by their place in the batch (FedPM's batched Cholesky
    # solves do, with two threads), so the place must follow from the seed
    for i in sorted(range(len(items)), key=lambda i: _partition_key(items[i][1], i)):
        msg, context = items[i]
        try:  # this client's own setup: what fails here is its reply alone
            rt = client_runtime(context)
            solver = type(rt.solver)(rt.cfg)
            solver.initial_model = rt.solver.initial_model
            config = _message_config(msg)
            state, generator = _round_inputs(rt, context, config)
            job = CohortJob(solver=solver, data=rt.train, arrays=msg.content["arrays"], config=config,
                            state=state, generator=generator, received=_received(msg))
        except REPLY_ERRORS as err:
            replies[i] = user_error_reply(msg, context, err)
            continue
        except Exception as err:  # noqa: BLE001 - one client's bug is its own error reply
            replies[i] = _bug_reply(msg, context, err)
            continue
        shared = shared or rt
        jobs.append(job)
        where.append(i)
    if jobs:
        results = fit_cohort(shared.model, jobs, shared.cfg.batch_size,
                             max_clients=cohort_chunk(shared), upload_room=upload_room(shared))
        for i, result in zip(where, results):
            msg, context = items[i]
            replies[i] = (_train_reply(msg, result) if not isinstance(result, BaseException)
                          else user_error_reply(msg, context, result) if isinstance(result, REPLY_ERRORS)
                          else _bug_reply(msg, context, result))
    return replies  # type: ignore[return-value]


def _bug_reply(msg: Message, context: Context, err: BaseException) -> Message:
    """The reply of a client whose code raised something other than a user
    error (a bug): Flower's reply for a ClientApp exception, its traceback in
    this node's log (the first time this process sees that error; later at
    DEBUG), whether its clients train batched or one after another."""
    log_raised(node_label(context), err)
    return exception_reply(msg, err)


def _partition_key(context: Context, index: int) -> tuple[int, int, int]:
    """Sort key of a client in a cohort: its partition id, then (for a
    context without one) where its message came."""
    pid = context.node_config.get("partition-id")
    return (0, int(pid), index) if isinstance(pid, int) and not isinstance(pid, bool) else (1, 0, index)


def logical_clients(msg: Message, context: Context) -> list[tuple[Message, Context]]:
    """The clients of a cohort node's envelope (:mod:`fedaccel.cohort_nodes`):
    each its own message and a Context with its own partition and state,
    under its logical node id."""
    if node_data_path(context):
        raise config_error("logical-clients", "> 0", "logical clients are partitions of the run's dataset; "
                           "a node with its own data-path is one client (set logical-clients=0)")
    clients = logical_messages(msg)
    states = client_states(context.state, [pid for pid, _, _ in clients])
    return [(message, _logical_context(context, pid, num, message.metadata.dst_node_id, states[pid]))
            for pid, num, message in clients]


def _serve_logical_clients(msg: Message, context: Context,
                           serve: Callable[[list[tuple[Message, Context]]], tuple[list[Message], str]]) -> Message:
    """``serve`` every client of an envelope (``serve(items)`` gives their
    replies and a line for the server's log) and pack the replies into one;
    each client's state goes back into the node's. A user error that concerns
    the whole envelope (a device's own data-path, a run that must be batched
    and cannot) is the envelope's error reply, hence every client's."""
    try:
        items = logical_clients(msg, context)
        replies, note = serve(items)
    except REPLY_ERRORS as err:
        return user_error_reply(msg, context, err)
    keep_client_states(context.state, {int(ctx.node_config["partition-id"]): ctx.state for _, ctx in items})
    return Message(pack_replies(replies, note), reply_to=msg)


def _each_client(handler: Callable[[Message, Context], Message],
                 items: list[tuple[Message, Context]]) -> list[Message]:
    """``handler`` for each client of a slice. An exception that is not a user
    error (a bug) fails that client alone, with the error reply Flower gives
    for a ClientApp exception, as it would on a node of its own; its
    traceback goes to this node's log."""
    replies = []
    for message, ctx in items:
        try:
            replies.append(handler(message, ctx))
        except Exception as err:  # noqa: BLE001 - one client's bug is its own error reply
            replies.append(_bug_reply(message, ctx, err))
    return replies


def _train_slice(items: list[tuple[Message, Context]]) -> tuple[list[Message], str]:
    """A cohort node's clients of a round: as one batched model when the run
    allows (:func:`cohort_fallback`), else one after another, each exactly as
    :func:`train` trains it; and a line saying which, for the server's log."""
    if not items:
        return [], ""
    try:
        reason = cohort_fallback(items[0][1])
    except REPLY_ERRORS:  # the clients cannot start: each one's train() gives its error reply
        return _each_client(train, items), ""
    if reason is not None and client_runtime(items[0][1]).cfg.cohort_batching == "on":
        raise unbatchable_error(reason)
    if reason is None:
        note = cohort_note(items[0][1])
        return train_cohort(items), "each node trains its clients of a round as one batched model" + (
            f"; {note}" if note else "")
    return _each_client(train, items), f"each node trains its clients one after another ({reason})"


@app.train(COHORT_ACTION)
def train_logical_clients(msg: Message, context: Context) -> Message:
    """A cohort node's ``train``: its clients of the round (:func:`_train_slice`)."""
    return _serve_logical_clients(msg, context, _train_slice)


@app.evaluate(COHORT_ACTION)
def evaluate_logical_clients(msg: Message, context: Context) -> Message:
    """A cohort node's ``evaluate``: each of its clients, as :func:`evaluate`."""
    return _serve_logical_clients(msg, context, lambda items: (_each_client(evaluate, items), ""))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Local evaluation; a user error becomes an error reply (:func:`user_error_reply`)."""
    try:
        return _evaluate(msg, context)
    except REPLY_ERRORS as err:
        return user_error_reply(msg, context, err)


def _evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of the received global model on this client's local test split."""
    rt = client_runtime(context)
    _load_global(rt, msg)
    loss, acc = evaluate_model(rt.model, rt.test_x, rt.test_y)
    metrics = MetricRecord({"loss": loss, "accuracy": acc, "num-examples": int(rt.test_y.shape[0])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node holds (node ids are random per run)."""
    pid, n = node_partition(context)
    record = ConfigRecord({"partition-id": pid, "num-partitions": n})
    return Message(content=RecordDict({"partition": record}), reply_to=msg)
