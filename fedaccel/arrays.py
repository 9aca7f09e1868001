"""Fast conversions between Flower ``Array``s and NumPy/PyTorch.

A Flower :class:`~flwr.app.Array` holds its values as the bytes of an
``.npy`` file (``stype='numpy.ndarray'``), and ``Array.numpy()`` reads them
back with ``np.load``, which parses the header with ``ast.literal_eval``:
50-95 us per array here, mostly independent of its size. Every model
crosses that three times per client and round (the client loads it, the
server checks and averages the reply): about a third of the framework's
overhead on small models (docs/measurements.md). Nothing in Flower or NumPy offers a zero-copy reader, so these two
small codecs are written here by hand:

- :func:`to_numpy`: a read-only view of the ``.npy`` payload, used when the
  header says exactly what the Array's ``dtype`` and ``shape`` fields say (C
  order, little-endian simple dtype, the byte count matches); anything else
  goes through ``Array.numpy()`` unchanged, errors included.
- :func:`from_numpy`: the same bytes ``np.save`` writes (header cached per
  dtype and shape), so Arrays built here and by Flower are interchangeable.

Flower's ``Array``, ``ArrayRecord``, ``MetricRecord`` and ``ConfigRecord``
constructors check every argument (5 us an Array, 2 us a record item, 8 us
a small metrics record: together about a sixth of a batched round's
per-client work at 100 clients per round). :func:`from_numpy`,
:func:`arrays_to_record`, :func:`metric_record` and :func:`config_record`
make the same checks more cheaply and fill the objects' fields directly, to
exactly the state Flower's constructors leave. That equality is checked once per
process against the constructors themselves (:func:`_filling_matches`); on
a Flower version where it does not hold, the constructors are used.

Views are read-only: copy before writing to them.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager
from functools import lru_cache
from io import BytesIO
from typing import Iterable, Iterator, Mapping, Sequence, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

T = TypeVar("T")

NUMPY_STYPE = "numpy.ndarray"  # flwr's SType.NUMPY


@lru_cache(maxsize=4096)
def _npy_header(dtype_str: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array."""
    buffer = BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": dtype_str, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


@lru_cache(maxsize=4096)
def _expected_header(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, np.dtype, int] | None:
    """(header bytes, dtype, element count) an Array with these fields carries
    when written by ``np.save`` in format 1.0, or None for dtypes read the slow way."""
    try:
        dt = np.dtype(dtype)
        count = math.prod(int(s) for s in shape)
    except (TypeError, ValueError):
        return None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or count < 0:
        return None
    return _npy_header(dt.str, shape), dt, count


def to_numpy(array: Array) -> np.ndarray:
    """The Array's values as a read-only NumPy view of its bytes (no copy).

    Equal to ``array.numpy()`` (tested); falls back to it whenever the
    payload is not the plain C-ordered ``.npy`` that ``np.save`` writes for
    the Array's own ``dtype`` and ``shape``. Inside :func:`views_reused`, an
    Array's view is made once.
    """
    if type(array) is DeferredArray:
        values = _deferred_values(array)
        if values is not None:
            return values  # read-only, the bytes never written
    memo = getattr(_reuse, "memo", None)
    if memo is not None:
        seen = memo.get(id(array))
        if seen is not None and seen[0] is array:
            return seen[1]
    data = array.data
    if array.stype == NUMPY_STYPE and isinstance(data, bytes):
        shape = tuple(array.shape)
        expected = _expected_header(array.dtype, shape)
        if expected is not None:
            header, dt, count = expected
            if len(data) == len(header) + count * dt.itemsize and data.startswith(header):
                view = np.frombuffer(data, dtype=dt, count=count, offset=len(header)).reshape(shape)
                if memo is not None:  # the Array kept alive with it: its id is not reused meanwhile
                    memo[id(array)] = (array, view)
                return view
    return array.numpy()  # a fresh array each time: never reused


_reuse = threading.local()  # .memo: id(Array) -> (Array, view) inside views_reused()


@contextmanager
def views_reused() -> Iterator[None]:
    """Within the block, :func:`to_numpy` makes each Array's view once (in
    this thread) and returns the same read-only view again; the server reads
    every reply's arrays twice in a round (its checks, then the mean): 400
    reads of 2 us each at 100 clients of a 4-tensor model. A view is of the
    Array's ``data`` bytes as they were when first read: the block is for
    code that reads Arrays, not code that replaces their ``data``. Nested
    blocks share the outermost's memo."""
    if getattr(_reuse, "memo", None) is not None:
        yield
        return
    _reuse.memo = {}
    try:
        yield
    finally:
        _reuse.memo = None


def from_numpy(values: np.ndarray) -> Array:
    """An Array holding ``values``: byte for byte what ``Array(values)`` builds."""
    values = np.asarray(values)
    if not _plain_c_order(values):
        return Array(values)  # Flower's own path (Fortran order, records; its error for objects)
    return _new_array(_dtype_name(values.dtype), tuple(int(s) for s in values.shape), _npy_bytes(values))


def _plain_c_order(values: np.ndarray) -> bool:
    """Whether :func:`from_numpy` writes ``values`` itself: a C-contiguous
    array of a simple dtype (no objects, no record fields)."""
    return not values.dtype.hasobject and values.dtype.fields is None and values.flags.c_contiguous


def _npy_bytes(values: np.ndarray) -> bytes:
    """What ``np.save`` writes for a C-contiguous ``values``, in one copy."""
    return b"".join((_npy_header(values.dtype.str, tuple(int(s) for s in values.shape)),
                     values.reshape(-1).view(np.uint8)))


class DeferredArray(Array):
    """An Array whose ``.npy`` bytes are written only when something reads
    ``data`` (serializing the message, hashing it, comparing it).

    Its values are one row of a :class:`StackedRows` (:func:`deferred_row`):
    one client's row of the weights the cohort trainer stacked for a whole
    chunk. In the fast runner no one serializes a reply: the server reads it
    through :func:`to_numpy`, which returns the values themselves
    (read-only), or, for a row of a stack, through :func:`all_finite` and
    :func:`mean_of_records`, which work on the stack where it lives (on a
    GPU, on the GPU). Building ``data`` would be one more full copy of the
    cohort's weights per round (at 1,000 clients of a 1.66M-parameter CNN,
    6.6 GB of fresh memory a round, a fifth of such a round's host time on
    a 2-core CPU). Anyone else reading ``data`` gets exactly the bytes
    :func:`from_numpy` writes; setting ``data`` replaces the values; copying
    or pickling one gives a plain :class:`~flwr.app.Array` with those bytes.
    Written by hand: Flower's Array always holds its bytes.
    """

    @property  # type: ignore[override]
    def data(self) -> bytes:
        fields = self.__dict__
        payload = fields.get("_payload")
        if payload is None:
            payload = fields["_payload"] = _npy_bytes(_deferred_values(self))
        return payload

    @data.setter
    def data(self, value: bytes) -> None:
        fields = self.__dict__
        fields["_payload"] = value
        for name in ("_values", "_rows", "_row"):
            fields.pop(name, None)

    def __reduce__(self):  # copy.copy, copy.deepcopy, pickle: a plain Array with the bytes
        return _new_array, (self.dtype, self.shape, self.data)

    def __eq__(self, other: object) -> bool:  # the dataclass's own compares classes too
        if not isinstance(other, Array):
            return NotImplemented
        return ((self.dtype, self.shape, self.stype, self.data)
                == (other.dtype, other.shape, other.stype, other.data))

    __hash__ = None  # type: ignore[assignment]  # as the dataclass's


# Flower's transport names an object's type by its class's ``__qualname__`` in
# the object's header (and so in its content hash, ``object_id``) and inflates
# it by that name: a DeferredArray travels, and hashes, as the Array it is.
DeferredArray.__qualname__ = "Array"


def _deferred_values(array: DeferredArray) -> np.ndarray | None:
    """A DeferredArray's values (read-only; its row of the stack, copied to
    the host with the whole stack the first time); None once ``data`` was set."""
    fields = array.__dict__
    values = fields.get("_values")
    if values is None:
        rows = fields.get("_rows")
        if rows is None:
            return None
        values = fields["_values"] = rows.host()[fields["_row"], ...]  # a 0-d row stays an array
    return values


class StackedRows:
    """A tensor ``[C, ...]`` whose rows are C clients' arrays of one name
    (the cohort trainer's stacked weights), kept where it is: the rows'
    Arrays (:func:`deferred_row`) reach host memory only when something
    reads their values as NumPy or bytes, and then all rows in one copy.
    The server's reply checks (:func:`all_finite`: one pass over the stack
    for every client), its means (:func:`mean_of_records`: on the stack's
    CUDA GPU, when it lives on one, else from the host stack) and
    sums (:func:`add_records`) read the stack itself. The tensor must
    not change while its rows' Arrays live. Written by hand: Flower's Arrays
    are bytes in host memory.
    """

    __slots__ = ("tensor", "row_fields", "_host", "_finite")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        dtype = _numpy_dtype(self.tensor.dtype)
        # every row's Array fields (Flower's four, marked dirty as its constructor
        # leaves them), or None where rows are Arrays of their own (from_numpy)
        self.row_fields = None if not _FILL_RECORDS or dtype is None or not self.tensor.is_contiguous() else {
            "_is_dirty": True, "dtype": _dtype_name(dtype), "shape": tuple(int(s) for s in self.tensor.shape[1:]),
            "stype": NUMPY_STYPE}
        self._host: np.ndarray | None = None
        self._finite: np.ndarray | None = None

    @property
    def on_device(self) -> bool:
        """Whether the stack lives on a CUDA GPU (the only device besides the
        CPU that fedaccel trains on): the mean runs there."""
        return self.tensor.device.type == "cuda"

    def host(self) -> np.ndarray:
        """The stack as a read-only NumPy array (no copy of a CPU tensor; one
        copy off a GPU, made once)."""
        if self._host is None:
            host = self.tensor.cpu().numpy().view()
            host.flags.writeable = False
            self._host = host
        return self._host

    def finite_rows(self) -> np.ndarray:
        """For each row, whether all its values are finite (always, for
        integer dtypes): one pass over the stack, made once."""
        if self._finite is None:
            tensor = self.tensor
            rows = tensor.shape[0]
            if tensor.is_floating_point() or tensor.is_complex():
                flat = tensor.reshape(rows, math.prod(tensor.shape[1:]))
                # a NaN or an infinity makes its row's sum NaN or infinite: the
                # rows whose sum is not finite (those, and finite rows whose sum
                # overflows) are checked value by value. A sum is one read of the
                # stack; torch.isfinite over all of it writes a mask as large
                # (15x slower on a CPU, and a GPU's memory for it)
                finite = torch.isfinite(flat.sum(dim=1))
                suspects = torch.nonzero(~finite).flatten()
                if len(suspects):
                    finite[suspects] = torch.isfinite(flat[suspects]).all(dim=1)
                self._finite = finite.cpu().numpy()
            else:
                self._finite = np.ones(rows, dtype=bool)
        return self._finite


def deferred_row(rows: StackedRows, row: int) -> Array:
    """Row ``row`` of a stack as a :class:`DeferredArray`: the Array
    :func:`from_numpy` builds from ``rows.host()[row]`` (the same fields, the
    same bytes when read), without copying it off the stack's device."""
    if rows.row_fields is None:
        return from_numpy(rows.host()[row, ...])
    array = DeferredArray.__new__(DeferredArray)
    array.__dict__.update(rows.row_fields, _rows=rows, _row=row)
    return array


def all_finite(array: Array) -> bool:
    """Whether every value of ``array`` is finite (True for integer dtypes):
    for a row of a :class:`StackedRows`, the stack's flag for that row, else
    NumPy on :func:`to_numpy`'s view."""
    if type(array) is DeferredArray:
        rows = array.__dict__.get("_rows")
        if rows is not None:
            return bool(rows.finite_rows()[array.__dict__["_row"]])
    values = to_numpy(array)
    return values.dtype.kind not in "fc" or bool(np.isfinite(values).all())


def payload_size(array: Array) -> int:
    """``len(array.data)``, without writing a :class:`DeferredArray`'s bytes."""
    if type(array) is DeferredArray and "_payload" not in array.__dict__:
        header, dtype, count = _expected_header(array.dtype, tuple(array.shape))
        return len(header) + count * dtype.itemsize
    return len(array.data)


def _constructed_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """``Array(dtype=..., shape=..., stype='numpy.ndarray', data=...)``."""
    return Array(dtype=dtype, shape=shape, stype=NUMPY_STYPE, data=data)


def _filled_array(dtype: str, shape: tuple[int, ...], data: bytes) -> Array:
    """The same Array as :func:`_constructed_array`, its fields filled directly
    (the state Flower's constructor leaves: the four fields, marked dirty)."""
    array = Array.__new__(Array)
    array.__dict__.update({"_is_dirty": True, "dtype": dtype, "shape": shape, "stype": NUMPY_STYPE,
                           "data": data})
    return array


def _constructed_record(arrays: Iterable[tuple[str, Array]]) -> ArrayRecord:
    """An ArrayRecord filled item by item through its public ``__setitem__``
    (its checks: a ``str`` key, an ``Array`` value)."""
    record = ArrayRecord()
    for key, array in arrays:
        record[key] = array
    return record


def _filled_record(arrays: Iterable[tuple[str, Array]]) -> ArrayRecord:
    """The same record as :func:`_constructed_record`, its dict filled directly;
    the same checks, made here (Flower's ``TypeError`` for a wrong type)."""
    record = ArrayRecord()
    fields = record.__dict__
    data = fields["_data"]
    for key, array in arrays:
        if type(key) is not str or not isinstance(array, Array):
            record[key] = array  # raises Flower's TypeError
        data[key] = array
    fields["_is_dirty"] = True
    return record


_METRIC_SCALARS = frozenset({int, float})  # what MetricRecord takes as it is (not bool)
_CONFIG_SCALARS = frozenset({int, float, str, bytes, bool})


_RECORD_TYPES = (ArrayRecord, MetricRecord, ConfigRecord)  # what a RecordDict holds


def record_dict(records: Mapping[str, ArrayRecord | MetricRecord | ConfigRecord]) -> RecordDict:
    """``RecordDict(dict(records))``: a message's content. Filled directly
    when every key is a ``str`` and every value one of Flower's three record
    types (the constructor's own checks, made here: 7 us a reply's content
    through the constructor, 2 us filled), else through the constructor (its
    ``TypeError``)."""
    if _FILL_CONTENT and all(type(k) is str and isinstance(v, _RECORD_TYPES) for k, v in records.items()):
        return _filled_record_dict(records)
    return RecordDict(dict(records))


def _filled_record_dict(records: Mapping[str, ArrayRecord | MetricRecord | ConfigRecord]) -> RecordDict:
    content = RecordDict()
    content.__dict__["_data"].update(records)
    return content


def put_record(content: RecordDict, key: str, record: ArrayRecord | MetricRecord | ConfigRecord) -> None:
    """``content[key] = record``. Set directly when the key is a ``str``, the
    record one of Flower's three types and any record it replaces of the same
    type (Flower's ``__setitem__`` makes those checks and looks the old value
    up for its warning: 9 us, about 2 filled; a client's state writes four a
    round), else through ``__setitem__`` (its ``TypeError``, its warning)."""
    data = content.__dict__["_data"] if _FILL_CONTENT else None
    if (data is not None and type(key) is str and isinstance(record, _RECORD_TYPES)
            and type(data.get(key, record)) is type(record)):
        data[key] = record
    else:
        content[key] = record


def metric_record(values: Mapping[str, object]) -> MetricRecord:
    """``MetricRecord(values)``; filled directly when every key is a ``str``
    and every value a plain ``int`` or ``float``, else (lists, NumPy
    scalars, wrong types and their ``TypeError``) through the constructor."""
    return _scalar_record(MetricRecord, _METRIC_SCALARS, values)


def config_record(values: Mapping[str, object]) -> ConfigRecord:
    """``ConfigRecord(values)``, filled directly as :func:`metric_record`
    (plain ``int``, ``float``, ``str``, ``bytes``, ``bool`` values)."""
    return _scalar_record(ConfigRecord, _CONFIG_SCALARS, values)


def _scalar_record(cls: type[T], scalars: frozenset[type], values: Mapping[str, object]) -> T:
    if _FILL_RECORDS and all(type(k) is str and type(v) in scalars for k, v in values.items()):
        return _filled_scalar_record(cls, values)
    return cls(dict(values))  # type: ignore[call-arg]


def _filled_scalar_record(cls: type[T], values: Mapping[str, object]) -> T:
    """``cls(dict(values))`` (a MetricRecord or ConfigRecord of checked
    values), its dict filled directly."""
    record = cls()
    record.__dict__["_data"].update(values)  # type: ignore[attr-defined]
    return record


def _filling_matches() -> bool:
    """Whether filling an Array's and the records' fields directly leaves
    exactly the objects Flower's constructors build, on this Flower version."""
    try:
        scalars = {"i": 3, "f": 0.5}
        for cls, values in ((MetricRecord, scalars), (ConfigRecord, {**scalars, "s": "x", "b": True})):
            if _filled_scalar_record(cls, values).__dict__ != cls(dict(values)).__dict__:
                return False
        data = b"".join((_npy_header("<f4", (2,)), np.arange(2, dtype=np.float32).view(np.uint8)))
        built, filled = _constructed_array("float32", (2,), data), _filled_array("float32", (2,), data)
        if type(built) is not type(filled) or built.__dict__ != filled.__dict__:
            return False
        items = [("a", built), ("b", _constructed_array("float32", (2,), data))]
        record, direct = _constructed_record(items), _filled_record(items)
        return (type(record) is type(direct) and record.__dict__ == direct.__dict__
                and list(record.items()) == list(direct.items()))
    except Exception:  # noqa: BLE001 - any surprise: use the constructors
        return False


def _content_filling_matches() -> bool:
    """Whether :func:`_filled_record_dict` leaves exactly the RecordDict
    Flower's constructor builds, on this Flower version."""
    try:
        scalars = {"i": 3, "f": 0.5}
        records = {"arrays": ArrayRecord(), "metrics": MetricRecord(scalars), "config": ConfigRecord(scalars)}
        content, filled = RecordDict(dict(records)), _filled_record_dict(records)
        if not (type(content) is type(filled) and content.__dict__ == filled.__dict__
                and list(content.items()) == list(filled.items())):
            return False
        # put_record's direct write: what __setitem__ leaves, a new key and a replaced one
        set_by_flower, set_direct = RecordDict(dict(records)), _filled_record_dict(records)
        for key, record in (("new", ConfigRecord({"s": "x"})), ("metrics", MetricRecord({"i": 4}))):
            set_by_flower[key] = record
            set_direct.__dict__["_data"][key] = record
        return (set_by_flower.__dict__ == set_direct.__dict__
                and list(set_by_flower.items()) == list(set_direct.items()))
    except Exception:  # noqa: BLE001 - any surprise: use the constructor
        return False


@lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)`` (``'float32'``), which NumPy builds anew on every call."""
    return str(dtype)


def from_tensor(tensor: torch.Tensor) -> Array:
    """An Array holding a tensor's values (copied to the CPU)."""
    return from_numpy(tensor.detach().cpu().numpy())


def record_to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Read-only NumPy views of every array of a record, in its order."""
    return {k: to_numpy(a) for k, a in record.items()}


def arrays_to_record(arrays: Iterable[tuple[str, Array]]) -> ArrayRecord:
    """An ArrayRecord holding these Arrays themselves, in order.

    ``ArrayRecord(dict_of_arrays)`` rebuilds every Array (Flower's
    ``from_array_dict``: 30 us each, as much as building it); filling an empty
    record (with ``__setitem__``'s checks) does not."""
    return _new_record(arrays)


def numpy_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of NumPy arrays (keys in the mapping's order)."""
    return arrays_to_record((k, from_numpy(v)) for k, v in arrays.items())


def records_of(content: RecordDict, kind: type[T]) -> dict[str, T]:
    """The records of one kind in a message's content, as a plain dict.

    ``content.array_records`` (and ``metric_records``, ``config_records``)
    builds a synced view that writes every record back into the RecordDict
    with its checks: 20 us per access, several accesses per reply and round.
    Read-only use needs none of that."""
    return {key: record for key, record in content.items() if isinstance(record, kind)}


def mean_of_records(records: Sequence[Mapping[str, Array | np.ndarray]],
                    weights: Sequence[float] | None = None,
                    dtype: type | np.dtype | None = None) -> dict[str, np.ndarray]:
    """The mean of model arrays over clients, key by key: the project's one
    weighted mean (every strategy's aggregation goes through it).

    ``weights`` None means unweighted (each ``1/n``). The order is Flower's
    ``aggregate_arrayrecords``: ``w_i = weight_i / sum(weights)`` as Python
    floats, ``acc = v_0 * w_0; acc += v_i * w_i`` in record order, so an
    example-weighted mean of float32 arrays is bit-identical to Flower's.
    ``dtype`` accumulates in that dtype (``np.float64`` for server state kept
    across rounds); None keeps each array's dtype. Flower ``Array`` values are
    read as zero-copy views (:func:`to_numpy`); rows of the cohort trainer's
    stacks (:class:`StackedRows`) where the stacks are (:func:`_mean_on_device`,
    :func:`_sum_of_rows`: the same bits; small rows a block at a time, 0.35
    instead of 0.6 ms for 100 uploads of the Synthetic MLP on a 2-core CPU).
    """
    if not records:
        raise ValueError("mean_of_records needs at least one record")
    raw = [1.0] * len(records) if weights is None else [float(w) for w in weights]
    if len(raw) != len(records):
        raise ValueError(f"{len(raw)} weights for {len(records)} records")
    total = sum(raw)
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    scales = [w / total for w in raw]
    found = _stack_rows(records)
    if (found is not None and not any(stack.on_device for stack in found[1])
            and (dtype is None or np.dtype(dtype) in _ACCUMULATE_ON_DEVICE)):
        # rows of stacks in host memory (a batched round's uploads on a CPU): each
        # row in the accumulating dtype times its scale rounded to it, as the loop's
        # array times a Python float (NumPy 2: in the array's dtype)
        means = {}
        for key, picked in found[0].items():
            mean = _sum_of_rows(picked, np.dtype(dtype) if dtype is not None else picked[0][0].host().dtype, scales)
            means[key] = mean[()] if mean.ndim == 0 else mean  # a 0-d mean as the loop's: a NumPy scalar
        return means
    on_device = _mean_on_device(records, scales, dtype, found) if found is not None else None
    if on_device is not None:
        return on_device
    acc: dict[str, np.ndarray] = {}
    for record, weight in zip(records, scales):
        for key, value in record.items():
            array = to_numpy(value) if isinstance(value, Array) else np.asarray(value)
            if dtype is not None:
                array = array.astype(dtype, copy=False)
            if key not in acc:
                acc[key] = array * weight
            else:
                acc[key] += array * weight
    return acc


def add_records(acc: dict[str, np.ndarray], records: Sequence[Mapping[str, Array | np.ndarray]]) -> None:
    """``acc[key] += value`` for every value of every record, record by record
    (in place, NumPy's rounding and casting of ``+=``): the server's sums of
    the replies' arrays (SCAFFOLD's ``sum dc_i``, Douglas-Rachford's
    ``sum g_i``). Rows of stacks in host memory (a batched round's replies)
    are read where they are, key by key (:func:`_sum_of_rows`), bit for bit
    the loop's sums, when every ``acc[key]`` is a plain writable ndarray of
    its own (no two keys' sums share memory: key by key would add in
    another order) of float32 or float64 that the rows cast to exactly."""
    if not records:
        return
    found = _stack_rows(records)
    columns = found[0] if found is not None and not any(stack.on_device for stack in found[1]) else None
    if columns is not None and all(
            key in acc and type(acc[key]) is np.ndarray and acc[key].flags.writeable
            and acc[key].shape == picked[0][0].host().shape[1:] and acc[key].dtype in _ACCUMULATE_ON_DEVICE
            and np.result_type(acc[key].dtype, picked[0][0].host().dtype) == acc[key].dtype
            for key, picked in columns.items()) and not any(
            np.may_share_memory(acc[a], acc[b]) for i, a in enumerate(columns) for b in list(columns)[i + 1:]):
        for key, picked in columns.items():
            _sum_of_rows(picked, acc[key].dtype, None, acc[key])
        return
    for record in records:
        for key, value in record.items():
            acc[key] += to_numpy(value) if isinstance(value, Array) else np.asarray(value)


def sequential_sum(rows: np.ndarray) -> np.ndarray:
    """``rows[0] + rows[1] + ... + rows[n-1]`` in that order, elementwise
    (``[n, ...]`` -> ``[...]``): what ``acc = rows[0]; acc += rows[i]``
    gives, bit for bit, in one pass. NumPy's ``add.reduce`` over axis 0 of a
    C-contiguous ``[n, m]`` array (m >= 2) adds the rows in order, one
    elementwise add per row; over a 1-d array it sums pairwise (another
    order), so a row of one value is padded to two. It starts from
    ``initial``: -0.0, the one value that adds as nothing (its default, 0.0,
    turns a sum of negative zeros into +0.0).
    tests/test_arrays.py checks both on values where the orders differ."""
    rows = np.ascontiguousarray(rows)
    n, shape = rows.shape[0], rows.shape[1:]
    flat = rows.reshape(n, math.prod(shape))
    if flat.shape[1] == 1:
        flat = np.concatenate([flat, np.zeros_like(flat)], axis=1)
    return np.add.reduce(flat, axis=0, initial=-0.0)[:math.prod(shape)].reshape(shape)


SUM_BLOCK_BYTES = 1 << 20  # the rows _sum_of_rows copies at a time (in the accumulating dtype)
BLOCK_ROW_VALUES = 2048  # rows of at most this many values are summed a block at a time


def _sum_of_rows(picked: list[tuple[StackedRows, int]], into: np.dtype, scales: list[float] | None,
                 start: np.ndarray | None = None) -> np.ndarray:
    """``start + s_0 r_0 + s_1 r_1 + ...`` in that order, in dtype ``into``
    (``r_i`` row ``picked[i][1]`` of stack ``picked[i][0]``, cast to
    ``into`` within the product; ``s_i`` ``scales[i]`` rounded to ``into``,
    or no product where ``scales`` is None; no ``start``: from ``s_0 r_0``),
    the loop's sum bit for bit. With ``start`` the sum is written into it
    (it is the caller's ``acc``); without, it is a new array.

    Rows of 2 to :data:`BLOCK_ROW_VALUES` values (the small models' layers,
    where one NumPy call per row costs more than its arithmetic) are copied
    a block of rows at a time (each temporary at most about
    :data:`SUM_BLOCK_BYTES`: one indexed copy of a run of one stack's rows,
    its product, and the block with the sum so far as its first row) and
    summed by :func:`sequential_sum`, each block's sum the next block's
    first row: 0.35 instead of 0.6 ms for 100 clients of the Synthetic MLP.
    Larger rows and 1-value rows are added one at a time, as the loop adds
    them (blocks were slower for large rows: 8,192-value rows 0.57 against
    0.38 ms, a CNN's 1.6M-value layer about 3.5 times as slow; a 1-value
    row padded to two would give a NaN another payload than the loop's
    scalar addition)."""
    values = int(picked[0][0].host()[0].size)
    if values == 1 or values > BLOCK_ROW_VALUES:
        return _sum_row_by_row(picked, into, scales, start)
    acc = start
    per_block = max(1, SUM_BLOCK_BYTES // (values * into.itemsize))
    at = 0
    while at < len(picked):
        stack, end = picked[at][0], at + 1
        while end < len(picked) and picked[end][0] is stack and end - at < per_block:
            end += 1
        block = stack.host()[[row for _, row in picked[at:end]]]
        if scales is not None:
            scale = np.asarray(scales[at:end], dtype=into).reshape((-1,) + (1,) * (block.ndim - 1))
            block = np.multiply(block, scale, dtype=into)
        if acc is not None:
            block = np.concatenate([acc[None], block], dtype=into)
        acc = sequential_sum(block)
        at = end
    if start is not None:
        start[...] = acc
        return start
    return acc


def _sum_row_by_row(picked: list[tuple[StackedRows, int]], into: np.dtype, scales: list[float] | None,
                    start: np.ndarray | None) -> np.ndarray:
    """:func:`_sum_of_rows` one row at a time, the loop's own steps:
    ``acc = r_0.astype(into) * s_0``, then ``acc += r_i.astype(into) * s_i``
    (``acc += r_i`` without scales), into ``start`` in place when given."""
    acc = start
    for i, (stack, row) in enumerate(picked):
        value = stack.host()[row, ...]
        if scales is not None:
            value = value.astype(into, copy=False) * into.type(scales[i])
        if acc is None:
            acc = np.array(value, dtype=into)
        else:
            acc += value
    return acc


def _stack_rows(records: Sequence[Mapping[str, Array | np.ndarray]]
                ) -> tuple[dict[str, list[tuple[StackedRows, int]]], list[StackedRows]] | None:
    """For each key, the ``(stack, row)`` of its value in each record, in
    record order, and the distinct stacks, where every array of every record
    is a row of a :class:`StackedRows` of float32 or float64, one dtype and
    shape per key, holding at least one value, with the same keys in the
    same order in every record; else None (the caller's loop). The stacks
    may live on the host or on a device (the caller decides where to sum).
    Written by hand: Flower's Arrays are bytes of their own."""
    keys = list(records[0].keys())
    picks: dict[str, list[tuple[StackedRows, int]]] = {key: [] for key in keys}
    appends = [picks[key].append for key in keys]
    stacks: dict[int, StackedRows] = {}
    for record in records:
        if list(record.keys()) != keys:
            return None
        for append, value in zip(appends, record.values()):
            if type(value) is not DeferredArray:
                return None
            fields = value.__dict__
            rows = fields.get("_rows")
            if rows is None:  # its data was replaced: its own values
                return None
            stacks[id(rows)] = rows
            append((rows, fields["_row"]))
    if any(rows.tensor.dtype not in _DEVICE_MEAN_DTYPES for rows in stacks.values()):
        return None
    for picked in picks.values():
        kinds = {(stacks[i].tensor.dtype, tuple(stacks[i].tensor.shape[1:])) for i in {id(s) for s, _ in picked}}
        if len(kinds) != 1 or math.prod(next(iter(kinds))[1]) == 0:
            return None
    return picks, list(stacks.values())


_ACCUMULATE_ON_DEVICE = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
_DEVICE_MEAN_DTYPES = tuple(_ACCUMULATE_ON_DEVICE.values())  # IEEE products and sums, as NumPy's


def _mean_on_device(records: Sequence[Mapping[str, Array | np.ndarray]], scales: list[float],
                    dtype: type | np.dtype | None,
                    found: tuple[dict[str, list[tuple[StackedRows, int]]], list[StackedRows]] | None = None
                    ) -> dict[str, np.ndarray] | None:
    """:func:`mean_of_records` on the device of the stacks the records' arrays
    are rows of (:class:`StackedRows` off the host: a GPU), bit for bit the
    NumPy loop's result: ``acc = v_0 * s_0; acc += v_i * s_i`` in record
    order, each scale rounded to the accumulating dtype as NumPy rounds a
    Python float, a product and a sum per client in IEEE arithmetic. Only
    the mean crosses to the host. None (the NumPy loop) unless the records
    are rows of stacks (:func:`_stack_rows`) that all live on one device.
    ``found``: :func:`_stack_rows` of the records, when the caller has it
    (:func:`mean_of_records` walks them once)."""
    found = _stack_rows(records) if found is None else found
    accumulate_in = None if dtype is None else _ACCUMULATE_ON_DEVICE.get(np.dtype(dtype))
    if found is None or (dtype is not None and accumulate_in is None):
        return None
    picks, stacks = found
    if not all(stack.on_device for stack in stacks) or len({stack.tensor.device for stack in stacks}) != 1:
        return None
    device = stacks[0].tensor.device
    means: dict[str, np.ndarray] = {}
    for key, picked in picks.items():
        target = accumulate_in or picked[0][0].tensor.dtype
        weights = torch.tensor(scales, dtype=target, device=device)
        acc = None
        for i, (stack, row) in enumerate(picked):
            product = stack.tensor[row].to(target) * weights[i]
            if acc is None:
                acc = product
            else:
                acc += product
        means[key] = acc.cpu().numpy()
    return means


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """An ArrayRecord of tensors (copied to the CPU)."""
    return arrays_to_record((k, from_tensor(v)) for k, v in tensors.items())


def load_into(model: torch.nn.Module, record: ArrayRecord) -> None:
    """Copy a record's arrays into ``model``'s parameters and buffers in place.

    ``model.load_state_dict`` with one copy per tensor (NumPy view -> CPU
    parameter) instead of two; a record whose keys or shapes differ from the
    model's goes through ``load_state_dict`` itself, for its error message.
    """
    state = model.state_dict()
    views = [to_numpy(a) for a in record.values()]
    if list(record.keys()) != list(state.keys()) or any(
            v.shape != tuple(t.shape) for v, t in zip(views, state.values())):
        model.load_state_dict(record_to_tensors(record))  # raises: missing/unexpected keys, sizes
        return
    with torch.no_grad():
        for target, values in zip(state.values(), views):
            if target.device.type == "cpu" and values.dtype == _numpy_dtype(target.dtype):
                np.copyto(target.numpy(), values)  # the tensor's own memory
            else:
                target.copy_(torch.from_numpy(values.copy()))


@lru_cache(maxsize=64)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)
    except TypeError:  # bfloat16 and friends have no NumPy dtype
        return None


def record_to_tensors(record: ArrayRecord, device: torch.device | str = "cpu") -> OrderedDict[str, torch.Tensor]:
    """Fresh, writable tensors on ``device`` from a record."""
    return OrderedDict((k, torch.from_numpy(to_numpy(a).copy()).to(device)) for k, a in record.items())


# Filled directly where that is checked to equal Flower's constructors (module docstring).
_FILL_RECORDS = _filling_matches()
_FILL_CONTENT = _content_filling_matches()
if _FILL_RECORDS:
    _new_array, _new_record = _filled_array, _filled_record
else:  # pragma: no cover - a Flower version whose objects hold other fields
    _new_array, _new_record = _constructed_array, _constructed_record
