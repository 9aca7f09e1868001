"""Per-client tensors that persist across rounds (FedCDR's y/x/xhat, SCAFFOLD's c_i...).

One interface, two places to keep the tensors:

- ``context``: in Flower's ``context.state`` (a RecordDict of ArrayRecords).
  Works everywhere Flower keeps a Context: the Ray simulation (in the
  simulation process; the whole Context travels to the Ray worker and back
  with every message), real SuperNodes (in the SuperNode process, lost when it
  restarts) and the fast runner (in memory; there every client's state is a
  row of one stacked store per run, ``fedaccel/clients/stacked_state.py``,
  which a checkpoint saves as these same records).
- ``disk``: one ``.npz`` file per client and state name under
  ``state-dir/<run id>/<partition id>/``. Only participants' files are read
  or written, memory stays flat however many clients there are, Ray messages
  stay small, and on a real device the state survives a SuperNode restart.

Both keep *versions* (:class:`VersionedState`): what a client writes in a
round is pending until the server's next message says the reply of that
round was applied, and is rolled back otherwise, so client and server state
agree after a lost, late or rejected reply (docs/client-state.md).

``client-state='auto'`` picks ``disk`` when all clients' state together would
exceed :data:`AUTO_DISK_BYTES`, else ``context``. Memory cost per client is
``copies x model bytes`` per version, and a client that trained keeps two
versions (committed and pending) until its next round (FedCDR: 3 copies; MNIST
MLP 784-128-10: 2 x 3 x 407 KB = 2.4 MB, so 10,000 clients = 24 GB at most in
``context`` mode).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, RecordDict

from fedaccel.arrays import arrays_to_record, config_record, from_tensor, put_record, records_of, to_numpy
from fedaccel.config import ConfigError
from fedaccel.errors import StateDirError

CLIENT_STATES = ("auto", "context", "disk")
AUTO_DISK_BYTES = 2 * 1024**3  # all clients' state beyond 2 GiB goes to disk


class ClientState(Protocol):
    """Named groups of tensors kept for one client between rounds.

    Versioned for the commit protocol (docs/client-state.md): the state a
    round writes is *pending* until the server says it applied that round's
    reply; :meth:`resolve` then commits it, or rolls back to the last
    committed state when the reply was lost, late or rejected.
    """

    def get(self, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        """The latest tensors saved under ``name`` (on ``device``), or None."""

    def put(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Save ``tensors`` under ``name`` (copies; later edits do not leak in)."""

    def get_flat(self, name: str, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """:meth:`get` as one flat vector: the tensors in ``layout``'s order,
        concatenated, or None (``layout`` of one dtype). State saved with
        another layout (another model) is an error."""

    def put_flat(self, name: str, flat: torch.Tensor, layout: Layout) -> None:
        """:meth:`put` of the tensors ``flat`` holds in ``layout``'s order,
        stored exactly as :meth:`put` stores them."""

    def resolve(self, accepted_round: int | None) -> str:
        """Commit or roll back before a round; see :meth:`VersionedState.resolve`."""

    def begin(self, server_round: int) -> None:
        """Open a round: :meth:`put` writes a new version tagged ``server_round``."""

    def seal(self) -> None:
        """Close the round: its version becomes the latest (still uncommitted)."""


# (key, dtype name, shape) of every tensor of a state, in order
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


def tensor_layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """The layout of ``tensors`` (keys, dtype names, shapes, in order)."""
    return tuple((k, _dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items())


def unflatten(flat: torch.Tensor, layout: Layout) -> OrderedDict[str, torch.Tensor]:
    """Views of ``flat`` as the tensors of ``layout`` (in its order)."""
    keys, sizes, shapes = split_plan(layout)
    return OrderedDict(zip(keys, (piece.view(shape) for piece, shape in zip(torch.split(flat, sizes), shapes))))


@lru_cache(maxsize=256)
def split_plan(layout: Layout) -> tuple[list[str], list[int], list[tuple[int, ...]]]:
    """Keys, sizes and shapes of a layout (made once per layout)."""
    return ([k for k, _, _ in layout], [math.prod(shape) for _, _, shape in layout],
            [shape for _, _, shape in layout])


def flat_size(layout: Layout) -> int:
    """How many values the tensors of ``layout`` hold."""
    return sum(split_plan(layout)[1])


def _one_dtype(layout: Layout) -> str:
    """The one dtype of a flat state's layout (:meth:`ClientState.get_flat`)."""
    dtypes = {dtype for _, dtype, _ in layout}
    if len(dtypes) != 1:
        raise ValueError(f"a flat state has one dtype; this layout has {sorted(dtypes)}")
    return dtypes.pop()


def _check_layout(saved: Layout, expected: Layout, name: str) -> None:
    if saved != expected:
        first = next((i for i, (a, b) in enumerate(zip(saved, expected)) if a != b), min(len(saved), len(expected)))
        found = saved[first] if first < len(saved) else "nothing more"
        wanted = expected[first] if first < len(expected) else "nothing more"
        raise ConfigError(
            f"client state {name!r}: the saved tensors are not this model's ({len(saved)} saved, "
            f"{len(expected)} expected; entry {first}: saved {found}, expected {wanted}); state kept "
            "by a run of another model (with client-state='disk', start with a fresh state-dir)")


def groups_or_zeros(state: ClientState, name: str, groups: tuple[str, ...],
                    like: Mapping[str, torch.Tensor]) -> dict[str, OrderedDict[str, torch.Tensor]]:
    """A solver's saved state as ``{group: {parameter: tensor}}`` (saved by
    :func:`flat_groups` as ``<group>.<parameter>``), or zeros shaped like ``like`` for a client that
    has not trained yet (SCAFFOLD's c_i, FedDyn's gradient, FedRKMGC's correction).

    The tensors read that are missing or not ``like``'s (another model's
    shapes, or its dtype: a float64 run's state in the same state-dir) are
    a ConfigError, as :meth:`ClientState.get_flat` gives one: that client
    fails with one line, trained one at a time or batched, instead of
    training on them (or, batched, promoting the whole cohort's stacks to
    their dtype). What is saved beside them, and in which order, is the
    solver's own (a ``saved_after_round`` may store more)."""
    device = next(iter(like.values())).device
    saved = state.get(name, device)
    if saved is not None:
        expected = tensor_layout(flat_groups({g: like for g in groups}))
        have = {key: (dtype, shape) for key, dtype, shape in tensor_layout(saved)}
        _check_layout(tuple((key, *have.get(key, ("missing", ()))) for key, _, _ in expected), expected, name)
        return {g: OrderedDict((k, saved[f"{g}.{k}"]) for k in like) for g in groups}
    return {g: OrderedDict((k, torch.zeros_like(v)) for k, v in like.items()) for g in groups}


def flat_groups(groups: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{group: {parameter: tensor}}`` as the flat ``<group>.<parameter>`` names
    :meth:`ClientState.put` stores (read back by :func:`groups_or_zeros`)."""
    return {f"{g}.{k}": v for g, tensors in groups.items() for k, v in tensors.items()}


class VersionedState:
    """The commit protocol over versions of a client's state, one per round.

    Two versions are kept: ``committed`` (the state as of the last round whose
    reply the server applied; 0 = the initial state) and ``latest`` (the state
    the client wrote in the last round it trained; equal to ``committed`` once
    resolved). Every training message of a stateful algorithm carries
    ``accepted-round``: the last round in which the server applied this
    client's reply. Before training, :meth:`resolve` makes the client agree:

    - ``latest == accepted``: commit (the older version is dropped);
    - ``committed == accepted``: roll back (the unapplied ``latest`` is dropped);
    - neither: the state the server counts on is gone (a SuperNode restarted
      with ``client-state='context'``): start again from the initial state and
      report it (``state-lost``).

    Subclasses store versions (:meth:`_read`, :meth:`_write`, :meth:`_drop`,
    :meth:`_versions`) and the two tags (:meth:`_tags`, :meth:`_save_tags`).
    Outside an open round (:meth:`begin`), :meth:`put` overwrites the latest
    version in place, which is what unit tests and tools use.
    """

    open_round: int | None = None

    # -------------------------------------------------------- the protocol
    def get(self, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        return self._read(self._tags()[1], name, device)

    def put(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        version = self.open_round if self.open_round is not None else self._tags()[1]
        self._write(version, name, tensors)

    def get_flat(self, name: str, layout: Layout, device: torch.device) -> torch.Tensor | None:
        _one_dtype(layout)
        return self._read_flat(self._tags()[1], name, layout, device)

    def put_flat(self, name: str, flat: torch.Tensor, layout: Layout) -> None:
        if _dtype_name(flat.dtype) != _one_dtype(layout) or flat.dim() != 1 or flat.numel() != flat_size(layout):
            raise ValueError(f"put_flat: a {flat.dtype} vector of {tuple(flat.shape)} for a layout of "
                             f"{flat_size(layout)} {_one_dtype(layout)} values")
        version = self.open_round if self.open_round is not None else self._tags()[1]
        self._write_flat(version, name, flat, layout)

    def resolve(self, accepted_round: int | None) -> str:
        """Make the state agree with the server; returns what happened:
        ``kept`` (nothing to do), ``committed``, ``rolled-back`` or ``lost``.
        ``accepted_round=None`` (no fedaccel server to ask) commits the latest."""
        committed, latest = self._tags()
        accepted = latest if accepted_round is None else int(accepted_round)
        if accepted == latest:
            outcome = "kept" if committed == latest else "committed"
            committed = latest
        elif accepted == committed:
            outcome, latest = "rolled-back", committed
        else:
            outcome, committed, latest = "lost", 0, 0
        for version in self._versions() - {committed}:
            self._drop(version)  # superseded, unapplied or orphaned (a crash before seal)
        if outcome == "lost":
            self._drop(0)
        self._save_tags(committed, latest)
        return outcome

    def begin(self, server_round: int) -> None:
        committed, latest = self._tags()
        if server_round not in (committed, latest):
            self._drop(server_round)  # leftovers of a round that crashed before seal
        self.open_round = server_round

    def seal(self) -> None:
        if self.open_round is None:
            return
        committed, _ = self._tags()
        self._save_tags(committed, self.open_round)
        self.open_round = None

    def versions(self) -> tuple[int, int]:
        """(committed, latest) round tags."""
        return self._tags()

    def read_version(self, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        """The tensors of one version (for checks and tools)."""
        return self._read(version, name, device)

    # ------------------------------------------------------------ storage
    def _read(self, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        raise NotImplementedError

    def _write(self, version: int, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _read_flat(self, version: int, name: str, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """:meth:`_read`, concatenated (a store that keeps flat vectors overrides this)."""
        saved = self._read(version, name, torch.device("cpu"))
        if saved is None:
            return None
        _check_layout(tensor_layout(saved), layout, name)
        return torch.cat([t.reshape(-1) for t in saved.values()]).to(device)  # one transfer

    def _write_flat(self, version: int, name: str, flat: torch.Tensor, layout: Layout) -> None:
        """:meth:`_write` of the tensors ``flat`` holds."""
        self._write(version, name, unflatten(flat.detach().cpu(), layout))  # one transfer

    def _drop(self, version: int) -> None:
        raise NotImplementedError

    def _versions(self) -> set[int]:
        raise NotImplementedError

    def _tags(self) -> tuple[int, int]:
        raise NotImplementedError

    def _save_tags(self, committed: int, latest: int) -> None:
        raise NotImplementedError


class ContextState(VersionedState):
    """State in Flower's ``context.state`` RecordDict.

    Version ``v`` of a named group is packed into one flat Array per dtype
    (record ``fedaccel.v<v>.<name>``) plus its layout (keys, dtypes, shapes;
    ConfigRecord ``fedaccel.v<v>.<name>.layout``): Flower pays a fixed cost
    per Array (its ``.npy`` header and per-object bookkeeping), so FedCDR's 3
    copies x 4 tensors of the MLP are one Array, not 12 (measured: put + get
    550 -> 310 us per client on the 60-32-10 MLP). The tags live in the
    ConfigRecord ``fedaccel.versions``. Committing or rolling back only
    re-tags and deletes records: nothing is copied.
    """

    TAGS = "fedaccel.versions"

    def __init__(self, record: RecordDict) -> None:
        self.record = record

    def _read(self, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        key = f"fedaccel.v{version}.{name}"
        if key not in self.record:
            return None
        layout = _parsed_layout(str(self.record[f"{key}.layout"]["layout"]))  # type: ignore[index]
        pieces = {}
        for dtype, array in self.record[key].items():  # type: ignore[union-attr]
            flat = torch.from_numpy(to_numpy(array).copy()).to(device)
            sizes = [math.prod(shape) for _, d, shape in layout if d == dtype]
            pieces[dtype] = iter(torch.split(flat, sizes))
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for k, dtype, shape in layout:
            out[k] = next(pieces[dtype]).view(shape)
        return out

    def _write(self, version: int, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        layout = tensor_layout(tensors)
        groups: dict[str, list[torch.Tensor]] = {}
        for (_, dtype, _), v in zip(layout, tensors.values()):
            groups.setdefault(dtype, []).append(v.detach().reshape(-1))
        key = f"fedaccel.v{version}.{name}"
        put_record(self.record, key, arrays_to_record(
            (dtype, from_tensor(torch.cat(flat) if len(flat) > 1 else flat[0])) for dtype, flat in groups.items()))
        put_record(self.record, f"{key}.layout", config_record({"layout": _layout_text(layout)}))

    def _read_flat(self, version: int, name: str, layout: Layout, device: torch.device) -> torch.Tensor | None:
        """The stored flat Array itself (no split into tensors)."""
        key = f"fedaccel.v{version}.{name}"
        if key not in self.record:
            return None
        _check_layout(_parsed_layout(str(self.record[f"{key}.layout"]["layout"])), layout, name)  # type: ignore[index]
        (array,) = self.record[key].values()  # type: ignore[union-attr]
        values = to_numpy(array)
        if values.shape != (flat_size(layout),):
            raise ConfigError(f"client state {name!r}: {values.size} values stored for a layout of "
                              f"{flat_size(layout)}; the state record is damaged")
        return torch.from_numpy(values.copy()).to(device)

    def _write_flat(self, version: int, name: str, flat: torch.Tensor, layout: Layout) -> None:
        """What :meth:`_write` stores for these tensors: their one-dtype flat
        vector and the layout (no split, no concatenation)."""
        key = f"fedaccel.v{version}.{name}"
        put_record(self.record, key, arrays_to_record([(layout[0][1], from_tensor(flat))]))
        put_record(self.record, f"{key}.layout", config_record({"layout": _layout_text(layout)}))

    def _drop(self, version: int) -> None:
        prefix = f"fedaccel.v{version}."
        for key in [k for k in self.record if k.startswith(prefix)]:
            del self.record[key]

    def _versions(self) -> set[int]:
        return {int(k.split(".")[1][1:]) for k in records_of(self.record, ArrayRecord) if k.startswith("fedaccel.v")}

    def _tags(self) -> tuple[int, int]:
        if self.TAGS not in self.record:
            return 0, 0
        tags = self.record[self.TAGS]
        return int(tags["committed"]), int(tags["latest"])  # type: ignore[arg-type]

    def _save_tags(self, committed: int, latest: int) -> None:
        if self.TAGS in self.record and self._tags() == (committed, latest):
            return  # unchanged (a client that was already resolved)
        put_record(self.record, self.TAGS, config_record({"committed": committed, "latest": latest}))


# A client's layout is the same in every round and for every client of a run:
# its JSON text is made, and read back, once per process.
@lru_cache(maxsize=256)
def _layout_text(layout: tuple[tuple[str, str, tuple[int, ...]], ...]) -> str:
    """The layout as stored: ``[[key, dtype, [shape...]], ...]`` in JSON."""
    return json.dumps([[k, dtype, list(shape)] for k, dtype, shape in layout])


@lru_cache(maxsize=256)
def _parsed_layout(text: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """:func:`_layout_text` read back."""
    return tuple((str(k), str(dtype), tuple(int(s) for s in shape)) for k, dtype, shape in json.loads(text))


@lru_cache(maxsize=64)
def _dtype_name(dtype: torch.dtype) -> str:
    """``'float32'`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


class DiskState(VersionedState):
    """State in ``<folder>/v<round>/<name>.npz`` files, tags in ``<folder>/versions.json``.

    Every file is written to a temporary name, flushed to disk and renamed
    (:func:`durable_replace`), and the tags file is the one switch that says
    which versions count: a crash at any point, a power loss included, leaves
    the last sealed state intact (a half-written round is an orphan version
    that the next :meth:`resolve` deletes).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _read(self, version: int, name: str, device: torch.device) -> OrderedDict[str, torch.Tensor] | None:
        path = self.folder / f"v{version}" / f"{name}.npz"
        if not path.is_file():
            return None
        with np.load(path) as data:
            return OrderedDict((k, torch.from_numpy(data[k]).to(device)) for k in data.files)

    def _write(self, version: int, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        folder = self.folder / f"v{version}"
        make_state_folder(folder)
        tmp = folder / f".{name}.tmp.npz"
        np.savez(tmp, **{k: v.detach().cpu().numpy() for k, v in tensors.items()})
        durable_replace(tmp, folder / f"{name}.npz")

    def _drop(self, version: int) -> None:
        shutil.rmtree(self.folder / f"v{version}", ignore_errors=True)

    def _versions(self) -> set[int]:
        if not self.folder.is_dir():
            return set()
        return {int(p.name[1:]) for p in self.folder.iterdir() if p.is_dir() and p.name[:1] == "v"
                and p.name[1:].isdigit()}

    def _tags(self) -> tuple[int, int]:
        path = self.folder / "versions.json"
        if not path.is_file():
            return 0, 0
        tags = json.loads(path.read_text(encoding="utf-8"))
        return int(tags["committed"]), int(tags["latest"])

    def _save_tags(self, committed: int, latest: int) -> None:
        make_state_folder(self.folder)
        tmp = self.folder / ".versions.tmp.json"
        tmp.write_text(json.dumps({"committed": committed, "latest": latest}), encoding="utf-8")
        durable_replace(tmp, self.folder / "versions.json")


def durable_replace(tmp: Path, dst: Path) -> None:
    """Rename ``tmp`` to ``dst`` so that after a power loss either the old or
    the new file is there, complete: flush the file, rename, flush the folder."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dst)
    folder = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def default_state_dir() -> Path:
    return Path(os.environ.get("FEDACCEL_STATE_DIR", "~/.cache/fedaccel/client-state")).expanduser()


def make_state_folder(folder: Path) -> None:
    """Make ``folder``, one under ``state-dir``, and its parents; one that
    cannot be made (a file in its way, no permission) is the user's to fix:
    one line naming ``state-dir``, not a traceback."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StateDirError(f"state-dir: cannot make the client-state folder {folder} ({err.strerror or err}); "
                            "set state-dir (or the FEDACCEL_STATE_DIR environment variable, its default) to a "
                            "writable folder") from None


def state_run_dir(state_dir: str, run_id: int) -> Path:
    """The folder holding every client's disk state for one run."""
    root = Path(state_dir).expanduser() if state_dir else default_state_dir()
    return root / f"run-{run_id}"


#: in a run's state folder that the fast runner owns: which process runs it
OWNER_FILE = ".owner.json"


def claim_state_run_dir(folder: Path) -> None:
    """Mark ``folder`` (:func:`state_run_dir`) as this process's, so that
    :func:`remove_orphaned_state_dirs` can tell when it is left over. The fast
    runner removes its folder when the run ends; after a SIGKILL or a power
    loss nothing does, and disk state can be large."""
    from fedaccel.processes import process_record

    make_state_folder(folder)
    (folder / OWNER_FILE).write_text(json.dumps(process_record()) + "\n", encoding="utf-8")


def remove_orphaned_state_dirs(state_dir: str) -> list[Path]:
    """Remove the run state folders under ``state_dir`` whose owning fast-runner
    process (:func:`claim_state_run_dir`) has ended on this host; returns them.
    Folders without an owner file (a SuperNode's, which outlive runs by
    design) and those of live or other hosts' processes are left alone."""
    import socket

    from fedaccel.processes import record_alive

    root = Path(state_dir).expanduser() if state_dir else default_state_dir()
    removed = []
    try:
        folders = sorted(root.glob("run-*")) if root.is_dir() else []
    except OSError:  # a path the file system refuses (a name too long): the run's own use of it says so
        folders = []
    for folder in folders:
        try:
            owner = json.loads((folder / OWNER_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (isinstance(owner, dict) and isinstance(owner.get("pid"), int)
                and owner.get("host") == socket.gethostname() and not record_alive(owner)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def choose_backend(mode: str, num_clients: int, bytes_per_client: int) -> str:
    """Resolve ``client-state='auto'``."""
    if mode != "auto":
        return mode
    versions = 2  # committed + pending (VersionedState)
    return "disk" if num_clients * versions * bytes_per_client > AUTO_DISK_BYTES else "context"


def context_client_state(context_state: RecordDict) -> VersionedState:
    """The client state a Context's ``state`` holds (``client-state='context'``):
    in the RecordDict itself (:class:`ContextState`), or, for the fast
    runner's Contexts, in the row of the run's stacked store the RecordDict
    names (:class:`fedaccel.clients.stacked_state.StackedStateRecord`)."""
    opener = getattr(context_state, "stacked_client_state", None)
    return opener() if opener is not None else ContextState(context_state)


def open_client_state(mode: str, state_dir: str, run_id: int, partition_id: int,
                      context_state: RecordDict) -> ClientState:
    """The state store of one client for one run (``mode`` already resolved)."""
    if mode == "disk":
        return DiskState(state_run_dir(state_dir, run_id) / f"client-{partition_id}")
    return context_client_state(context_state)
