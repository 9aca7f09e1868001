"""fedaccel/clients/stacked_state.py: the fast runner's stacked client state
keeps exactly the state ContextState keeps, row by row."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from flwr.app import ConfigRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedaccel.checkpoint import record_dict_bytes, record_dict_from_bytes
from fedaccel.clients.stacked_state import StackedClientStates, StackedRowState, StackedStateRecord
from fedaccel.clients.state import ContextState, context_client_state, tensor_layout
from fedaccel.config import ConfigError

CPU = torch.device("cpu")
FLAT = OrderedDict([("w", torch.zeros(2, 3)), ("b", torch.zeros(2))])  # one dtype: a row of the slots
OTHER = OrderedDict([("w", torch.zeros(3, 2)), ("b", torch.zeros(2))])  # as many values, another layout (model)
MIXED = OrderedDict([("w", torch.zeros(2)), ("n", torch.zeros((), dtype=torch.int64))])  # its own tensors


def state_of(kind: str, value: float, flat: bool, like=None) -> OrderedDict[str, torch.Tensor]:
    like = like if like is not None else FLAT if flat else MIXED
    return OrderedDict((k, torch.full_like(v, value) + torch.arange(v.numel()).reshape(v.shape).to(v.dtype))
                       for k, v in like.items())


# one client's operations: (op, argument) on a store
OPS = st.lists(st.tuples(st.sampled_from(["resolve", "begin", "put", "put_flat", "put_other", "put_mixed", "seal"]),
                         st.integers(0, 6)), max_size=30)


def apply(store, ops) -> list:
    """Run ``ops`` on ``store``; what each returned or raised, and what it reads after."""
    seen = []
    for op, arg in ops:
        if op == "resolve":
            seen.append(store.resolve(arg if arg else None))
        elif op == "begin":
            store.begin(arg)
        elif op == "put":
            store.put("s", state_of("s", arg, flat=True))
        elif op == "put_flat":
            flat = torch.cat([v.reshape(-1) for v in state_of("s", 10 + arg, flat=True).values()])
            store.put_flat("s", flat, tensor_layout(FLAT))
        elif op == "put_other":  # the same name, another layout of as many values (whichever came first stacks)
            store.put("s", state_of("s", 20 + arg, flat=True, like=OTHER))
        elif op == "put_mixed":
            store.put("m", state_of("m", arg, flat=False))
        else:
            store.seal()
        got = store.get("s", CPU), store.get("m", CPU)
        seen.append((store.versions(), [None if g is None else [(k, tuple(v.shape), v.tolist()) for k, v in g.items()]
                                        for g in got]))
        for like in (FLAT, OTHER):  # the flat read: the values, or the one-line refusal of another layout
            try:
                flat = store.get_flat("s", tensor_layout(like), CPU)
            except ConfigError:
                seen.append("not this model's")
                continue
            seen.append(None if flat is None else flat.tolist())
            if flat is not None:  # a copy: editing it changes nothing kept
                flat.add_(1000)
                assert store.get_flat("s", tensor_layout(like), CPU).tolist() == seen[-1]
    return seen


@settings(max_examples=80, deadline=None)
@given(ops=OPS, neighbour=OPS)
def test_a_row_keeps_what_a_context_keeps(ops, neighbour):
    """Any sequence of protocol steps and writes: the row reads, resolves
    and tags exactly as ContextState does, another client's row beside it
    changes nothing, and its saved records are ContextState's (and load back)."""
    record = RecordDict()
    context = ContextState(record)
    store = StackedClientStates(3)
    other = StackedRowState(store, 0)
    row = StackedRowState(store, 2)
    apply(other, neighbour)  # before: slots already made and partly filled by another client
    assert apply(row, ops) == apply(context, ops)
    saved = store.record_dict(2)
    assert saved == record  # the same records, value for value
    assert record_dict_from_bytes(record_dict_bytes(saved)) == record
    # and back: another store loaded from those records reads the same
    again = StackedClientStates(3)
    again.load_record_dict(2, record_dict_from_bytes(record_dict_bytes(record)))
    assert again.record_dict(2) == record
    after = [("resolve", 0), ("begin", 7), ("put", 7), ("seal", 0)]  # the next round, from fresh views
    assert apply(StackedRowState(again, 2), after) == apply(ContextState(record), after)


def test_one_dtype_states_are_rows_of_slots_and_others_their_own_tensors():
    store = StackedClientStates(4)
    a, b = StackedRowState(store, 1), StackedRowState(store, 3)
    a.put("s", state_of("s", 1.0, flat=True))
    b.begin(5)
    b.put("s", state_of("s", 2.0, flat=True))
    b.seal()
    slots = store.names["s"]
    assert len(slots.slots) == 1 and tuple(slots.slots[0].shape) == (4, 8)
    assert slots.version[0].tolist() == [-1, 0, -1, 5]
    b.begin(6)  # a second version of client 3: a second slot
    b.put("s", state_of("s", 3.0, flat=True))
    assert len(slots.slots) == 2 and slots.version[1].tolist() == [-1, -1, -1, 6]
    assert torch.equal(b.get("s", CPU)["w"], state_of("s", 2.0, flat=True)["w"])  # latest is still 5 until sealed
    b.seal()
    assert torch.equal(b.get("s", CPU)["w"], state_of("s", 3.0, flat=True)["w"])
    a.put("m", state_of("m", 4.0, flat=False))
    assert "m" not in store.names and (0, "m") in store.loose[1]
    # what get returns is a copy
    got = a.get("s", CPU)
    got["w"].add_(100)
    assert torch.equal(a.get("s", CPU)["w"], state_of("s", 1.0, flat=True)["w"])
    # ... and get_flat of a state kept as its own single tensor (another layout than the name's)
    c = StackedRowState(store, 0)
    c.put("s", {"v": torch.arange(8.0)})
    assert (0, "s") in store.loose[0]
    flat = c.get_flat("s", tensor_layout({"v": torch.zeros(8)}), CPU)
    flat.add_(100)
    assert torch.equal(c.get_flat("s", tensor_layout({"v": torch.zeros(8)}), CPU), torch.arange(8.0))


def test_gather_latest_is_each_clients_get_flat():
    store = StackedClientStates(5)
    layout = tensor_layout(FLAT)
    rows = {p: StackedRowState(store, p) for p in range(5)}
    for p in (0, 2, 4):
        rows[p].begin(1)
        rows[p].put("s", state_of("s", p, flat=True))
        rows[p].seal()
    rows[2].resolve(1)
    rows[2].begin(2)
    rows[2].put("s", state_of("s", 20, flat=True))  # open: not the latest yet
    rows[4].resolve(0)  # rolled back: round 1's write is gone
    pids = [4, 2, 1, 0]
    gathered, found = store.gather_latest("s", pids, layout, CPU)
    assert found == [False, True, False, True]
    for c, p in enumerate(pids):
        each = rows[p].get_flat("s", layout, CPU)
        assert (each is None) == (not found[c])
        assert torch.equal(gathered[c], each if each is not None else torch.zeros(8))
    with pytest.raises(ConfigError, match="not this model's"):
        store.gather_latest("s", pids, (("w", "float32", (3, 3)),), CPU)
    rows[1].put("s", state_of("m", 1, flat=False))  # another layout: that client's own tensors
    assert store.gather_latest("s", pids, layout, CPU) is None
    assert store.gather_latest("none", pids, layout, CPU)[1] == [False] * 4


def test_a_context_record_opens_its_row_and_keeps_its_other_records():
    store = StackedClientStates(2)
    record = StackedStateRecord(store, 1)
    state = context_client_state(record)
    assert isinstance(state, StackedRowState) and state.pid == 1
    state.put("s", state_of("s", 1.0, flat=True))
    assert len(record) == 0  # the state is in the store, not in the RecordDict
    record["mine"] = ConfigRecord({"k": 1})
    saved = record.saved()
    assert set(saved) == {"fedaccel.v0.s", "fedaccel.v0.s.layout", "mine"}
    fresh = StackedStateRecord(StackedClientStates(2), 1)
    fresh.restore(saved)
    assert list(fresh) == ["mine"]
    assert torch.equal(context_client_state(fresh).get("s", CPU)["w"], state_of("s", 1.0, flat=True)["w"])
    # a plain RecordDict is ContextState, as before
    assert isinstance(context_client_state(RecordDict()), ContextState)
    # restoring nothing clears a client (its tags included, its own records gone) and leaves the others
    other = StackedRowState(store, 0)
    other.put("s", state_of("s", 2.0, flat=True))
    state.resolve(0)
    state.begin(1)
    state.put("s", state_of("s", 3.0, flat=True))
    state.seal()
    assert state.versions() == (0, 1) and store.tagged.tolist() == [False, True]
    record.restore(RecordDict())
    assert state.get("s", CPU) is None and state.versions() == (0, 0) and len(record) == 0
    assert other.get("s", CPU) is not None
    assert store.tagged.tolist() == [False, False] and store.versions(1) == set()


def test_the_fast_runners_restore_clears_every_client_then_loads_the_saved_ones(tmp_path):
    """A checkpoint's client state replaces all of it: a client without a
    file in the checkpoint has no state afterwards."""
    from fedaccel.apps.client_app import app as client_app
    from fedaccel.local_grid import LocalGrid

    grid = LocalGrid(client_app, {}, num_clients=3)
    rows = {int(c.node_config["partition-id"]): context_client_state(c.state) for c in grid.contexts.values()}
    for pid in (0, 2):
        rows[pid].put("s", state_of("s", pid, flat=True))
    files = grid.client_state_files()
    assert sorted(files) == ["context/0.pb", "context/2.pb"]
    rows[1].put("s", state_of("s", 9, flat=True))
    del files["context/2.pb"]
    grid.restore_client_state_files(files)
    assert rows[0].get("s", CPU) is not None and rows[1].get("s", CPU) is None and rows[2].get("s", CPU) is None


def test_a_cohort_is_gathered_only_from_one_store_and_its_own_layout():
    from fedaccel.clients.stacked_state import gathered_rows

    store, elsewhere = StackedClientStates(3), StackedClientStates(3)
    states = [StackedRowState(store, p) for p in range(3)]
    for state in states[:2]:
        state.put("s", state_of("s", 1, flat=True))
    layout = tensor_layout(FLAT)
    stack, has = gathered_rows(states, "s", layout, CPU)
    assert has == [True, True, False] and not stack[2].any()
    assert all(torch.equal(g, s.get_flat("s", layout, CPU)) for g, s in zip(stack[:2], states))
    assert gathered_rows(states[:2] + [StackedRowState(elsewhere, 2)], "s", layout, CPU) is None
    assert gathered_rows(states[:2] + [ContextState(RecordDict())], "s", layout, CPU) is None
    # another model's state: no gather; each client's own read refuses it in one line
    assert gathered_rows(states, "s", tensor_layout(OTHER), CPU) is None
    with pytest.raises(ConfigError, match="not this model's"):
        states[0].get_flat("s", tensor_layout(OTHER), CPU)


def test_a_write_that_fails_leaves_the_row_as_it_was():
    store = StackedClientStates(2)
    row, context = StackedRowState(store, 1), ContextState(RecordDict())
    for state in (row, context):
        state.put("s", state_of("s", 1, flat=True))
        state.resolve(0)
        state.begin(1)
        with pytest.raises(Exception):
            state.put("s", OrderedDict([("w", torch.empty(2, 3, device="meta")), ("b", torch.empty(2, device="meta"))]))
        state.seal()
    assert row.versions() == context.versions() and store.versions(1) == {0}
    assert row.get("s", CPU) is None and context.get("s", CPU) is None  # round 1 wrote nothing
    assert torch.equal(row.read_version(0, "s", CPU)["w"], context.read_version(0, "s", CPU)["w"])


def test_without_memory_for_a_slot_the_state_is_kept_as_its_own_tensors(monkeypatch):
    """All clients' rows are allocated at once (mapped as written); when even
    that cannot be had, a client's state is kept as its own tensors and reads
    the same, in the slots' row order for the cohort (gather falls back)."""
    import fedaccel.clients.stacked_state as module

    made = []

    def one_slot_only(rows, size, dtype):
        if made:
            raise RuntimeError("out of memory")
        made.append(rows)
        return torch.zeros(rows, size, dtype=dtype)

    monkeypatch.setattr(module, "new_slot", one_slot_only)
    store = StackedClientStates(2)
    record, row = RecordDict(), StackedRowState(store, 1)
    context = ContextState(record)
    layout = tensor_layout(FLAT)
    first = [("put", 1), ("resolve", 0), ("begin", 2), ("put_flat", 2), ("seal", 0)]
    assert apply(row, first) == apply(context, first)
    # round 2 needed a second slot: its own tensors, which a cohort's gather leaves to each client
    assert len(store.names["s"].slots) == 1 and list(store.loose[1]) == [(2, "s")]
    assert store.gather_latest("s", [0, 1], layout, CPU) is None
    then = [("resolve", 2), ("begin", 3), ("put", 3), ("seal", 0)]
    assert apply(row, then) == apply(context, then)
    assert store.names["s"].version[0].tolist() == [-1, 3]  # round 0's row was dropped at the commit: free again
    assert store.record_dict(1) == record
    gathered, found = store.gather_latest("s", [0, 1], layout, CPU)
    assert found == [False, True] and torch.equal(gathered[1], row.get_flat("s", layout, CPU))
