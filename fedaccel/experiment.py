"""The server side of one run: discover clients, run the strategy, record results.

:func:`run_experiment` is what the ServerApp's ``main`` does, in Flower's
simulation, on a real SuperLink, and in the fast runner alike.
"""

from __future__ import annotations

import errno
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from logging import INFO, WARNING
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from fedaccel.arrays import load_into
from fedaccel.checkpoint import (Checkpoint, SharedDiskClientStore, carried_state, config_mismatch, find_checkpoint,
                                 read_checkpoint, resolution_changed, restore_carried_state, run_dir_of,
                                 write_checkpoint)
from fedaccel.clients.cohort import fallback_reason, unbatchable_error
from fedaccel.clients.gradient_centralization import gc_partition
from fedaccel.clients.state import state_run_dir
from fedaccel.data.device_file import DATASET_SPECS
from fedaccel.models import build_model
from fedaccel.config import RunConfig, config_error
from fedaccel.errors import USER_ERRORS, CheckpointError, FederationError, ResultsDirError
from fedaccel.heap import quiet_collector
from fedaccel.memory import require_memory
from fedaccel.processes import raise_if_stop_requested
from fedaccel.registry import get_algorithm
from fedaccel.run_config import parse_run_config
from fedaccel.results import RunRecorder
from fedaccel.trackers import open_tracker, require_tracker
from fedaccel.runtime import build_model_for, data_config_for, load_data, model_name, optimum_of
from fedaccel.torch_utils import environment, evaluate, select_device, state_to_arrays
from fedaccel.cohort_nodes import CohortNodes
from fedaccel.grids import GIVE_UP_ROUNDS, PromptGrid, SerialNodes
from fedaccel.membership import TRANSIENT_ATTEMPTS, Federation, TransientAnswer, query_partitions



MISSING_NODES_HINT = (
    "in Flower's simulation, set num-supernodes to what the machine can start "
    "(fedaccel-federations size local-simulation N); on a real federation, start the missing SuperNodes, each "
    "with --node-config \"partition-id=I num-partitions=N\"")


def discover_federation(grid: Grid, timeout: float = 120.0, poll: float = 0.5) -> Federation:
    """Learn which data partition every node holds, waiting for all of them.

    Node ids are random per run and only clients see their ``partition-id``,
    so the server asks each node once (a ``query`` message). It waits until
    ``num-partitions`` distinct partitions have answered, or fails after
    ``timeout`` seconds (the run's ``round-timeout``: an answer is a ClientApp
    start, as slow as a round's on a busy machine) with a message saying how
    many are missing, and whether they are offline or did not answer.

    A node whose answer was an error of Flower's own saying the message did
    not get through or the ClientApp died (:class:`TransientAnswer`: a busy
    SuperLink, a reply whose upload expired, a crashed ClientApp process) is
    asked again, at most ``TRANSIENT_ATTEMPTS`` times in all, with a warning;
    any other error (the ClientApp ran and raised) ends the run at once.
    """
    deadline = time.monotonic() + timeout
    partition_of: dict[int, int] = {}
    transient: dict[int, int] = {}  # node -> error replies that may not happen again
    expected: int | None = None
    while True:
        new = [n for n in grid.get_node_ids() if n not in partition_of]
        if new:
            answers = query_partitions(grid, new, timeout=max(deadline - time.monotonic(), 1.0))
            for node, answer in answers.items():
                if isinstance(answer, TransientAnswer):
                    transient[node] = transient.get(node, 0) + 1
                    if transient[node] < TRANSIENT_ATTEMPTS:
                        log(WARNING, "[fedaccel] node %s did not report its partition (%s); asking it again "
                            "(%s of %s)", node, answer, transient[node] + 1, TRANSIENT_ATTEMPTS)
                        continue
                if isinstance(answer, str):
                    raise FederationError(f"node {node} could not report its partition: {answer}"
                                          + (f" ({transient[node]} such answers)" if isinstance(answer, TransientAnswer) else ""))
                pid, n = answer
                if expected is not None and n != expected:
                    raise FederationError(
                        f"nodes disagree on num-partitions ({n} vs {expected}); "
                        "give every SuperNode the same --node-config num-partitions")
                expected = n
                if pid in partition_of.values():
                    raise FederationError(f"two nodes claim partition-id={pid}; each needs its own")
                partition_of[node] = pid
        if expected is not None and len(partition_of) >= expected:
            return Federation({pid: node for node, pid in partition_of.items()})
        if time.monotonic() > deadline:
            silent = [n for n in grid.get_node_ids() if n not in partition_of]
            if silent:
                raise FederationError(
                    f"{len(silent)} online node(s) did not say which partition they hold within "
                    f"{timeout:.0f} s ({len(partition_of)} did): each answer starts a ClientApp, "
                    "which a busy or slow machine delays; raise round-timeout (the discovery "
                    "waits as long as a round) or run fewer runs at once; in Flower's simulation, "
                    f"{len(silent) + len(partition_of)} SuperNodes can be more than this machine answers for "
                    "in that time: set fewer (fedaccel-federations size local-simulation N)")
            raise FederationError(
                f"only {len(partition_of)} of {expected if expected is not None else '?'} clients "
                f"registered within {timeout:.0f} s; {MISSING_NODES_HINT}")
        time.sleep(poll)


def resolve_run_dir(cfg: RunConfig) -> Path:
    """``results-dir``/``run-name``; the name defaults to algo-dataset-seed-time."""
    name = cfg.run_name or (
        f"{cfg.algo}-{cfg.dataset}-seed{cfg.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return (Path(cfg.results_dir).expanduser() / name).resolve()


def writable_run_dir(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """The run's results folder (``run_dir``, or the one ``cfg`` names),
    created and checked writable before any work."""
    run_dir = run_dir or resolve_run_dir(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".fedaccel-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            raise ResultsDirError(
                f"results-dir={cfg.results_dir!r}, run-name={cfg.run_name!r}: the run folder's path is too long "
                f"for the file system ({err.strerror}); use a shorter run-name or results-dir") from None
        raise ResultsDirError(
            f"results-dir={cfg.results_dir!r}: cannot write the run folder {run_dir} "
            f"({err.strerror or err}); set results-dir to a writable folder") from None
    return run_dir


class Experiment:
    """One run on the server: model, test set, strategy and recorder."""

    def __init__(self, cfg: RunConfig, federation: Federation, quiet: bool = False,
                 run_dir: Path | None = None, resume: Checkpoint | None = None,
                 client_store: ClientStore | None = None, engine: str = "fast",
                 run_id: int | None = None) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.resume = resume
        self.client_store = client_store
        self.federation = federation
        self.spec = get_algorithm(cfg.algo)
        dataset = load_data(data_config_for(cfg, federation.num_clients))
        self.device = select_device(cfg.device, cfg.tf32)
        self.model = build_model_for(cfg, dataset).to(self.device)
        self.test_x = torch.from_numpy(dataset.test_x).to(self.device)
        self.test_y = torch.from_numpy(dataset.test_y).to(self.device)
        self.strategy = self.spec.build_strategy(cfg, federation)
        self.run_dir = run_dir or writable_run_dir(cfg)
        # optimality: each round's gap and distance to the optimum (fedaccel.optimum)
        self.optimum = optimum_of(cfg, dataset) if cfg.optimality else None
        resolved = cfg.to_dict()
        resolved["resolved"].update({
            "model": model_name(cfg),
            # with the model's name, what rebuilds it (fedaccel.runtime.load_final_model)
            "input-shape": [int(d) for d in dataset.input_shape],
            "num-classes": int(dataset.num_classes),
            "num-clients": federation.num_clients,
            "cohort-size": self.strategy.cohort_size,
            "partition-sizes": dataset.partition_sizes(),
            "global-test-size": int(dataset.test_y.shape[0]),
            # float sums are split across threads: the same seed gives the same
            # bits with the same thread count (docs/measurements.md)
            "torch-threads": torch.get_num_threads(),
            # and with the same libraries and CPU dispatch (the same machine type)
            "environment": environment(self.device),
        })
        if self.optimum is not None:  # and where the run starts (round 0), for rates from the start
            start_gap, start_dist = self.optimum.measure(self.model.state_dict())
            resolved["resolved"]["optimum"] = {**self.optimum.describe(), "start-gap": start_gap,
                                               "start-dist": start_dist}
        rows_before = resume.rows if resume is not None else []
        self.recorder = RunRecorder(self.run_dir, resolved, cfg.target_accuracy,
                                    cfg.num_server_rounds, quiet=quiet, rows=rows_before,
                                    engine=engine, run_id=run_id,
                                    tracker=open_tracker(cfg.tracker, cfg.tracker_uri, self.run_dir,
                                                         resolved, rows_before))
        self._round_start = time.perf_counter()

    def evaluate_global(self, arrays: ArrayRecord) -> tuple[float, float]:
        """Loss and accuracy of ``arrays`` on the fixed global test set."""
        load_into(self.model, arrays)
        return evaluate(self.model, self.test_x, self.test_y)

    def on_round_end(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's ``evaluate_fn``: called after every round (and once before round 1)."""
        if server_round == 0:
            loss, acc = self.evaluate_global(arrays)
            log(INFO, "[fedaccel] initial model: accg %.4f loss %.4f", acc, loss)
            self._round_start = time.perf_counter()
            return MetricRecord({"accg": acc, "loss": loss})
        accg = loss = None
        if self.cfg.is_eval_round(server_round):
            loss, accg = self.evaluate_global(arrays)
        stats = self.strategy.rounds.get(server_round)
        now = time.perf_counter()
        row = {
            "round": server_round,
            "accg": accg,
            "loss": loss,
            "accl": stats.accl if stats else None,
            "bytes_up": stats.bytes_up if stats else 0,
            "bytes_down": stats.bytes_down if stats else 0,
            "seconds": now - self._round_start,
            "train_loss": stats.train_loss if stats else None,
            "clients": stats.replies if stats else 0,
            "failures": stats.failures if stats else 0,
            "state_lost": stats.state_lost if stats else 0,
        }
        if self.optimum is not None:
            row["gap"], row["dist"] = self.optimum.measure(arrays)
        self._round_start = now
        self.recorder.log_round(row)
        if self.cfg.checkpoint_every and server_round % self.cfg.checkpoint_every == 0:
            self.save_checkpoint(server_round, arrays)
        raise_if_stop_requested()  # a Ctrl-C whose KeyboardInterrupt was lost: stop after this round
        return None if accg is None else MetricRecord({"accg": accg, "loss": loss})

    def save_checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        """Everything the run needs to continue after ``server_round`` (fedaccel.checkpoint)."""
        trees, server_arrays = carried_state(self.strategy)
        path = write_checkpoint(self.run_dir, Checkpoint(
            round=server_round, run_config=dict(self.cfg.raw), num_clients=self.federation.num_clients,
            model=arrays, server_state=trees, server_arrays=server_arrays, rows=list(self.recorder.rows),
            clients=self.client_store.client_state_files() if self.client_store is not None else None))
        log(INFO, "[fedaccel] checkpoint after round %s: %s", server_round, path)

    def run(self, grid: Grid) -> dict:
        """Train for ``num-server-rounds`` (from the checkpoint's next round
        when resuming) and write every results file; a run that ends early
        says so in ``status.json`` (``stopped`` on Ctrl-C, else ``failed``
        with its one-line error)."""
        try:
            return self._run(grid)
        except KeyboardInterrupt:
            self.recorder.fail("stopped by the user (interrupt)", state="stopped")
            raise
        except BaseException as err:
            self.recorder.fail(str(err) if isinstance(err, USER_ERRORS) else f"{type(err).__name__}: {err}")
            raise

    def _run(self, grid: Grid) -> dict:
        if self.resume is not None:
            initial, first_round = self.resume.model, self.resume.round + 1
            restore_carried_state(self.strategy, self.resume)
            if not self.quiet:
                print(f"[fedaccel] resuming after round {self.resume.round} of "
                      f"{self.cfg.num_server_rounds} from its checkpoint", flush=True)
        else:
            initial, first_round = self.strategy.initial_model(state_to_arrays(self.model)), 1
        with quiet_collector():  # full collections would walk every object of the set-up, every few rounds
            result = self.strategy.start(
                grid=grid,
                initial_arrays=initial,
                num_rounds=self.cfg.num_server_rounds,
                timeout=self.cfg.round_timeout,
                evaluate_fn=self.on_round_end,
                first_round=first_round,
            )
        self.strategy.client_errors.report_repeats()  # after the last round, evaluated or not
        final = result.arrays if len(result.arrays) else initial
        np.savez(self.run_dir / "final_model.npz", **{k: a.numpy() for k, a in final.items()})
        return self.recorder.finish(extra_files=("final_model.npz",))  # prints the results folder last


class ClientStore(Protocol):
    """Every client's state, readable by the server: the fast runner's grid
    (:class:`fedaccel.local_grid.LocalGrid`); Flower's grids have none."""

    def client_state_files(self) -> dict[str, bytes]: ...

    def restore_client_state_files(self, files: dict[str, bytes]) -> None: ...


STATEFUL_ON_FLOWER = (
    "keeps state on its clients, which Flower keeps in node contexts the server cannot save; "
    "set client-state='disk' (in Flower's simulation the server then saves the clients' state "
    "files), or checkpoint it with the fast runner (fedaccel-run)")


def load_resume(cfg: RunConfig, run_config: dict, client_store: ClientStore | None) -> Checkpoint:
    """The checkpoint ``resume`` names, checked against this run: the same run
    config (but where results go and how often to checkpoint), and every
    client's state when the algorithm's clients keep state."""
    path = find_checkpoint(cfg.resume)
    ckpt = read_checkpoint(path)
    mismatch = config_mismatch(ckpt.run_config, run_config)
    if mismatch:
        shown = "; ".join(mismatch[:4]) + (f"; and {len(mismatch) - 4} more" if len(mismatch) > 4 else "")
        raise config_error("resume", cfg.resume, f"its checkpoint was written with another run config ({shown}); "
                           "resume with the checkpoint's own config: fedaccel-run --resume RUN_DIR reads it, "
                           "flwr run takes it as --run-config RUN_DIR/checkpoints/resume.toml")
    changed = resolution_changed(run_dir_of(path), cfg)
    if changed is not None:
        raise CheckpointError(f"resume={str(cfg.resume)!r}: {changed}")
    if cfg.stateful_clients and (client_store is None or ckpt.clients is None):
        raise config_error("resume", cfg.resume, f"algo='{cfg.algo}' {STATEFUL_ON_FLOWER}")
    return ckpt


def refuse_on_flower(cfg: RunConfig) -> None:
    """What the server of a ``flwr run`` refuses from the config alone,
    before it asks any node (the dashboard checks the same before it
    launches one): ``cohort-batching='on'`` without cohort nodes or for a
    run that cannot be batched (:func:`refuse_unbatchable`), a setting that
    needs the optimum of all clients' data, and checkpoints of stateful
    clients whose state the server cannot copy (not on a shared disk). The
    fast runner refuses its own before (``preflight``, then the cohort
    trainer's own check on the real model)."""
    if cfg.cohort_batching == "on" and not cfg.logical_clients:
        raise config_error("cohort-batching", "on", "batched cohorts run in the fast runner (fedaccel-run) "
                           "or on cohort nodes (logical-clients > 0); Flower's engines with one client per "
                           "node train one client at a time: use 'auto' or 'off', or set logical-clients")
    if cfg.needs_optimum:
        raise config_error(*cfg.optimum_setting, "is computed from every client's training data, which only the fast "
                           "runner's server holds for certain (a SuperNode may hold its own data): run it with "
                           "fedaccel-run or fedaccel-sweep")
    if cfg.checkpoint_every and cfg.stateful_clients and cfg.client_state != "disk":
        raise config_error("checkpoint-every", cfg.checkpoint_every, f"algo='{cfg.algo}' {STATEFUL_ON_FLOWER}")
    refuse_by_model(cfg)


def refuse_on_fast_runner(cfg: RunConfig) -> None:
    """What the fast runner refuses from the config alone (its preflight and
    ``--check``, and its server before the run folder): checkpoints of
    cohort nodes."""
    if cfg.logical_clients and (cfg.checkpoint_every or cfg.resume):
        raise config_error("logical-clients", cfg.logical_clients,
                           "the fast runner does not checkpoint cohort nodes (a resumed run would rebuild "
                           "them with one client each); the fast runner batches cohorts itself: use "
                           "logical-clients=0 with cohort-batching, or checkpoint under flwr run")


def refuse_by_model(cfg: RunConfig) -> None:
    """What a run refuses from its config and the model it names, built on
    the CPU without data, before any work (the fast runner's ``--check`` and
    preflight, a study's cells, the server of a ``flwr run`` before it asks
    its nodes anything): :func:`refuse_unbatchable`, and a
    ``gc.global-layers`` naming no layer of the model (the run's own check
    would come only once the data is loaded)."""
    model = _named_model(cfg) if cfg.cohort_batching == "on" or cfg.gc.mode in ("hybrid", "local-only") else None
    refuse_unbatchable(cfg, model)
    if model is not None and any(True for _ in model.parameters()):
        gc_partition(cfg.gc.mode, [n for n, _ in model.named_parameters()], cfg.gc.lam, cfg.gc.global_layers)


def _named_model(cfg: RunConfig) -> torch.nn.Module:
    """The model ``cfg`` names for its dataset, built on the CPU without data
    and without moving the run's seeding; an empty module where it cannot be
    built (the run itself refuses that later, in its own words)."""
    shape, classes, _ = DATASET_SPECS.get(cfg.dataset, (None, 0, False))
    if shape is not None:
        try:
            with torch.random.fork_rng(devices=[]):  # the run's seeding is not ours to move
                return build_model(model_name(cfg), tuple(shape), classes)
        except Exception:  # noqa: BLE001 - only what the run itself would refuse
            pass
    return torch.nn.Module()


def refuse_unbatchable(cfg: RunConfig, model: torch.nn.Module | None = None) -> None:
    """``cohort-batching='on'`` for a run whose clients cannot train as one
    batched model: refused in one line before any work, for the reasons the
    trainer itself would give (:func:`fedaccel.clients.cohort.fallback_reason`:
    the algorithm's local solver, a model with buffers or dropout), read from
    the config and ``model`` (default: the one it names, :func:`_named_model`)."""
    if cfg.cohort_batching != "on":
        return
    reason = fallback_reason(get_algorithm(cfg.algo).solver(cfg), cfg,
                             model if model is not None else _named_model(cfg))
    if reason:
        raise unbatchable_error(reason)


def run_experiment(grid: Grid, run_config: dict, quiet: bool = False) -> Path:
    """Parse config, discover clients, run; returns the run's results folder.

    ``quiet`` silences the per-round lines (the results line is printed anyway).
    With ``resume``, the run continues from its checkpoint, in its own folder.
    """
    cfg = parse_run_config(run_config)
    require_tracker(cfg.tracker, cfg.tracker_uri)  # a missing package refused before any work
    client_store: ClientStore | None = getattr(grid, "client_store", None)
    engine = "fast" if client_store is not None else "flower"
    if engine == "flower":
        refuse_on_flower(cfg)  # before the run folder, the nodes and the data
    run_id = grid.run.run_id
    if engine == "fast":
        refuse_on_fast_runner(cfg)
    shared_disk = None
    if (client_store is None and cfg.stateful_clients and cfg.client_state == "disk"
            and (cfg.checkpoint_every or cfg.resume)):
        client_store = shared_disk = SharedDiskClientStore(state_run_dir(cfg.state_dir, grid.run.run_id))
    resume = load_resume(cfg, run_config, client_store) if cfg.resume else None
    # a results folder that cannot be written fails now, not at the end; one
    # this run creates is removed again if the run is refused before its first file
    target = run_dir_of(resume.path) if resume is not None else resolve_run_dir(cfg)
    try:
        created = not target.exists()
    except OSError:  # a path the file system refuses (a name too long): writable_run_dir says so in one line
        created = True
    run_dir = writable_run_dir(cfg, target)
    with removed_if_left_empty(run_dir, created):
        # one message at a time per node (SerialNodes), replies noticed within ms, not after
        # Flower's fixed 0.1-3 s sleeps (PromptGrid)
        grid = PromptGrid(SerialNodes(grid, give_up_after=GIVE_UP_ROUNDS * cfg.round_timeout))
        if cfg.logical_clients:  # the nodes serve logical clients in slices (fedaccel.cohort_nodes)
            # the fast runner says how the nodes train on stderr, as it does for its own clients
            announce = None if engine != "fast" else (lambda note: None) if quiet else (
                lambda note: print(f"fedaccel: cohort nodes: {note}", file=sys.stderr))
            grid = CohortNodes(grid, cfg.logical_clients, query_timeout=min(cfg.round_timeout, 120.0),
                               announce=announce)
        federation = discover_federation(grid, timeout=cfg.round_timeout)
        if isinstance(grid, CohortNodes):
            grid.close_discovery()  # from now on a node that appears is a restarted SuperNode
        cfg.cohort_size(federation.num_clients)  # fail before any work if too many
        if resume is not None and resume.num_clients != federation.num_clients:
            raise CheckpointError(f"resume={cfg.resume!r}: the checkpoint is of a run with {resume.num_clients} "
                                  f"clients, this federation has {federation.num_clients}; resume it with "
                                  f"{resume.num_clients} (fast runner: --resume sets it)")
        require_memory(cfg, federation.num_clients, client_contexts=False)  # the server's data
        if resume is not None and resume.clients is not None and client_store is not None:
            client_store.restore_client_state_files(resume.clients)
        experiment = Experiment(cfg, federation, quiet=quiet, run_dir=run_dir, resume=resume,
                                client_store=client_store,
                                engine=engine, run_id=run_id)
        if shared_disk is not None:
            shared_disk.applied = lambda: experiment.strategy.accepted_round
    experiment.run(grid)
    return experiment.run_dir


@contextmanager
def removed_if_left_empty(folder: Path, created: bool) -> Iterator[None]:
    """Within the block, an exception removes ``folder`` again if this run
    ``created`` it and nothing was written into it (a run refused before its
    first file leaves no empty run folder); a folder that holds files stays."""
    try:
        yield
    except BaseException:
        if created:
            try:
                folder.rmdir()
            except OSError:
                pass  # not empty, or already gone: leave it as it is
        raise
