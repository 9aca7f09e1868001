"""Server-side machinery shared by every algorithm.

:class:`FedAccelStrategy` is a mixin placed before Flower's ``FedAvg`` (or
``FedProx``, which adds ``proximal-mu`` to the training config) in the MRO.
It takes over ``aggregate_train`` (the three stages below) and adds what
Flower's strategies lack:

- seeded client sampling by *partition id* (Flower's FedAvg samples node ids
  with Python's unseeded global ``random``, and node ids change every run), so
  the same seed trains the same clients in the Ray simulation, on real
  SuperNodes and in the fast runner;
- replies ordered by partition id before aggregation, so floating-point sums
  are identical whatever order replies arrive in;
- truthful communication accounting (serialized bytes of every ArrayRecord
  sent for training and received back);
- ACCL: the unweighted mean over clients of the global model's accuracy on
  each client's local test split (FedRKMGC paper, "Evaluation Metrics");
- a client's error reply logged once per run as one line naming the node,
  its partition and the cause (:class:`fedaccel.client_errors.ClientErrorLog`),
  and a clear stop, with those causes, when every client of a round failed;
- a partition whose SuperNode comes back under a new node id (a restart
  without SuperNode authentication) is followed to the new id
  (:class:`fedaccel.membership.NodeMembership`);
- every message checked against the algorithm's message contract
  (:mod:`fedaccel.contract`).

The machinery it uses lives below the algorithms, once: Grid views
(:mod:`fedaccel.grids`), membership (:mod:`fedaccel.membership`), error
reports (:mod:`fedaccel.client_errors`), ACCL and per-round facts
(:mod:`fedaccel.metrics`).

A round's replies become the new global model in three stages, the same for
every algorithm: :meth:`FedAccelStrategy.combine` aggregates them into one
model (default: Flower's FedAvg example-weighted mean, computed by
:func:`fedaccel.strategies.server_steps.weighted_mean_of_replies`, i.e. :func:`fedaccel.arrays.mean_of_records`, bit-identical to
Flower's ``aggregate_arrayrecords``); the update transforms of
:mod:`fedaccel.clients.composition` (global GC) edit the aggregated update; then
:meth:`FedAccelStrategy.server_step` (momentum, Adam, relaxation, FedACG)
turns it into the new model. Server optimizers are written as this hook,
not taken from Flower's ``FedAvgM``/``FedAdam``, because Flower's
``aggregate_train`` fuses the mean and the step and leaves no point at which
GC-Fed's projection can act before the step's state is updated.

Selection works by handing Flower's ``configure_train`` a :class:`fedaccel.grids.NodeSubset`
grid whose ``get_node_ids()`` returns only the chosen nodes, with
``fraction_train = 1``: Flower then builds one message per chosen node.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedaccel.clients.composition import server_update_transforms
from fedaccel.arrays import all_finite, config_record, from_numpy, record_dict, records_of, to_numpy, views_reused
from fedaccel.client_errors import ClientErrorLog
from fedaccel.config import RunConfig
from fedaccel.contract import CONFIG_RECORD, MODEL_RECORD, NO_EXTRAS
from fedaccel.errors import RejectedReplies, RoundFailedError
from fedaccel.grids import GIVE_UP_ROUNDS, NodeSubset
from fedaccel.membership import Federation, NodeMembership
from fedaccel.metrics import RoundLog, mean_client_accuracy
from fedaccel.samplers import cohort as sample_partitions
from fedaccel.torch_utils import derive_seed, payload_bytes
from fedaccel.strategies.server_steps import (check_reply_consistency, mean_metric_records,
                                              weighted_mean_of_replies)


NON_FINITE = "non-finite values in"  # the start of reply_problem's line for a NaN or inf value


class FedAccelStrategy:
    """Mixin: put it first, e.g. ``class S(FedAccelStrategy, FedAvg)``.

    Subclasses (algorithms) may override :meth:`sample_cohort` (which clients
    train) and :meth:`round_config` (extra values sent to clients).

    :attr:`messages` is the algorithm's message contract: the *same object*
    as its solver's :attr:`fedaccel.clients.base.LocalSolver.messages` (a strategy
    that adds records says ``messages = MySolver.messages``; a test checks
    every registered pair). Training messages are checked against it before
    they are sent, replies before they are aggregated.
    """

    messages = NO_EXTRAS
    # Attributes that carry over from one round to the next and so go into a
    # checkpoint (fedaccel.checkpoint); each subclass names its own (SCAFFOLD:
    # ``("c",)``) and they are collected over the MRO. Per-round bookkeeping
    # (``rounds``, ``global_arrays``) is rebuilt by every round and is not named.
    carried_state: tuple[str, ...] = ("accepted_round", "client_error_rounds")
    # Carried attributes added after checkpoints without them were written: such
    # a checkpoint still restores, and they keep their fresh value.
    optional_carried_state: tuple[str, ...] = ("client_error_rounds",)

    def __init__(self, *, run_cfg: RunConfig, federation: Federation, **kwargs: Any) -> None:
        kwargs.setdefault("evaluate_metrics_aggr_fn", mean_client_accuracy)
        kwargs.setdefault("train_metrics_aggr_fn", mean_metric_records)  # Flower's default, faster
        super().__init__(  # type: ignore[call-arg]
            fraction_train=1.0,
            fraction_evaluate=1.0,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=1,
            **kwargs,
        )
        self.run_cfg = run_cfg
        self.federation = federation
        self.cohort_size = run_cfg.cohort_size(federation.num_clients)
        self.sampler = run_cfg.sampler  # 'auto' resolved by the reader (fedaccel.run_config)
        self.straggler_policy = run_cfg.straggler_policy
        self.rounds: dict[int, RoundLog] = {}
        self.global_arrays: ArrayRecord | None = None  # the model sent this round
        self.stateful = run_cfg.stateful_clients
        self.update_transforms = server_update_transforms(run_cfg)  # f(sent, aggregate) -> aggregate
        # The commit protocol's server half (docs/client-state.md): the last
        # round whose reply of each partition was applied to the server's
        # model and state; sent to stateful clients as ``accepted-round``.
        self.accepted_round: dict[int, int] = {}
        self.membership = NodeMembership(federation, query_timeout=min(run_cfg.round_timeout, 120.0))
        # error replies: logged once each, repeats counted at the end of the run
        self.client_errors = ClientErrorLog(lambda: federation.partition_of_node, run_cfg.num_server_rounds)
        self._told_no_accl = False  # the warning that no client has a local test sample: once a run

    @property
    def client_error_rounds(self) -> dict[str, list[int]]:
        """The error replies seen so far (``"node N (partition P): cause"`` ->
        the rounds it came in), carried over a resume so that each is still
        logged once per run and its repeats counted over the whole run."""
        return {line: sorted(rounds) for line, rounds in self.client_errors.seen.items()}

    @client_error_rounds.setter
    def client_error_rounds(self, value: dict[str, list[int]]) -> None:
        self.client_errors.seen = {line: set(rounds) for line, rounds in value.items()}

    # ------------------------------------------------------------- hooks
    def sample_cohort(self, server_round: int) -> list[int]:
        """Partition ids that train this round (``sampler``: uniform or reshuffle)."""
        return sample_partitions(self.sampler, self.run_cfg.seed, server_round,
                                 self.federation.num_clients, self.cohort_size)

    def round_config(self, server_round: int) -> dict[str, Any]:
        """Values every client gets with its training message this round."""
        return {"lr": self.run_cfg.lr_at(server_round), "local-epochs": self.run_cfg.local_epochs}

    def choose_stragglers(self, server_round: int, cohort: list[int]) -> dict[int, int]:
        """FedCDR appendix F.3: ``straggler-fraction`` of the cohort (rounded) does
        a number of local epochs drawn uniformly from 1..``local-epochs``."""
        count = int(round(self.run_cfg.straggler_fraction * len(cohort)))
        if count == 0:
            return {}
        rng = np.random.default_rng(derive_seed(self.run_cfg.seed, server_round, "stragglers"))
        chosen = rng.choice(len(cohort), size=count, replace=False)
        epochs = rng.integers(1, self.run_cfg.local_epochs + 1, size=count)
        return {cohort[int(i)]: int(e) for i, e in zip(sorted(chosen), epochs)}

    def broadcast_arrays(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The model sent to clients (hook; FedACG sends a lookahead point)."""
        return arrays

    def broadcast_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Extra ArrayRecords sent to every client with the model (hook;
        e.g. SCAFFOLD's server control variate). Counted in bytes_down."""
        return {}

    def _client_updates(self, partition: int, log_: RoundLog) -> dict[str, Any]:
        """Per-client config values: a straggler's epochs; for stateful algorithms,
        ``accepted-round``, the last round whose reply of this client the server
        applied (0 = none), so the client commits or rolls back its state."""
        updates: dict[str, Any] = {}
        if partition in log_.stragglers:
            updates["local-epochs"] = log_.stragglers[partition]
        if self.stateful:
            updates["accepted-round"] = self.accepted_round.get(partition, 0)
        return updates

    def initial_model(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model of round 1, given the seeded initial model (hook)."""
        return arrays

    def sent_model(self) -> ArrayRecord:
        """The global model this round's training messages carried."""
        if self.global_arrays is None:
            raise RuntimeError(f"{type(self).__name__}: no model was sent yet "
                               "(aggregate_train before configure_train)")
        return self.global_arrays

    def combine(self, server_round: int, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the valid replies into one model, *before* any server step
        (hook; default: Flower's FedAvg example-weighted mean, computed on
        zero-copy views). ``self.global_arrays`` is the model that was sent, so
        ``aggregate - global_arrays`` is the round's aggregated update.

        Contract: a combine that updates server state from the replies (SCAFFOLD's
        ``c``, FedDyn's ``h``) must use every reply it is given and return a
        model: the replies passed here are the ones recorded as applied
        (``accepted_round``), which clients then commit."""
        # Flower's FedAvg.aggregate_train, on plain reads of the replies
        # (server_steps: check_reply_consistency, mean_metric_records); the
        # replies given here have no errors (aggregate_train sorted them out)
        if not replies:
            return None, None
        log(INFO, "aggregate_train: Received %s results and %s failures", len(replies), 0)
        contents = [m.content for m in replies]
        check_reply_consistency(contents, self.weighted_by_key)  # type: ignore[attr-defined]
        arrays = weighted_mean_of_replies(contents, self.weighted_by_key)  # type: ignore[attr-defined]
        return arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)  # type: ignore[attr-defined]

    def server_step(self, server_round: int, aggregate: ArrayRecord) -> ArrayRecord:
        """The new global model from the round's aggregate (hook; default: the
        aggregate itself, FedAvg's ``x <- x + mean update``).

        Server optimizers (momentum, Adam, relaxation, FedACG's lookahead
        momentum) override this. ``aggregate`` has already been through the
        update transforms (global GC), so every server state (momentum buffers,
        Adam moments) is built from the transformed update, as GC-Fed's
        Algorithm 1 (lines 13-15) centralizes the aggregated update before the
        server uses it.
        """
        return aggregate

    # ------------------------------------------------------------- rounds
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              first_round: int = 1) -> Result:
        """Flower's ``Strategy.start``, or, with ``first_round > 1`` (a run
        resumed from a checkpoint after round ``first_round - 1``, whose model
        is ``initial_arrays``), the same round body for rounds
        ``first_round..num_rounds`` and no evaluation of the initial model.

        Written here because Flower's ``start`` always begins at round 1; the
        body below is its loop, call for call (configure_train,
        send_and_receive, aggregate_train, configure_evaluate, send_and_receive,
        aggregate_evaluate, evaluate_fn), so a resumed run ends with the model
        an uninterrupted one does (tests/test_checkpoint.py).
        """
        if first_round <= 1:
            return super().start(grid, initial_arrays, num_rounds, timeout,  # type: ignore[misc]
                                 train_config, evaluate_config, evaluate_fn)
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result, arrays = Result(), initial_arrays
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(server_round, arrays, train_config, grid), timeout=timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                result.arrays = arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(server_round, arrays, evaluate_config, grid), timeout=timeout)
            evaluate_metrics = self.aggregate_evaluate(server_round, replies)
            if evaluate_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = evaluate_metrics
            if evaluate_fn:
                server_metrics = evaluate_fn(server_round, arrays)
                if server_metrics is not None:
                    result.evaluate_metrics_serverapp[server_round] = server_metrics
        return result

    # ------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.membership.follow_restarted_nodes(grid)
        cohort = self.sample_cohort(server_round)
        log_ = self.rounds.setdefault(server_round, RoundLog())
        log_.sampled = list(cohort)
        log_.stragglers = self.choose_stragglers(server_round, cohort)
        config = ConfigRecord({**dict(config), **self.round_config(server_round)})
        view = NodeSubset(grid, [self.federation.node_of_partition[p] for p in cohort])
        arrays = self.broadcast_arrays(server_round, arrays)
        self.global_arrays = arrays
        self._sent_dtypes = {key: array.dtype for key, array in arrays.items()}
        messages = list(super().configure_train(server_round, arrays, config, view))  # type: ignore[misc]
        extra = self.broadcast_records(server_round)
        per_client = bool(log_.stragglers or self.stateful)
        pid = self.federation.partition_of_node if per_client else {}  # built over all partitions: only when used
        checked: set[tuple[int, tuple[str, ...]]] = set()  # (shared content, config keys added): checked once
        for i, m in enumerate(messages):
            updates = self._client_updates(pid[m.metadata.dst_node_id], log_) if per_client else {}
            shape = (id(m.content), tuple(updates))
            if extra or updates:  # FedAvg's messages share one content: this client's own, built once
                messages[i] = _with_content(m, extra, updates)
            if shape not in checked:  # the messages of one shape carry the same records and config keys
                self._check_outgoing(messages[i])
                checked.add(shape)
        log_.bytes_down += messages_bytes(messages)
        return messages

    def _check_outgoing(self, message: Message) -> None:
        """A training message matches :attr:`messages` (a mismatch is a bug in
        the strategy: :class:`fedaccel.contract.ContractError`)."""
        content = message.content
        self.messages.check_records(self.run_cfg.algo, "to_client", records_of(content, ArrayRecord).keys())
        self.messages.check_config_keys(self.run_cfg.algo, content[CONFIG_RECORD].keys(),
                                        self.stateful)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's new global model and metrics from its training replies.

        Once they are aggregated (or the round failed), the replies' arrays
        are dropped from their messages (:func:`release_reply_arrays`):
        Flower's ``Strategy.start`` keeps a round's replies in a local
        variable until the next round's replies replace it, so they would
        otherwise live through the next round's training (at 1,000 clients of
        the 1.66M-parameter CNN, 6.6 GB held twice).
        """
        replies = list(replies)
        try:
            with views_reused():  # the checks and the mean read the same Arrays
                return self._aggregate_train(server_round, replies)
        finally:
            release_reply_arrays(replies)

    def _aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = self._ordered(replies)
        ok = []
        log_ = self.rounds.setdefault(server_round, RoundLog())
        # a client that replied twice in one round (a strategy that sent it two
        # messages) keeps only the state of the one it trained last, which the
        # server cannot tell apart: neither reply is applied, so the client rolls
        # back to the state the server counts on
        sources = collections.Counter(m.metadata.src_node_id for m in replies if not m.has_error())
        diverged = 0  # replies rejected for NaN or inf values: their local training diverged
        for m in replies:
            problem = None if m.has_error() else (
                f"{sources[m.metadata.src_node_id]} replies from this client in one round; none is applied"
                if sources[m.metadata.src_node_id] > 1 else self.reply_problem(m))
            if problem is not None:
                log(WARNING, "round %s: rejected the reply of node %s: %s",
                    server_round, m.metadata.src_node_id, problem)
                log_.rejected += 1
                diverged += problem.startswith(NON_FINITE)
            elif not m.has_error():
                ok.append(m)
        log_.failures = len(log_.sampled) - len(ok)  # errors, rejected and missing replies
        log_.bytes_up += messages_bytes([m for m in replies if not m.has_error()])  # rejected ones came too
        new_causes = self.client_errors.report(server_round, replies)
        if not ok:
            reasons = self.client_errors.causes(replies)
            if log_.rejected and diverged == log_.rejected:  # the usual cause: too large a step
                reasons.append(f"{diverged} replies rejected for NaN or inf values: their local training "
                               "diverged, so lower lr or set clip-norm")
            elif log_.rejected:
                reasons.append(f"{log_.rejected} malformed replies rejected")
            if len(replies) < len(log_.sampled):
                reasons.append(f"{len(log_.sampled) - len(replies)} gave no reply within "
                               f"round-timeout={self.run_cfg.round_timeout:g} s")
            reasons = "; ".join(reasons)
            raise RoundFailedError(
                f"round {server_round}: all {len(log_.sampled)} sampled clients failed "
                f"({reasons or 'no reply before the timeout'})"
            )
        pid_of = self.federation.partition_of_node
        for m in ok:
            metrics_in = next(iter(records_of(m.content, MetricRecord).values()))
            if "state-lost" in metrics_in:
                log_.state_lost += 1
                log(WARNING, "round %s: client %s had lost its %s state (a SuperNode restarted "
                    "with client-state='context', or, in Flower's simulation, a message of it "
                    f"that had timed out was still running when this one came, {GIVE_UP_ROUNDS} "
                    "round-timeouts after it was sent); it restarted "
                    "from the initial state, so the algorithm's invariants no longer hold "
                    "exactly. Use client-state='disk' for restarts, and a round-timeout longer "
                    "than the slowest client's round.",
                    server_round, pid_of.get(m.metadata.src_node_id), self.run_cfg.algo)
        if log_.stragglers and self.straggler_policy == "drop":
            kept = [m for m in ok if pid_of.get(m.metadata.src_node_id) not in log_.stragglers]
            log_.dropped = len(ok) - len(kept)
            ok = kept
        log_.replies = len(ok)  # the replies that go into the new model (metrics.jsonl's clients)
        if log_.failures:
            errors = sum(m.has_error() for m in replies)
            # a round whose only failures are errors already reported: no new warning
            known = errors == log_.failures and not new_causes
            dropped = (f"{log_.dropped} straggler {'reply' if log_.dropped == 1 else 'replies'} dropped "
                       f"(straggler-policy='drop'); " if log_.dropped else "")
            log(INFO if known else WARNING,
                "round %s: %s of %s sampled clients failed, were rejected or did not "
                "reply in time; %saggregating the other %s", server_round, log_.failures,
                len(log_.sampled), dropped, len(ok))
        if not ok:  # (a round without any reply failed above) every reply was a dropped straggler's
            log(WARNING, "round %s: every reply came from a straggler and was dropped "
                "(straggler-policy='drop'); the model is unchanged", server_round)
            return None, None
        # aggregate -> update transforms (global GC) -> server step: every server
        # state is built from the transformed update (see server_step)
        arrays, metrics, ok = self._combine_sound(server_round, ok, log_)
        if arrays is not None:
            for transform in self.update_transforms:
                arrays = transform(self.global_arrays, arrays)
            arrays = self._keep_dtypes(self.server_step(server_round, arrays))
            for m in ok:  # applied: these clients commit this round's state next time
                self.accepted_round[pid_of[m.metadata.src_node_id]] = server_round
        if metrics is not None and "train-loss" in metrics:
            log_.train_loss = float(metrics["train-loss"])
        return arrays, metrics

    def _combine_sound(self, server_round: int, ok: list[Message],
                       log_: RoundLog) -> tuple[ArrayRecord | None, MetricRecord | None, list[Message]]:
        """:meth:`combine` of the replies, less those it finds it cannot
        combine (:class:`RejectedReplies`): each is rejected as a malformed
        reply is (logged, counted, its client's state not committed) and the
        others are combined again; the round fails if none is left."""
        while True:
            try:
                arrays, metrics = self.combine(server_round, ok)
                return arrays, metrics, ok
            except RejectedReplies as rejected:
                problems = rejected.problems
                if not problems or any(not 0 <= i < len(ok) for i in problems):
                    raise RuntimeError(f"{type(self).__name__}.combine rejected replies it was not given "
                                       f"({len(ok)} replies): {rejected}") from None
                for i, why in sorted(problems.items()):
                    log(WARNING, "round %s: rejected the reply of node %s: %s",
                        server_round, ok[i].metadata.src_node_id, why)
                log_.rejected += len(problems)
                log_.failures += len(problems)
                ok = [m for i, m in enumerate(ok) if i not in problems]
                log_.replies = len(ok)
                if not ok:
                    raise RoundFailedError(f"round {server_round}: no reply left to aggregate, the last "
                                           f"rejected because {problems[min(problems)]}") from None
                # the round's count said before combining no longer holds
                log(WARNING, "round %s: %s of %s sampled clients failed or were rejected in all; "
                    "aggregating the other %s", server_round, log_.failures, len(log_.sampled), len(ok))

    # ---------------------------------------------------------- evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.run_cfg.is_accl_round(server_round):
            return []
        view = NodeSubset(grid, [self.federation.node_of_partition[p]
                                 for p in sorted(self.federation.node_of_partition)])
        return super().configure_evaluate(server_round, arrays, config, view)  # type: ignore[misc]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = self._ordered(replies)
        self.client_errors.report(server_round, replies, " (evaluate)")
        # error replies are reported above, once per cause; Flower's FedAvg would
        # log each one's full reason again every ACCL round
        ok = [m for m in replies if not m.has_error()]
        metrics = super().aggregate_evaluate(server_round, ok)  # type: ignore[misc]
        if metrics is not None and "accl" in metrics:
            self.rounds.setdefault(server_round, RoundLog()).accl = float(metrics["accl"])
        elif ok and not self._told_no_accl:
            self._told_no_accl = True  # the clients' splits do not change
            log(WARNING, "round %s: no ACCL (accl stays empty): none of the %s clients that answered has a "
                "local test sample (a client's local test split is round(samples x local-test-fraction=%s)); "
                "raise local-test-fraction or give the clients more samples",
                server_round, len(ok), self.run_cfg.local_test_fraction)
        return metrics

    def reply_problem(self, reply: Message) -> str | None:
        """Why a training reply must not be aggregated, or None if it is sound.

        Checks what every algorithm's replies share: an ``arrays`` record with
        exactly the keys and shapes of the model that was sent, exactly the
        extra records :attr:`messages` declares, a metrics
        record with a positive ``num-examples``, and only finite numbers in
        every ArrayRecord. A malformed, oversized or NaN reply is rejected
        with a logged reason instead of corrupting the global model.
        """
        content = reply.content
        array_records = records_of(content, ArrayRecord)
        if MODEL_RECORD not in array_records:
            return f"no {MODEL_RECORD!r} record"
        extra = self.messages.records_problem(self.run_cfg.algo, "to_server", array_records.keys())
        if extra is not None:
            return extra
        arrays = array_records[MODEL_RECORD]
        sent = self.global_arrays
        if sent is not None and _layout(arrays) != self._sent_layout(sent):  # the usual case: one comparison
            if list(arrays.keys()) != list(sent.keys()):
                return f"array keys {sorted(arrays.keys())[:4]}... differ from the model's"
            for key, array in arrays.items():
                if tuple(array.shape) != tuple(sent[key].shape):
                    return f"array {key!r} has shape {tuple(array.shape)}, expected {tuple(sent[key].shape)}"
        for name, expected in self.extra_layouts().items():
            if name not in array_records:
                return f"no {name!r} record"
            problem = _layout_problem(name, _layout(array_records[name]), expected)
            if problem is not None:
                return problem
        metrics = next(iter(records_of(content, MetricRecord).values()), None)
        if metrics is None or "num-examples" not in metrics:
            return "no metrics record with 'num-examples'"
        if not float(metrics["num-examples"]) > 0:
            return f"num-examples={metrics['num-examples']}"
        for name, record in array_records.items():
            for key, array in record.items():
                if not all_finite(array):
                    return f"{NON_FINITE} {name}/{key}"
        return None

    def extra_layouts(self) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """The keys and shapes each extra record of a training reply must hold
        (hook; default: none checked): a reply whose extra record differs
        (a missing, unknown or reshaped entry) is rejected by
        :meth:`reply_problem` instead of broadcast into server state
        (SCAFFOLD's ``c``) or stopping the round (FedPM's mixing)."""
        return {}

    def _sent_layout(self, sent: ArrayRecord) -> list[tuple[str, tuple[int, ...]]]:
        """:func:`_layout` of the model sent this round, made once per round."""
        cached = getattr(self, "_sent_layout_of", None)
        if cached is None or cached[0] is not sent:
            cached = (sent, _layout(sent))
            self._sent_layout_of = cached
        return cached[1]

    # ------------------------------------------------------------- helpers
    def _keep_dtypes(self, arrays: ArrayRecord) -> ArrayRecord:
        """Cast the new global model back to the dtypes that were sent.

        Flower's FedOpt family computes with NumPy float64 scalars, which (NumPy
        2 promotion rules) turns a float32 model into float64 and doubles every
        later download. Clients train in the model's own dtype anyway.
        """
        sent = getattr(self, "_sent_dtypes", {})
        if all(sent.get(k, a.dtype) == a.dtype for k, a in arrays.items()):
            return arrays
        return ArrayRecord({
            k: from_numpy(to_numpy(a).astype(sent[k])) if k in sent and sent[k] != a.dtype else a
            for k, a in arrays.items()
        })

    def _ordered(self, replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by the sender's partition id (deterministic sums)."""
        pid = self.federation.partition_of_node
        return sorted(replies, key=lambda m: pid.get(m.metadata.src_node_id, -1))

    def summary(self) -> None:
        log(INFO, "\t├──> fedaccel: algo=%s, %s of %s clients per round, seeded sampling",
            self.run_cfg.algo, self.cohort_size, self.federation.num_clients)
        super().summary()  # type: ignore[misc]


def _layout(record: ArrayRecord) -> list[tuple[str, tuple[int, ...]]]:
    """A record's keys, in order, with each array's shape."""
    return [(key, tuple(array.shape)) for key, array in record.items()]


def _layout_problem(name: str, got: list[tuple[str, tuple[int, ...]]],
                    expected: list[tuple[str, tuple[int, ...]]]) -> str | None:
    """How record ``name``'s keys and shapes ``got`` differ from ``expected``
    (the first difference, in one line), or None."""
    have, want = dict(got), dict(expected)
    if have == want:
        return None
    for key, shape in expected:
        if key not in have:
            return f"{name} lacks {key!r}"
        if have[key] != shape:
            return f"{name}/{key} has shape {tuple(have[key])}, expected {tuple(shape)}"
    unknown = [key for key in have if key not in want]
    return f"{name} holds {unknown[0]!r}, which is not one of its {len(want)} entries"


def release_reply_arrays(replies: Iterable[Message]) -> None:
    """Drop every ArrayRecord from these messages' content (in place): what
    :meth:`FedAccelStrategy.aggregate_train` does with a round's training
    replies once it has used them. Metrics and configs stay."""
    for reply in replies:
        if reply.has_content():
            content = reply.content
            for key in [k for k, record in content.items() if isinstance(record, ArrayRecord)]:
                del content[key]


def messages_bytes(messages: Iterable[Message]) -> int:
    """The array payload of all ``messages``, each counted in full (what
    crosses the wire); a record that several messages share (the global
    model of a round) is measured once."""
    sizes: dict[int, tuple[ArrayRecord, int]] = {}  # id -> (the record, kept alive so its id stays its own; size)
    total = 0
    for message in messages:
        for record in records_of(message.content, ArrayRecord).values():
            if id(record) not in sizes:
                sizes[id(record)] = (record, payload_bytes(record))
            total += sizes[id(record)][1]
    return total


def _with_content(message: Message, records: dict[str, ArrayRecord], updates: dict[str, Any]) -> Message:
    """A copy of a training message with the extra ``records`` added (arrays
    shared, not copied) and its ConfigRecord's values ``updates`` applied,
    built as one new message.

    Flower's FedAvg gives every message the same RecordDict object, so a
    per-client value needs a new RecordDict.
    """
    content = dict(message.content.items())
    content.update(records)
    if updates:
        # content["config"], not content.config_records[...]: that builds a synced
        # view of every record (about 25 us a message)
        content["config"] = config_record({**dict(content["config"]), **updates})
    return Message(record_dict(content), message.metadata.dst_node_id, message.metadata.message_type)
