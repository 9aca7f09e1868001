"""Every client's state of a fast-runner run, stacked: one tensor per state name and version slot.

The fast runner (``fedaccel-run``) holds every client's
:class:`~flwr.app.Context` in one process. With ``client-state='context'``
its contexts keep their state here instead of in one RecordDict per client:
per state name (FedCDR's ``dr``, SCAFFOLD's ``scaffold``...), a few version
slots ``[N, D]`` whose row ``p`` is client ``p``'s flat state (a version
tagged with the round that wrote it, or empty), and the two tags of every
client in one array. A client's state is then a row to read or write,
not a Flower ArrayRecord and ConfigRecord to build, look up and delete per
client, state name and version (about 44 us a client and round on the
60-32-10 MLP), and the cohort trainer reads a whole cohort's rows at once
(:meth:`StackedClientStates.gather_latest`).

The commit protocol is :class:`~fedaccel.clients.state.VersionedState`'s,
unchanged: :class:`StackedRowState` only stores its versions and tags. The
state is owned by the Context as before: a Context whose ``state`` is a
:class:`StackedStateRecord` reads and writes its row; a Context given a new
``state`` (a SuperNode restarted, in tests) has lost it. Saved (checkpoint
files) and restored, a client's state is the RecordDict
:class:`~fedaccel.clients.state.ContextState` writes, record for record, so
checkpoints move between the two.

Written by hand: Flower keeps one RecordDict per Context.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fedaccel.arrays import records_of
from fedaccel.clients.state import (ContextState, Layout, VersionedState, _check_layout, flat_groups, flat_size,
                                    split_plan, tensor_layout, unflatten)
from fedaccel.config import ConfigError

EMPTY = -1  # a slot row that holds no version


class _Slots:
    """The versions of one state name: ``slots[s][p]`` holds client ``p``'s
    version ``version[s][p]`` (EMPTY: none), all of one layout."""

    def __init__(self, layout: Layout, dtype: torch.dtype) -> None:
        self.layout, self.dtype = layout, dtype
        self.slots: list[torch.Tensor] = []
        self.version: list[np.ndarray] = []
        self.out_of_memory = False  # a new slot could not be had: not tried again

    def find(self, pid: int, version: int) -> int | None:
        for s, held in enumerate(self.version):
            if held[pid] == version:
                return s
        return None

    def free(self, pid: int, num_clients: int) -> int | None:
        """A slot whose row ``pid`` is empty (a new slot if none is; None
        if no memory could be had for one)."""
        s = self.find(pid, EMPTY)
        if s is None:
            if self.out_of_memory:
                return None
            try:
                slot = new_slot(num_clients, flat_size(self.layout), self.dtype)
            except RuntimeError:  # out of memory for all clients' rows: such states stay their own tensors
                self.out_of_memory = True
                return None
            self.slots.append(slot)
            self.version.append(np.full(num_clients, EMPTY, dtype=np.int64))
            s = len(self.slots) - 1
        return s


def new_slot(rows: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Room for every client's row, not filled: a large allocation is mapped
    by the kernel page by page as rows are written, so a slot costs about
    what its written rows hold (zeros would write all of it at once). A
    row is read only once a version tag names it, i.e. after it was written."""
    return torch.empty(rows, size, dtype=dtype)


class StackedClientStates:
    """The versioned state of clients ``0..num_clients-1`` (partition ids).

    A state whose tensors are of one dtype is a row of its name's slots; one
    of mixed dtypes, or of another layout than the name's first (another
    model), is kept as its own tensors (``loose``), which reads the same."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.tags = np.zeros((num_clients, 2), dtype=np.int64)  # committed, latest
        self.tagged = np.zeros(num_clients, dtype=bool)  # tags saved at least once (ContextState's record exists)
        self.names: dict[str, _Slots] = {}
        self.loose: dict[int, dict[tuple[int, str], OrderedDict[str, torch.Tensor]]] = {}

    # ------------------------------------------------------------ one client
    def read(self, pid: int, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        slots = self.names.get(name)
        s = slots.find(pid, version) if slots is not None else None
        if s is not None:
            return unflatten(slots.slots[s][pid].to(device, copy=True), slots.layout)
        held = self.loose.get(pid, {}).get((version, name))
        return None if held is None else OrderedDict((k, v.to(device, copy=True)) for k, v in held.items())

    def read_flat(self, pid: int, version: int, name: str, layout: Layout,
                  device: torch.device) -> torch.Tensor | None:
        slots = self.names.get(name)
        s = slots.find(pid, version) if slots is not None else None
        if s is not None:
            if slots.layout is not layout:
                _check_layout(slots.layout, layout, name)
            return slots.slots[s][pid].to(device, copy=True)
        held = self.loose.get(pid, {}).get((version, name))
        if held is None:
            return None
        _check_layout(tensor_layout(held), layout, name)
        return torch.cat([t.reshape(-1) for t in held.values()]).to(device)

    def write(self, pid: int, version: int, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        layout = tensor_layout(tensors)
        slots = self._slots_for(name, layout)
        if slots is not None and self._write_row(slots, pid, version, name, lambda: torch.cat(
                [v.detach().reshape(-1).to("cpu") for v in tensors.values()])):
            return
        held = OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in tensors.items())
        self._forget(pid, version, name)
        self.loose.setdefault(pid, {})[(version, name)] = held

    def write_flat(self, pid: int, version: int, name: str, flat: torch.Tensor, layout: Layout) -> None:
        slots = self._slots_for(name, layout)
        if slots is None or not self._write_row(slots, pid, version, name, lambda: flat.detach().to("cpu")):
            self.write(pid, version, name, unflatten(flat.detach().cpu(), layout))

    def drop(self, pid: int, version: int) -> None:
        for slots in self.names.values():
            for held in slots.version:
                if held[pid] == version:
                    held[pid] = EMPTY
        loose = self.loose.get(pid)
        if loose:
            for key in [key for key in loose if key[0] == version]:
                del loose[key]

    def versions(self, pid: int) -> set[int]:
        found = {int(held[pid]) for slots in self.names.values() for held in slots.version if held[pid] != EMPTY}
        found.update(version for version, _ in self.loose.get(pid, {}))
        return found

    def clear(self, pid: int) -> None:
        """Client ``pid`` without any state (as a fresh Context)."""
        for version in self.versions(pid):
            self.drop(pid, version)
        self.loose.pop(pid, None)
        self.tags[pid] = 0
        self.tagged[pid] = False

    # ------------------------------------------------------------ a cohort
    def gather_latest(self, name: str, pids: list[int], layout: Layout,
                      device: torch.device) -> tuple[torch.Tensor, list[bool]] | None:
        """Every client's latest version of ``name`` (what :meth:`StackedRowState.get_flat`
        reads) as the rows of one new ``[C, D]`` tensor, and which clients have
        one (a row of a client without one is zeros). None when one of them
        holds it as its own tensors (then read each client's)."""
        slots = self.names.get(name)
        if self.loose and any((latest, name) in self.loose.get(pid, {})
                              for pid, latest in zip(pids, self.tags[pids, 1].tolist())):
            return None
        if slots is None:  # nobody has saved one yet
            return (torch.zeros(len(pids), flat_size(layout), dtype=getattr(torch, layout[0][1]), device=device),
                    [False] * len(pids))
        if slots.layout is not layout:
            _check_layout(slots.layout, layout, name)
        index = np.asarray(pids, dtype=np.int64)
        latest = self.tags[index, 1]
        out = torch.zeros(len(pids), flat_size(layout), dtype=slots.dtype)
        found = np.zeros(len(pids), dtype=bool)
        for stack, held in zip(slots.slots, slots.version):
            hit = np.flatnonzero(held[index] == latest)
            if len(hit):
                found[hit] = True
                out[torch.from_numpy(hit)] = stack[torch.from_numpy(index[hit])]
        return out.to(device), found.tolist()

    # ------------------------------------------------- as ContextState's records
    def record_dict(self, pid: int) -> RecordDict:
        """Client ``pid``'s state as the records :class:`ContextState` keeps
        (written through it, so the same records)."""
        record = RecordDict()
        store = ContextState(record)
        for version in sorted(self.versions(pid)):
            for name, slots in self.names.items():
                s = slots.find(pid, version)
                if s is not None:
                    store._write_flat(version, name, slots.slots[s][pid].clone(), slots.layout)
            for (held_version, name), tensors in self.loose.get(pid, {}).items():
                if held_version == version:
                    store._write(version, name, tensors)
        if self.tagged[pid]:
            store._save_tags(*(int(t) for t in self.tags[pid]))
        return record

    def load_record_dict(self, pid: int, record: RecordDict) -> RecordDict:
        """Client ``pid``'s state from :class:`ContextState`'s records in
        ``record`` (replacing any); returns ``record``'s other records."""
        self.clear(pid)
        store, cpu = ContextState(record), torch.device("cpu")
        mine = [k for k in records_of(record, ArrayRecord) if k.startswith("fedaccel.v")]
        for key in mine:
            version, name = key.removeprefix("fedaccel.v").split(".", 1)
            tensors = store._read(int(version), name, cpu)
            if tensors is not None:
                self.write(pid, int(version), name, tensors)
        if ContextState.TAGS in record:
            self.tags[pid] = store._tags()
            self.tagged[pid] = True
        ours = set(mine) | {f"{k}.layout" for k in mine} | {ContextState.TAGS}
        return RecordDict({k: v for k, v in record.items() if k not in ours})

    # ------------------------------------------------------------ helpers
    def _slots_for(self, name: str, layout: Layout) -> _Slots | None:
        """The slots a state of ``layout`` goes to, made for the name's first
        state of one dtype; None: kept as its own tensors."""
        slots = self.names.get(name)
        if slots is None:
            dtypes = {dtype for _, dtype, _ in layout}
            if len(dtypes) != 1:
                return None
            slots = self.names[name] = _Slots(layout, getattr(torch, dtypes.pop()))
        return slots if slots.layout is layout or slots.layout == layout else None

    def _write_row(self, slots: _Slots, pid: int, version: int, name: str, values) -> bool:
        """Client ``pid``'s ``version`` of ``name`` into a row of ``slots``:
        ``values()`` (the flat values on the CPU) made first, so that an
        error leaves the store as it was; False when no slot could be made."""
        src = values()
        s = slots.find(pid, version)
        if s is None:
            s = slots.free(pid, self.num_clients)
            if s is None:
                return False
        slots.slots[s][pid].copy_(src)
        if slots.version[s][pid] != version:  # tagged once its values are in
            loose = self.loose.get(pid)
            if loose:
                loose.pop((version, name), None)
            slots.version[s][pid] = version
        return True

    def _forget(self, pid: int, version: int, name: str) -> None:
        slots = self.names.get(name)
        s = slots.find(pid, version) if slots is not None else None
        if s is not None:
            slots.version[s][pid] = EMPTY


class StackedRowState(VersionedState):
    """One client's state in a :class:`StackedClientStates`: the commit
    protocol of :class:`VersionedState` over its row."""

    def __init__(self, store: StackedClientStates, partition_id: int) -> None:
        self.store, self.pid = store, partition_id

    def _read(self, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        return self.store.read(self.pid, version, name, device)

    def _write(self, version: int, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        self.store.write(self.pid, version, name, tensors)

    def _read_flat(self, version: int, name: str, layout: Layout, device: torch.device) -> torch.Tensor | None:
        return self.store.read_flat(self.pid, version, name, layout, device)

    def _write_flat(self, version: int, name: str, flat: torch.Tensor, layout: Layout) -> None:
        self.store.write_flat(self.pid, version, name, flat, layout)

    def _drop(self, version: int) -> None:
        self.store.drop(self.pid, version)

    def _versions(self) -> set[int]:
        return self.store.versions(self.pid)

    def _tags(self) -> tuple[int, int]:
        committed, latest = self.store.tags[self.pid].tolist()
        return committed, latest

    def _save_tags(self, committed: int, latest: int) -> None:
        self.store.tags[self.pid] = (committed, latest)
        self.store.tagged[self.pid] = True


def gathered_groups(states: list, name: str, groups: tuple[str, ...], params: Mapping[str, torch.Tensor],
                    device: torch.device) -> dict[str, list[torch.Tensor]] | None:
    """The cohort's saved ``name`` made of model-shaped ``groups`` (what
    ``state.put(name, flat_groups({group: tensors like params}))`` stores;
    zeros for a client without one, as :func:`groups_or_zeros` reads it), as
    one ``[C, *shape]`` view per group and parameter of one gather; None as
    :func:`gathered_rows`."""
    layout = tensor_layout(flat_groups({g: params for g in groups}))
    found = gathered_rows(states, name, layout, device)
    if found is None:
        return None
    stack = found[0]
    _, sizes, shapes = split_plan(layout)
    pieces = [piece.view(len(states), *shape) for piece, shape in zip(torch.split(stack, sizes, dim=1), shapes)]
    n = len(params)
    return {g: pieces[i * n:(i + 1) * n] for i, g in enumerate(groups)}


def select_rows(blocks: list[torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    """Rows ``rows`` of every ``[C, ...]`` block, in that order: the blocks
    themselves when ``rows`` is all of theirs in order (no copy)."""
    if not blocks or rows == list(range(len(blocks[0]))):
        return list(blocks)
    index = torch.tensor(rows, dtype=torch.long, device=blocks[0].device)
    return [block.index_select(0, index) for block in blocks]


def begun_rows(openings: list, begun: list) -> list[int]:
    """The openings whose begin succeeded (their indices, in order), each
    one's solver given ``_row``: its position among them, so its row of the
    cohort's stacks once they are narrowed to them (:func:`select_rows`)."""
    ok = [k for k, b in enumerate(begun) if not isinstance(b, BaseException)]
    for row, k in enumerate(ok):
        openings[k].solver._row = row
    return ok


def member_rows(members: list, groups: tuple[str, ...]) -> dict[str, list[torch.Tensor]] | None:
    """The members' rows of the cohort's stacks (each solver's ``_rows_of``,
    a dict of ``[C, ...]`` blocks per group, and its ``_row``) for ``groups``,
    in the members' order; None unless every member's are rows of the same
    stacks (then each member's own tensors)."""
    solvers = [m.solver for m in members]
    stacks = getattr(solvers[0], "_rows_of", None)
    if stacks is None or any(getattr(s, "_rows_of", None) is not stacks for s in solvers):
        return None
    rows = [s._row for s in solvers]
    return {g: select_rows(stacks[g], rows) for g in groups}


def gathered_rows(states: list, name: str, layout: Layout, device: torch.device) -> tuple[torch.Tensor, list[bool]] | None:
    """Every client's latest ``name`` (what ``state.get_flat(name, layout,
    device)`` reads) as the rows of one ``[C, D]`` stack, read for all of
    them in one gather, and which clients had one (the others' rows are
    zeros: what a state that starts at zero, SCAFFOLD's ``c_i``, begins
    from). None when the states are not all rows of one
    :class:`StackedClientStates` (the fast runner's), when one client's is
    kept as its own tensors, or when the saved state is another model's
    (then each client reads its own, and reports its own error)."""
    first = getattr(states[0], "store", None) if states else None
    if not isinstance(first, StackedClientStates) or any(
            not isinstance(state, StackedRowState) or state.store is not first for state in states):
        return None
    try:
        return first.gather_latest(name, [state.pid for state in states], layout, device)
    except ConfigError:
        return None


class StackedStateRecord(RecordDict):
    """A Context's ``state`` whose client state lives in row ``partition_id``
    of ``store`` (:func:`fedaccel.clients.state.context_client_state` opens
    it as a :class:`StackedRowState`). Otherwise an ordinary RecordDict:
    what else is put in it stays in it."""

    def __init__(self, store: StackedClientStates, partition_id: int) -> None:
        super().__init__()
        self.__dict__["_stacked_row"] = (store, partition_id)

    def stacked_client_state(self) -> StackedRowState:
        return StackedRowState(*self.__dict__["_stacked_row"])

    def saved(self) -> RecordDict:
        """Everything this Context's state holds, as one plain RecordDict:
        its own records and its client state as :class:`ContextState`'s."""
        store, pid = self.__dict__["_stacked_row"]
        out = store.record_dict(pid)
        for key, record in self.items():
            out[key] = record
        return out

    def restore(self, record: RecordDict) -> None:
        """Replace everything with what :meth:`saved` gave."""
        store, pid = self.__dict__["_stacked_row"]
        for key in list(self.keys()):
            del self[key]
        for key, value in store.load_record_dict(pid, record).items():
            self[key] = value
