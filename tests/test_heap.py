"""The collector settings around the rounds (fedaccel/heap.py)."""

from __future__ import annotations

import gc
import threading
import weakref

from fedaccel.heap import YOUNG_THRESHOLD, quiet_collector


class Node:
    def __init__(self) -> None:
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_sets_and_restores_the_collector():
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    with quiet_collector():
        assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
        assert gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() > frozen_before
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_restores_after_an_exception():
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    try:
        with quiet_collector():
            raise RuntimeError("a failing round")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen_before


def test_cycles_made_inside_are_collected_and_frozen_ones_after():
    garbage = Node()
    garbage_ref = weakref.ref(garbage)
    del garbage  # garbage before the rounds: frozen with the rest, freed after them
    kept = Node()
    kept_ref = weakref.ref(kept)
    with quiet_collector():
        new = Node()
        new_ref = weakref.ref(new)
        del new, kept  # both garbage now
        gc.collect()
        assert new_ref() is None  # made during the rounds: collected
        assert kept_ref() is not None and garbage_ref() is not None  # frozen: not walked
    gc.collect()
    assert kept_ref() is None and garbage_ref() is None  # unfrozen on exit: collected


def test_nested_and_concurrent_blocks_act_once():
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    inside = threading.Event()
    leave = threading.Event()

    def other_experiment():
        with quiet_collector():
            inside.set()
            leave.wait(timeout=30)

    with quiet_collector():
        worker = threading.Thread(target=other_experiment)
        worker.start()
        assert inside.wait(timeout=30)
        with quiet_collector():
            pass
        assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)  # the inner exit restored nothing
    assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)  # the thread's block is still open
    assert gc.get_freeze_count() > 0
    leave.set()
    worker.join(timeout=30)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen_before


def test_a_program_that_froze_objects_itself_keeps_them_frozen():
    """A program that froze objects itself (``gc.freeze()`` before a fork)
    finds them frozen after the rounds: only the threshold is raised."""
    before = gc.get_threshold()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        junk = [Node() for _ in range(100)]  # young objects a freeze would take in
        with quiet_collector():
            assert gc.get_freeze_count() <= frozen  # (frozen objects can still be freed by refcount)
            assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
        assert 0 < gc.get_freeze_count() <= frozen  # still frozen: not unfrozen on exit
        assert gc.get_threshold() == before
        del junk
    finally:
        gc.unfreeze()
