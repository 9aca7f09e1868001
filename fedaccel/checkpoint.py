"""Checkpoints of a run: everything it needs to continue after a crash.

``checkpoint-every = k`` writes ``<run dir>/checkpoints/round-<r>.zip`` after
every k-th round; ``fedaccel-run --resume <run dir>`` (or the run-config key
``resume``) continues from the newest one, and the run then ends with a final
model bit-identical to a run that was never interrupted
(``tests/test_checkpoint.py`` checks it for every algorithm).

A checkpoint holds:

- the global model after round r (the model round r+1 starts from), as
  Flower's own ArrayRecord protobuf, so dtypes and bytes are exactly kept;
- the strategy's state that carries over rounds (momenta, control variates,
  Douglas-Rachford variables, which client replies were applied: each
  strategy names its attributes in ``carried_state``), as arrays plus a JSON
  description of how they nest;
- the metrics rows of rounds 1..r (``metrics.jsonl`` is cut back to them);
- in the fast runner, every client's state: the ``context.state`` of every
  simulated node (Flower's RecordDict protobuf) and the files of
  ``client-state='disk'``. Flower's engines keep client contexts where the
  server cannot read them: there a checkpoint holds the server's side, plus
  the clients' ``client-state='disk'`` files where the server sees them
  (:class:`SharedDiskClientStore`); stateful algorithms without them refuse
  to checkpoint.

Randomness needs no saved state: cohorts, stragglers and every client's
batches are drawn from generators seeded by (seed, round, partition)
(:func:`fedaccel.torch_utils.derive_seed`), never from a running stream.

Files are written to a temporary name, flushed and renamed
(:func:`fedaccel.clients.state.durable_replace`): a crash while writing leaves
the previous checkpoint intact. The newest :data:`KEEP` are kept. A damaged
file (the zip's CRC-32 of every member is checked) or one written for
another run config is refused with one line saying what to do.

Written here by hand: Flower has no checkpointing for Message-API
strategies (``Strategy.start`` always runs rounds 1..N).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from flwr.app import ArrayRecord, RecordDict
from flwr.common import serde
from flwr.proto.recorddict_pb2 import ArrayRecord as ProtoArrayRecord, RecordDict as ProtoRecordDict

from fedaccel.clients.state import durable_replace
from fedaccel.config import config_error, config_literal
from fedaccel.errors import CheckpointError
from fedaccel.results import CONFIG_FILE

FORMAT = 1
CHECKPOINT_DIR = "checkpoints"
KEEP = 2  # the newest two: a resume can also start one checkpoint earlier
# Keys that may differ between a checkpoint's run and the run that resumes it:
# where results go and how often to checkpoint do not change the numbers.
UNCHECKED_KEYS = frozenset({"resume", "results-dir", "run-name", "checkpoint-every", "round-timeout",
                            "tracker", "tracker-uri"})
_NAME = re.compile(r"round-(\d+)\.zip$")


@dataclass
class Checkpoint:
    """What a run needs to continue after ``round``."""

    round: int
    run_config: dict[str, Any]
    num_clients: int
    model: ArrayRecord
    server_state: dict[str, Any]  # attribute -> encode_state() description
    server_arrays: dict[str, np.ndarray]  # the arrays those descriptions name
    rows: list[dict[str, Any]]
    # client files (``context/<partition>.pb``, ``disk/<path>``), or None when
    # the clients' state was not saved (Flower's engines: the server side only)
    clients: dict[str, bytes] | None = None
    path: Path | None = None  # the file it was read from


# ----------------------------------------------------------------- state codec
def encode_state(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """A JSON-able description of ``value``; its arrays go into ``arrays``.

    Handles what strategies keep: None, bool, int, float, str, NumPy arrays
    and scalars (dtype kept), dicts (int or str keys), lists, tuples and
    dataclass instances. Anything else is a bug in the strategy (TypeError).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):
        return {"int": value} if isinstance(value, int) else {"float": float(value).hex()}
    if isinstance(value, (np.ndarray, np.generic)):
        key = f"a{len(arrays)}"
        arrays[key] = np.asarray(value)
        return {"array": key, "scalar": isinstance(value, np.generic)}
    if isinstance(value, dict):
        return {"dict": [[encode_state(k, arrays), encode_state(v, arrays)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [encode_state(v, arrays) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"dataclass": {f.name: encode_state(getattr(value, f.name), arrays)
                              for f in dataclasses.fields(value)}}
    raise TypeError(f"cannot checkpoint a {type(value).__name__}; strategies keep NumPy arrays, "
                    "numbers, strings, dicts, lists and dataclasses")


def decode_state(tree: Any, arrays: dict[str, np.ndarray], like: Any = None) -> Any:
    """The value :func:`encode_state` described; ``like`` (the attribute's
    current value) gives a dataclass its type."""
    if tree is None or isinstance(tree, (bool, str)):
        return tree
    kind = next((k for k in _KINDS if k in tree), None) if isinstance(tree, dict) else None
    if kind is None:
        raise CheckpointError(f"unreadable value {tree!r} in the checkpoint's server state")
    body = tree[kind]
    if kind == "int":
        return int(body)
    if kind == "float":
        return float.fromhex(body)
    if kind == "array":
        array = arrays[body]
        return array[()] if tree.get("scalar") else array
    if kind == "dict":
        return {decode_state(k, arrays): decode_state(v, arrays) for k, v in body}
    if kind in ("list", "tuple"):
        items = [decode_state(v, arrays) for v in body]
        return tuple(items) if kind == "tuple" else items
    if kind == "dataclass":
        if like is None or not dataclasses.is_dataclass(like):
            raise CheckpointError("the checkpoint's server state does not fit this version of fedaccel")
        return type(like)(**{k: decode_state(v, arrays, getattr(like, k, None)) for k, v in body.items()})
    raise AssertionError(kind)


_KINDS = ("int", "float", "array", "dict", "list", "tuple", "dataclass")


# ---------------------------------------------------------------- files
def checkpoint_path(run_dir: Path, server_round: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"round-{server_round:05d}.zip"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint files, oldest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.search(p.name))]
    return [p for _, p in sorted(found)]


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def write_checkpoint(run_dir: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically as ``checkpoints/round-<r>.zip``; keep the newest :data:`KEEP`."""
    path = checkpoint_path(run_dir, ckpt.round)
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": FORMAT,
        "round": ckpt.round,
        "run-config": ckpt.run_config,
        "num-clients": ckpt.num_clients,
        "server-state": ckpt.server_state,
        "rows": ckpt.rows,
        "clients": ckpt.clients is not None,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("manifest.json", json.dumps(manifest, indent=1))
        zf.writestr("model.pb", serde.array_record_to_proto(ckpt.model).SerializeToString())
        zf.writestr("server-state.npz", _npz_bytes(ckpt.server_arrays))
        for name, data in sorted((ckpt.clients or {}).items()):
            zf.writestr(f"clients/{name}", data)
    durable_replace(tmp, path)
    write_resume_toml(path.with_suffix(".toml"), ckpt.run_config, path)
    write_resume_toml(path.parent / RESUME_TOML, ckpt.run_config, Path(run_dir))
    for old in list_checkpoints(run_dir)[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".toml").unlink(missing_ok=True)
    return path


RESUME_TOML = "resume.toml"


def write_resume_toml(path: Path, run_config: dict[str, Any], resume: Path) -> Path:
    """The run's config plus ``resume``, for ``flwr run . --run-config <path>``
    (Flower takes a TOML file there, but not a file and key=value pairs
    together): ``checkpoints/resume.toml`` resumes from the newest
    checkpoint, ``checkpoints/round-<r>.toml`` from that one."""
    values = {**{k: v for k, v in run_config.items() if k != "resume"}, "resume": str(Path(resume).resolve())}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("# flwr run . --run-config <this file>: continues the run from its checkpoint\n"
                   + tomli_w.dumps(values), encoding="utf-8")
    durable_replace(tmp, path)
    return path


def find_checkpoint(where: str | Path) -> Path:
    """The checkpoint a resume starts from: ``where`` itself if it is a
    checkpoint file, else the newest one in the run folder ``where``."""
    where = Path(where).expanduser()
    if where.is_file():
        return where
    if not where.is_dir():
        # a path that is not there is a wrong command (exit 2), not a damaged run (3)
        raise config_error("resume", str(where), "no such run folder or checkpoint file")
    found = list_checkpoints(where)
    if not found:
        raise CheckpointError(
            f"resume={str(where)!r}: the run has no checkpoint (it ran without checkpoint-every, "
            "or stopped before its first one); start it again with checkpoint-every=k")
    return found[-1]


def read_manifest(path: Path) -> dict[str, Any]:
    """Only the manifest of a checkpoint (round, run config, clients); the
    whole file is checked when the run reads it (:func:`read_checkpoint`)."""
    try:
        with zipfile.ZipFile(path) as zf:
            manifest = json.loads(zf.read("manifest.json"))
        return {"round": int(manifest["round"]), "run-config": dict(manifest["run-config"]),
                "num-clients": int(manifest["num-clients"])}
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, OSError) as err:
        raise _unreadable(path, err, _previous_hint(path)) from None


def _previous_hint(path: Path) -> str:
    """How to resume from the checkpoint before ``path`` instead (with
    either runner), or "" without one."""
    if path.parent.name != CHECKPOINT_DIR:
        return ""
    previous = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    if not previous:
        return ""
    toml = previous[-1].with_suffix(".toml")
    flwr = f"; flwr run: --run-config '{toml}'" if toml.is_file() else ""
    return f"; resume from the previous one instead (fedaccel-run --resume '{previous[-1]}'{flwr})"


def _unreadable(path: Path, err: BaseException, fallback: str = "") -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is damaged or not a fedaccel checkpoint "
                           f"({type(err).__name__}: {err}){fallback}")


def resolution_changed(run_dir: Path, cfg: Any) -> str | None:
    """Why a run cannot go on under ``cfg`` (a RunConfig whose keys equal the
    checkpoint's) although nothing in its run config changed: a setting
    whose ``auto`` now resolves to another value than the run's
    ``config.json`` recorded when it started (the sampler; the straggler
    policy, when the run has stragglers). None when nothing changed or the
    run recorded nothing."""
    try:
        resolved = json.loads((Path(run_dir) / CONFIG_FILE).read_text(encoding="utf-8")).get("resolved")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(resolved, dict):
        return None
    settings = [("sampler", "sampler", cfg.sampler)]
    if cfg.straggler_fraction > 0:
        settings.append(("straggler_policy", "straggler-policy", cfg.straggler_policy))
    for field, key, now in settings:
        started = resolved.get(field)
        if isinstance(started, str) and started != now:
            return (f"the run started with {key} resolved to '{started}' (its config.json) and would go on "
                    f"with '{now}': {key}='auto' means another rule for algo='{cfg.algo}' since it started, so "
                    f"it cannot be resumed; run it again from round 1 ({key}='{started}' keeps its rule)")
    return None


def run_dir_of(path: Path) -> Path:
    """The run folder a checkpoint file belongs to (the one holding ``checkpoints/``)."""
    path = Path(path).resolve()
    if path.parent.name != CHECKPOINT_DIR:
        raise CheckpointError(f"resume={str(path)!r}: a checkpoint file must stay in its run's "
                              f"{CHECKPOINT_DIR}/ folder (the run continues in that folder)")
    return path.parent.parent


def read_checkpoint(path: Path) -> Checkpoint:
    """Read and check one checkpoint file; a damaged or foreign file is a :class:`CheckpointError`."""
    fallback = _previous_hint(path)
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every member and checks its CRC-32
            if bad is not None:
                raise CheckpointError(f"checkpoint {path} is damaged ({bad} fails its checksum){fallback}")
            manifest = json.loads(zf.read("manifest.json"))
            if manifest.get("format") != FORMAT:
                raise CheckpointError(
                    f"checkpoint {path} has format {manifest.get('format')!r}; this fedaccel reads "
                    f"format {FORMAT} (written by another fedaccel version)")
            proto = ProtoArrayRecord()
            proto.ParseFromString(zf.read("model.pb"))
            model = serde.array_record_from_proto(proto)
            with np.load(io.BytesIO(zf.read("server-state.npz"))) as data:
                arrays = {k: data[k] for k in data.files}
            clients = ({n.removeprefix("clients/"): zf.read(n) for n in zf.namelist() if n.startswith("clients/")}
                       if manifest["clients"] else None)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, OSError) as err:
        raise _unreadable(path, err, fallback) from None
    return Checkpoint(
        round=int(manifest["round"]),
        run_config=dict(manifest["run-config"]),
        num_clients=int(manifest["num-clients"]),
        model=model,
        server_state=dict(manifest["server-state"]),
        server_arrays=arrays,
        rows=list(manifest["rows"]),
        clients=clients,
        path=path,
    )


def carried_state(strategy: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The attributes of ``strategy`` named by ``carried_state`` in its
    classes, encoded (:func:`encode_state`): descriptions and arrays."""
    arrays: dict[str, np.ndarray] = {}
    return {name: encode_state(getattr(strategy, name), arrays) for name in carried_names(strategy)}, arrays


def carried_names(strategy: Any, attribute: str = "carried_state") -> list[str]:
    """The names ``attribute`` lists in the classes of ``strategy``, over its MRO."""
    names: list[str] = []
    for cls in reversed(type(strategy).__mro__):
        for name in vars(cls).get(attribute, ()):
            if name not in names:
                names.append(name)
    return names


def restore_carried_state(strategy: Any, ckpt: Checkpoint) -> None:
    """Set the strategy's carried attributes from a checkpoint's server state.

    The checkpoint must hold every carried attribute and no other, except
    those in ``optional_carried_state`` (added after older checkpoints were
    written): absent, they keep their fresh value."""
    expected = carried_names(strategy)
    optional = set(carried_names(strategy, "optional_carried_state"))
    held = set(ckpt.server_state)
    if held - set(expected) or set(expected) - optional - held:
        raise CheckpointError(
            f"the checkpoint's server state ({', '.join(sorted(ckpt.server_state)) or 'none'}) does not "
            f"match {type(strategy).__name__}'s ({', '.join(sorted(expected)) or 'none'}): it was "
            "written by another fedaccel version or for another algorithm")
    for name in expected:
        if name in held:
            setattr(strategy, name, decode_state(ckpt.server_state[name], ckpt.server_arrays,
                                                 like=getattr(strategy, name)))


# Run-config keys added after checkpoints were written, with the value that
# does what runs did before the key existed: a checkpoint without the key
# ran with that value (and resumes with it).
KEYS_ADDED_LATER = {"gc.global-scope": "split", "synthetic.shared-model": False}


def config_mismatch(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """``key=given (checkpoint: saved)`` for every key (but :data:`UNCHECKED_KEYS`) that differs;
    a key the checkpoint predates counts as its :data:`KEYS_ADDED_LATER` value."""
    out = []
    for key in sorted((set(saved) | set(given)) - UNCHECKED_KEYS):
        a, b = saved.get(key, KEYS_ADDED_LATER.get(key, "<absent>")), given.get(key, "<absent>")
        if a != b or type(a) is not type(b):
            out.append(f"{key}={config_literal(b)} (checkpoint: {config_literal(a)})")
    return out


# ------------------------------------------------------------ clients' state
def disk_state_files(folder: Path) -> dict[str, bytes]:
    """The files of ``client-state='disk'`` under one run's state folder, as
    ``disk/<path>`` (temporary files of a write in progress left out)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {f"disk/{p.relative_to(folder).as_posix()}": p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def restore_disk_state_files(folder: Path, files: dict[str, bytes]) -> None:
    """Replace one run's state folder by the ``disk/`` files of a checkpoint
    (its own top-level hidden files, such as the owner record, stay)."""
    folder = Path(folder)
    for entry in list(folder.iterdir()) if folder.is_dir() else []:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif not entry.name.startswith("."):
            entry.unlink()
    for name, data in files.items():
        kind, _, rest = name.partition("/")
        if kind == "disk":
            target = Path(folder) / rest
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


class SharedDiskClientStore:
    """Clients' ``client-state='disk'`` files, read and written by the server
    where it shares their filesystem: Flower's simulation on one machine, or
    SuperNodes on the server's machine.

    Before saving it checks that every client whose reply the server applied
    (``applied()``) has its state there; if not (SuperNodes on other
    machines), the checkpoint is refused rather than saved without them.
    """

    def __init__(self, folder: Path, applied: Callable[[], Iterable[int]] = tuple) -> None:
        self.folder = Path(folder)
        self.applied = applied

    def client_state_files(self) -> dict[str, bytes]:
        missing = sorted(p for p in self.applied() if not (self.folder / f"client-{p}" / "versions.json").is_file())
        if missing:
            raise CheckpointError(
                f"cannot checkpoint the clients' state: the server does not see the state files of "
                f"client(s) {', '.join(map(str, missing[:5]))} under {self.folder} (SuperNodes on other "
                "machines keep theirs there); checkpoint this algorithm in Flower's simulation or the "
                "fast runner, or use checkpoint-every=0")
        return disk_state_files(self.folder)

    def restore_client_state_files(self, files: dict[str, bytes]) -> None:
        if any(name.startswith("context/") for name in files):
            raise CheckpointError("the checkpoint holds clients' state kept in Flower contexts (a fast-runner "
                                  "run with client-state='context'); resume it with fedaccel-run --resume")
        restore_disk_state_files(self.folder, files)


# ------------------------------------------------------- fast runner clients
def record_dict_bytes(record: RecordDict) -> bytes:
    """A client's ``context.state`` as Flower's own protobuf bytes."""
    return serde.recorddict_to_proto(record).SerializeToString()


def record_dict_from_bytes(data: bytes) -> RecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return serde.recorddict_from_proto(proto)
