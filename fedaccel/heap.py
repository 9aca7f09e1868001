"""Python's cyclic garbage collector, kept out of the rounds' way.

A round of small models allocates many short-lived Python objects (Flower
messages and records, dicts of metrics, tensor views), and CPython's
collector runs a collection of the youngest generation every 700
allocations, of all generations every 100 or so of those. A collection of
all generations walks every tracked object of the process: after importing
torch, Flower and NumPy and building a run, about 200,000 of them, 56 ms a
collection on the 2-core machine the benchmarks ran on. On the fast runner
at 100 clients per round (MLP 60-32-10, 30 rounds, no local steps) the
collector's callbacks added up to 0.28 s for the full collections and 0.10
s for the younger ones, about a seventh of the run (``docs/cohort-batching-measurements.md``).

:func:`quiet_collector` is the standard answer (``gc.freeze``): objects
that exist when the rounds start (modules, the dataset, the model) move to
a permanent generation no collection walks, and the youngest generation is collected every
:data:`YOUNG_THRESHOLD` allocations instead of 700. Nothing is disabled:
cycles made during the rounds are still collected. What was already
cyclic garbage when the rounds started (in a process that ran an
experiment before) is frozen with the rest and freed after they end, not
during them: a full collection first would free it at once, but costs
what the freeze saves (about 0.2 s a run in a test process with a large
heap: 25 s more for 174 runs). On exit both settings are put back (``gc.unfreeze`` returns the frozen objects to the oldest
generation), so a caller that runs many experiments in one process (the
tests, a notebook) keeps the collector it had; a program that froze objects
itself before (``gc.freeze`` before a fork) keeps them frozen, and only the
threshold is raised. Nested or concurrent blocks (experiments in threads
of one process) act once: the first to enter sets,
the last to leave restores.
Written by hand: a few lines of the standard library, no package offers them.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

#: allocations between two collections of the youngest generation while
#: rounds run (CPython's default is 700)
YOUNG_THRESHOLD = 20_000

_lock = threading.Lock()
_depth = 0  # blocks open now
_saved: tuple[int, ...] = ()  # the thresholds before the first one
_froze = False  # whether the first one froze (not when the program had frozen objects itself)


@contextmanager
def quiet_collector() -> Iterator[None]:
    """Freeze the objects alive now and collect the young generation less
    often, for the duration of the ``with`` block; then restore both."""
    global _depth, _saved, _froze
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            # a program that froze objects itself (before a fork) keeps them as it
            # froze them: unfreezing on exit would undo that
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
            gc.set_threshold(max(_saved[0], YOUNG_THRESHOLD), *_saved[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)
                if _froze:
                    gc.unfreeze()
