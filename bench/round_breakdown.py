"""Where a batched round of the fast runner goes, piece by piece, timed.

Runs the fast runner in this process, on the run ``bench/overhead.py``
times as its ``cohort`` mode (the Synthetic MLP, one local epoch), with a
wall-clock timer around each piece of a round (the strategy's ``configure_train`` and ``aggregate_train``,
the cohort handler ``train_cohort`` and its batched steps ``train_stacked``,
each client's ``open_round``, ``close_round`` and reply message) and prints,
per piece, its mean milliseconds per round from round 3 on (round 0's
evaluation and rounds 1 and 2 pay for imports and first calls, and are
left out) and how often it ran, and how many minor page faults a round
took (memory the allocator gave back to the system and a later
allocation faulted in again: about 2 us each, where a round's fresh
tensor of a few MB is not served from the heap)::

    python bench/round_breakdown.py scaffold          # 100 clients, all of them every round
    python bench/round_breakdown.py fedavg --rounds 60 --clients 100 --per-round 100
    python bench/round_breakdown.py fedpm --also fedaccel.clients.foof:stacked_foof \
        fedaccel.clients.fedpm:FedPMSolver.gradient_transform

``--also MODULE:NAME`` (or ``MODULE:CLASS.METHOD``) times one more piece:
a function is timed where it is looked up as the module's attribute (a
caller that imported it by name keeps the untimed one), a method on that
class and its subclasses.

The pieces nest (``train_cohort`` holds ``train_stacked`` and the
per-client pieces), so they do not add up to the round. The timers cost
about a microsecond a call; ``bench/overhead.py --profile`` gives cProfile's
view instead (inflated by the profiler), ``--modes no-steps`` the round
without its steps. Written by hand: a profiler samples or instruments
every call, this times only the pieces named here.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for folder in (ROOT, BENCH):  # fedaccel, and overhead.py's run config beside this script
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# Experiment.on_round_end runs after round 0's evaluation and after every
# round: its 3rd call ends round 2, from which the pieces are counted (the
# first rounds pay for imports and first calls)
SKIPPED_ROUNDS = 3


def timed_pieces() -> list[tuple[Any, str, str]]:
    """``(owner, attribute, label)`` of every timed piece."""
    import fedaccel.apps.client_app as client_app
    import fedaccel.clients.base as solver_base
    import fedaccel.clients.cohort as cohort
    import fedaccel.strategies.base as strategy_base

    return [
        (strategy_base.FedAccelStrategy, "configure_train", "server: the round's messages (configure_train)"),
        (strategy_base.FedAccelStrategy, "aggregate_train", "server: reply checks, means, steps (aggregate_train)"),
        (client_app, "train_cohort", "clients: the whole batched round (train_cohort)"),
        (cohort, "train_stacked", "clients: the batched steps (train_stacked)"),
        (solver_base.LocalSolver, "open_round", "clients: each one's open_round"),
        (solver_base.LocalSolver, "close_round", "clients: each one's close_round"),
        (client_app, "_train_reply", "clients: each one's reply message"),
    ]


def extra_piece(spec: str) -> tuple[Any, str, str]:
    """``(owner, attribute, label)`` of ``--also``'s ``MODULE:NAME`` or
    ``MODULE:CLASS.METHOD``; ValueError with the reason when it names no
    function or method."""
    import importlib

    module_name, _, path = spec.partition(":")
    if not module_name or not path or path.count(".") > 1:
        raise ValueError(f"--also {spec}: expected MODULE:FUNCTION or MODULE:CLASS.METHOD")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--also {spec}: cannot import {module_name} ({err})") from None
    *klass, name = path.split(".")
    if klass:
        owner = getattr(owner, klass[0], None)
        if not isinstance(owner, type):
            raise ValueError(f"--also {spec}: {module_name} has no class {klass[0]}")
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"--also {spec}: {path} is not a function or method of {module_name}")
    if isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name), (staticmethod, classmethod)):
        raise ValueError(f"--also {spec}: static and class methods are not timed; name a function or method")
    return owner, name, spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="round_breakdown.py", description=__doc__.split("\n\n")[0])
    p.add_argument("algo")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--results-dir", default=None, help="where the run's files go (default: a temporary folder)")
    p.add_argument("--also", nargs="+", default=[], metavar="MODULE:NAME",
                   help="more pieces to time: a function (fedaccel.clients.foof:stacked_foof) "
                        "or a method (fedaccel.clients.fedpm:FedPMSolver.gradient_transform)")
    args = p.parse_args(argv)
    if args.rounds < SKIPPED_ROUNDS:
        p.error(f"--rounds must be at least {SKIPPED_ROUNDS}: rounds 1 and 2 are not counted")

    import fedaccel.experiment as experiment
    from fedaccel.config import ConfigError
    from fedaccel.local_run import default_run_config, fuse, run_local
    from overhead import overrides

    total: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()

    def timer(original: Callable, label: str) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                total[label] += time.perf_counter() - start
                calls[label] += 1
        return timed

    try:
        pieces = timed_pieces() + [extra_piece(spec) for spec in args.also]
    except ValueError as err:
        p.error(str(err))
    if len({(id(owner), name) for owner, name, _ in pieces}) < len(pieces):
        p.error("--also: a piece is named twice")
    # (owner, name, what it held itself: None for a method it inherits, removed again afterwards)
    originals = [(owner, name, (owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)))
                 for owner, name, _ in pieces]
    ends: list[float] = []
    faults: list[int] = []  # the process's minor page faults so far, at each round's end
    on_round_end = experiment.Experiment.on_round_end

    def round_end(*a: Any, **k: Any) -> Any:
        ends.append(time.perf_counter())
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if len(ends) == SKIPPED_ROUNDS:  # count from here
            total.clear()
            calls.clear()
        return on_round_end(*a, **k)

    scratch = tempfile.TemporaryDirectory(prefix="fedaccel-round-breakdown-")
    # the run bench/overhead.py times as its `cohort` mode on the Synthetic MLP
    cfg = fuse(default_run_config(), overrides(
        "mlp-synthetic", args.algo, args.rounds, args.clients, Path(args.results_dir or scratch.name),
        f"breakdown-{args.algo}", args.per_round, "cohort"))
    try:  # the timers are in place for this run only
        for owner, name, label in pieces:
            setattr(owner, name, timer(getattr(owner, name), label))
        experiment.Experiment.on_round_end = round_end
        run_local(cfg, args.clients, quiet=True)
    except ConfigError as err:  # an unknown algorithm, a run that cannot be batched: one line
        p.error(str(err))
    finally:
        for owner, name, original in reversed(originals):
            if original is None:  # an inherited method: the class holds none of its own again
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        experiment.Experiment.on_round_end = on_round_end
        scratch.cleanup()
    counted = len(ends) - SKIPPED_ROUNDS
    rounds = [b - a for a, b in zip(ends[SKIPPED_ROUNDS - 1:], ends[SKIPPED_ROUNDS:])]
    faulted = [b - a for a, b in zip(faults[SKIPPED_ROUNDS - 1:], faults[SKIPPED_ROUNDS:])]
    print(f"# {args.algo}: {args.per_round} of {args.clients} clients a round, batched, the last {counted} "
          f"rounds: {1e3 * statistics.median(rounds):.1f} ms a round (median; mean "
          f"{1e3 * statistics.mean(rounds):.1f} ms, the last round's evaluation included); "
          f"{statistics.median(faulted):.0f} minor page faults a round (median)")
    print("| piece | ms per round | calls per round |")
    print("|---|---:|---:|")
    for _, _, label in pieces:
        print(f"| {label} | {1e3 * total[label] / counted:.2f} | {calls[label] / counted:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
