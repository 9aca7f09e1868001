"""The fast Array codecs (fedaccel.arrays) against Flower's own conversions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

import fedaccel.arrays as arrays_module
from fedaccel.arrays import (DeferredArray, StackedRows, all_finite, arrays_to_record,
                             deferred_row, from_numpy, from_tensor, mean_of_records, payload_size,
                             record_to_tensors, tensors_to_record, to_numpy)
from fedaccel.checkpoint import record_dict_bytes, record_dict_from_bytes
from fedaccel.strategies.server_steps import weighted_mean_of_replies

SAMPLES = [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.array(2.5),  # 0-d
    np.arange(5, dtype=np.int64),
    np.ones((3, 0, 2), np.float16),
    np.array([True, False]),
    np.arange(6, dtype=np.float64).reshape(2, 3).T,  # Fortran order
    np.arange(40, dtype=np.float32).reshape(4, 10)[:, ::2],  # not contiguous
    np.arange(4, dtype=np.complex64),
]


@pytest.mark.parametrize("values", SAMPLES, ids=lambda a: f"{a.dtype}{a.shape}")
def test_from_numpy_writes_the_bytes_flower_writes_and_to_numpy_reads_them(values):
    ours, flowers = from_numpy(values), Array(values)
    assert (ours.dtype, ours.shape, ours.stype, ours.data) == \
        (flowers.dtype, flowers.shape, flowers.stype, flowers.data)
    back = to_numpy(flowers)
    assert back.dtype == values.dtype and back.shape == values.shape
    np.testing.assert_array_equal(back, values)
    np.testing.assert_array_equal(back, flowers.numpy())
    # the whole object, not only its fields: what Flower's constructor leaves
    assert type(ours) is Array and ours.__dict__ == flowers.__dict__
    assert ours.object_id == flowers.object_id  # the content hash Flower's transport uses


def test_a_record_filled_directly_is_the_record_flowers_setitem_builds():
    arrays = [(f"k{i}", from_numpy(v)) for i, v in enumerate(SAMPLES)]
    ours = arrays_to_record(arrays)
    flowers = ArrayRecord()
    for key, array in arrays:
        flowers[key] = array
    assert ours.__dict__ == flowers.__dict__ and list(ours.keys()) == [k for k, _ in arrays]
    assert ours.object_id == flowers.object_id
    # and it travels: Flower's protobuf round trip gives the same record back
    back = record_dict_from_bytes(record_dict_bytes(RecordDict({"arrays": ours})))["arrays"]
    assert list(back.keys()) == list(ours.keys())
    for key in ours:
        assert back[key].__dict__["data"] == ours[key].data


@pytest.mark.parametrize("key, value", [(3, "array"), ("a", np.ones(2))])
def test_a_record_filled_directly_refuses_what_flower_refuses(key, value):
    value = from_numpy(np.ones(2)) if isinstance(value, str) else value
    with pytest.raises(TypeError) as ours:
        arrays_to_record([(key, value)])
    with pytest.raises(TypeError) as flowers:
        ArrayRecord()[key] = value
    assert str(ours.value) == str(flowers.value)


@pytest.mark.parametrize("build, cls, values", [
    ("metric_record", MetricRecord, {"num-examples": 12, "train-loss": 0.25}),
    ("metric_record", MetricRecord, {"curve": [0.5, 0.25], "n": 3}),  # a list: the constructor's path
    ("metric_record", MetricRecord, {"x": np.float64(0.5)}),  # a NumPy scalar: the constructor's path
    ("config_record", ConfigRecord, {"lr": 0.1, "name": "x", "flag": True, "blob": b"ab", "epochs": 2}),
    ("config_record", ConfigRecord, {"layout": "[]", "sizes": [1, 2]}),
])
def test_scalar_records_are_the_records_flowers_constructors_build(build, cls, values):
    ours = getattr(arrays_module, build)(values)
    assert type(ours) is cls and ours.__dict__ == cls(dict(values)).__dict__
    assert ours.object_id == cls(dict(values)).object_id


@pytest.mark.parametrize("build, cls, values", [
    ("metric_record", MetricRecord, {"ok": 1, "flag": True}),  # MetricRecord refuses bool
    ("metric_record", MetricRecord, {"name": "x"}),
    ("config_record", ConfigRecord, {"obj": object()}),
    ("config_record", ConfigRecord, {3: 1}),
])
def test_scalar_records_refuse_what_flower_refuses(build, cls, values):
    with pytest.raises(TypeError) as ours:
        getattr(arrays_module, build)(values)
    with pytest.raises(TypeError) as flowers:
        cls(dict(values))
    assert str(ours.value) == str(flowers.value)


def test_a_record_dict_is_the_one_flowers_constructor_builds():
    """``record_dict``: the RecordDict Flower's constructor builds (fields,
    items in order, the records themselves); what Flower refuses (a record
    of another kind, a key that is not a ``str``) raises Flower's own
    ``TypeError``."""
    records = {"arrays": ArrayRecord({"w": Array(np.ones(2, dtype=np.float32))}),
               "metrics": MetricRecord({"num-examples": 3}), "config": ConfigRecord({"lr": 0.1})}
    ours, flowers = arrays_module.record_dict(records), RecordDict(dict(records))
    assert type(ours) is RecordDict and ours.__dict__ == flowers.__dict__
    assert list(ours.items()) == list(flowers.items()) and ours["arrays"] is records["arrays"]
    assert arrays_module._content_filling_matches()
    for bad in ({"x": {"not": "a record"}}, {3: MetricRecord({"n": 1})}):
        with pytest.raises(TypeError) as ours_error:
            arrays_module.record_dict(bad)
        with pytest.raises(TypeError) as flowers_error:
            RecordDict(dict(bad))
        assert str(ours_error.value) == str(flowers_error.value)


def test_filling_is_checked_against_flowers_constructors(monkeypatch):
    """The direct filling is used only where it equals the constructors: an
    Array whose constructor leaves another field makes the check fail."""
    assert arrays_module._filling_matches()
    original = Array.__init__

    def with_extra_field(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.__dict__["_new_in_some_version"] = 1
    monkeypatch.setattr(Array, "__init__", with_extra_field)
    assert not arrays_module._filling_matches()
    monkeypatch.undo()
    assert arrays_module._filling_matches()
    # records start from their own empty constructor, so what matters there is
    # a field their __setitem__ would set (as ArrayRecord's sets _is_dirty)
    original_setitem = MetricRecord.__setitem__

    def setitem_with_extra_field(self, key, value):
        original_setitem(self, key, value)
        self.__dict__["_new_in_some_version"] = 1
    monkeypatch.setattr(MetricRecord, "__setitem__", setitem_with_extra_field)
    assert not arrays_module._filling_matches()
    monkeypatch.undo()
    original_init = RecordDict.__init__

    def content_with_extra_field(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if args and args[0]:  # filled through the constructor only
            self.__dict__["_new_in_some_version"] = 1
    monkeypatch.setattr(RecordDict, "__init__", content_with_extra_field)
    assert not arrays_module._content_filling_matches() and arrays_module._filling_matches()


def test_put_record_leaves_what_flowers_setitem_leaves(monkeypatch, caplog):
    """``put_record``: a new key and a replaced record of the same kind as
    Flower's ``__setitem__`` leaves them (fields, order, the records
    themselves); a record of another kind replacing one goes through Flower
    (its warning), and what Flower refuses raises its own ``TypeError``. A
    ``__setitem__`` that leaves another field turns the direct write off."""
    def pair():
        records = {"a": ConfigRecord({"s": "x"}), "b": MetricRecord({"n": 1})}
        return RecordDict(dict(records)), RecordDict(dict(records))
    ours, flowers = pair()
    for key, record in (("c", ArrayRecord()), ("a", ConfigRecord({"s": "y"})), ("b", MetricRecord({"n": 2}))):
        arrays_module.put_record(ours, key, record)
        flowers[key] = record
        assert ours.__dict__ == flowers.__dict__ and list(ours.items()) == list(flowers.items())
        assert ours[key] is record
    ours, flowers = pair()
    with caplog.at_level("WARNING", logger="flwr"):
        arrays_module.put_record(ours, "a", MetricRecord({"n": 3}))  # another kind: Flower's warning
    assert "was overwritten" in caplog.text and isinstance(ours["a"], MetricRecord)
    for key, bad in ((3, ConfigRecord({"s": "x"})), ("x", {"not": "a record"})):
        with pytest.raises(TypeError) as ours_error:
            arrays_module.put_record(ours, key, bad)
        with pytest.raises(TypeError) as flowers_error:
            flowers[key] = bad
        assert str(ours_error.value) == str(flowers_error.value)
    original = RecordDict.__setitem__

    def setitem_marking_replacements(self, key, value):  # the constructor's own items are new keys
        replaces = key in self
        original(self, key, value)
        if replaces:
            self.__dict__["_replaced"] = key
    assert arrays_module._content_filling_matches()
    monkeypatch.setattr(RecordDict, "__setitem__", setitem_marking_replacements)
    assert not arrays_module._content_filling_matches()


def deferred_of(values: np.ndarray):
    """``values`` as the one row of a stack (sharing its memory)."""
    return deferred_row(StackedRows(torch.from_numpy(values)[None]), 0)


@pytest.mark.parametrize("values", SAMPLES, ids=lambda a: f"{a.dtype}{a.shape}")
def test_a_deferred_array_is_from_numpys_array_and_writes_its_bytes_only_when_read(values):
    import copy
    import pickle

    flowers, deferred = Array(values), deferred_of(values)
    if not values.flags.c_contiguous:  # nothing to defer: from_numpy's Array itself
        assert type(deferred) is Array and deferred.data == flowers.data
        return
    assert type(deferred) is DeferredArray and isinstance(deferred, Array)
    assert (deferred.dtype, deferred.shape, deferred.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    view = to_numpy(deferred)  # the values themselves, read-only: no bytes written
    np.testing.assert_array_equal(view, values)
    assert not view.flags.writeable and values.flags.writeable
    assert np.shares_memory(view, values) or values.size == 0
    assert payload_size(deferred) == len(flowers.data) == payload_size(flowers)
    assert "_payload" not in deferred.__dict__
    assert deferred == flowers and flowers == deferred and deferred != from_numpy(np.zeros(1, values.dtype))
    assert "_payload" in deferred.__dict__  # comparing read the bytes
    assert deferred.data == flowers.data and deferred.object_id == flowers.object_id
    for twin in (copy.copy(deferred), copy.deepcopy(deferred), pickle.loads(pickle.dumps(deferred))):
        assert type(twin) is Array and twin.data == flowers.data and twin == flowers
    # Flower's transport: deflated and inflated in a message's content
    content = RecordDict({"arrays": ArrayRecord({"w": deferred_of(values)})})
    back = record_dict_from_bytes(record_dict_bytes(content))
    assert back["arrays"]["w"] == flowers


def test_setting_a_deferred_arrays_data_replaces_its_values():
    deferred = deferred_of(np.arange(3, dtype=np.float32))
    other = from_numpy(np.full(3, 7.0, np.float32))
    deferred.data = other.data
    assert deferred.is_dirty and deferred == other
    np.testing.assert_array_equal(to_numpy(deferred), np.full(3, 7.0, np.float32))


STACKS = [
    torch.arange(24, dtype=torch.float32).reshape(3, 2, 4) / 7,
    torch.arange(3, dtype=torch.float64) / 3,  # each row 0-d
    torch.arange(12, dtype=torch.int64).reshape(3, 4),
    torch.ones((3, 0, 2), dtype=torch.float16),
    torch.arange(6, dtype=torch.float32).reshape(3, 2).to(torch.complex64),
]


@pytest.mark.parametrize("stack", STACKS, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_a_row_of_a_stack_is_from_numpys_array_of_that_row(stack):
    """``deferred_row``: the fields and bytes ``from_numpy`` gives the row,
    its values a read-only view of the stack (no copy on a CPU), the same
    payload size, and ``data`` set replaces the values."""
    rows = StackedRows(stack)
    for row in range(stack.shape[0]):
        expected, deferred = from_numpy(stack[row].numpy()), deferred_row(rows, row)
        assert type(deferred) is DeferredArray
        assert (deferred.dtype, deferred.shape, deferred.stype) == (expected.dtype, expected.shape, expected.stype)
        assert payload_size(deferred) == len(expected.data) and "_payload" not in deferred.__dict__
        view = to_numpy(deferred)
        np.testing.assert_array_equal(view, stack[row].numpy())
        assert not view.flags.writeable and (np.shares_memory(view, stack.numpy()) or view.size == 0)
        assert deferred == expected and deferred.data == expected.data
    replaced = deferred_row(rows, 0)
    replaced.data = from_numpy(np.zeros(tuple(stack.shape[1:]), stack.numpy().dtype)).data
    assert "_rows" not in replaced.__dict__ and not to_numpy(replaced).any()


def test_all_finite_reads_a_stacks_rows_in_one_pass_and_other_arrays_with_numpy():
    stack = torch.zeros(5, 3)
    stack[1, 2], stack[3, 0] = float("nan"), float("-inf")
    stack[4] = 3e38  # finite values whose sum overflows: still a finite row
    rows = StackedRows(stack)
    assert [all_finite(deferred_row(rows, r)) for r in range(5)] == [True, False, True, False, True]
    assert rows._finite is not None and rows._host is None  # flags from the stack, no NumPy copy made
    assert [all_finite(from_numpy(stack[r].numpy())) for r in range(5)] == [True, False, True, False, True]
    assert all_finite(deferred_row(StackedRows(torch.zeros(2, 0)), 1))
    assert all_finite(from_numpy(np.arange(3)))
    assert all_finite(deferred_row(StackedRows(torch.ones(2, 3, dtype=torch.int32)), 0))
    replaced = deferred_row(rows, 1)  # data replaced: its own values count, not the stack's flag
    replaced.data = from_numpy(np.zeros(3, np.float32)).data
    assert all_finite(replaced)


@pytest.fixture
def stacks_on_device(monkeypatch):
    """CPU stacks that say they live on a device: the device mean runs on the CPU."""
    monkeypatch.setattr(StackedRows, "on_device", property(lambda self: True))


def _stacked_records(generator: torch.Generator, clients: int, dtype=torch.float32) -> tuple[list, list]:
    """The same clients' arrays as rows of stacks and as plain Arrays of those rows."""
    stacks = {"w": torch.randn(clients, 5, 3, generator=generator, dtype=dtype),
              "b": torch.randn(clients, 3, generator=generator, dtype=dtype)}
    rows = {k: StackedRows(t) for k, t in stacks.items()}
    stacked = [{k: deferred_row(rows[k], c) for k in stacks} for c in range(clients)]
    plain = [{k: from_numpy(t[c].numpy()) for k, t in stacks.items()} for c in range(clients)]
    return stacked, plain


@pytest.mark.parametrize("accumulate", [None, np.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_mean_on_the_stacks_device_is_numpys_mean_bit_for_bit(stacks_on_device, dtype, accumulate):
    """``mean_of_records`` over rows of stacks off the host sums on the
    stacks' device in the NumPy loop's order and rounding: the same bits as
    over plain Arrays of the same values (example weights, uniform, and the
    float64 accumulation of server state), with no host copy of a stack."""
    generator = torch.Generator().manual_seed(3)
    stacked, plain = _stacked_records(generator, 37, dtype)
    weights = [float(n) for n in torch.randint(1, 500, (37,), generator=generator)]
    for w in (weights, None):
        got, expected = mean_of_records(stacked, w, accumulate), mean_of_records(plain, w, accumulate)
        assert list(got) == list(expected)
        for key in expected:
            assert got[key].dtype == expected[key].dtype and got[key].tobytes() == expected[key].tobytes(), key
    assert all(a._rows._host is None for record in stacked for a in record.values())


def test_the_device_mean_is_not_numpys_sum_in_another_order(stacks_on_device, monkeypatch):
    """The check above can fail: summed all at once (another order) the same
    records differ from NumPy's loop in the last bits."""
    generator = torch.Generator().manual_seed(3)
    stacked, plain = _stacked_records(generator, 37)
    weights = [float(n) for n in torch.randint(1, 500, (37,), generator=generator)]

    def summed_at_once(records, scales, dtype, found=None):
        if type(records[0]["w"]) is not DeferredArray:
            return None
        columns = {k: torch.stack([r[k]._rows.tensor[r[k]._row] for r in records]) for k in records[0]}
        w = torch.tensor(scales, dtype=torch.float32)
        return {k: (t * w.reshape(-1, *[1] * (t.dim() - 1))).sum(0).numpy() for k, t in columns.items()}

    monkeypatch.setattr(arrays_module, "_mean_on_device", summed_at_once)
    got, expected = mean_of_records(stacked, weights), mean_of_records(plain, weights)
    assert any(got[k].tobytes() != expected[k].tobytes() for k in expected)


def test_the_device_mean_falls_back_to_numpy_for_anything_else(stacks_on_device, monkeypatch):
    """Rows mixed with plain Arrays, another dtype, or CPU stacks: the NumPy
    loop (which copies the stacks to the host)."""
    generator = torch.Generator().manual_seed(5)
    stacked, plain = _stacked_records(generator, 4)
    ints = [{"w": deferred_row(StackedRows(torch.arange(8).reshape(4, 2)), c)} for c in range(4)]
    for records in (stacked[:2] + plain[2:], ints, [dict(reversed(list(r.items()))) for r in stacked[:1]] + stacked[1:]):
        assert arrays_module._mean_on_device(records, [0.25] * 4, None) is None
    assert arrays_module._mean_on_device(stacked, [0.25] * 4, np.longdouble) is None  # accumulated on the host
    monkeypatch.setattr(StackedRows, "on_device", property(lambda self: False))
    assert arrays_module._mean_on_device(stacked, [0.25] * 4, None) is None
    got, expected = mean_of_records(stacked, None), mean_of_records(plain, None)
    assert all(got[k].tobytes() == expected[k].tobytes() for k in expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accumulate", [None, np.float64])
def test_the_mean_on_a_gpu_is_numpys_mean_bit_for_bit(accumulate):
    """On a real GPU: the mean of stacks kept there (the cohort trainer's
    uploads of a one-chunk round) is the NumPy loop's, to the bit, and the
    stacks are never copied to the host; the finite flags are the same.
    Except a NaN's own bits: CUDA's arithmetic writes its one canonical NaN
    (0x7fffffff in float32), where the CPU carries the input NaN's sign and
    payload (0x7fc00000 here); measured on an H200. Such a mean is never
    used (the server's finite check rejects the reply first)."""
    generator = torch.Generator().manual_seed(7)
    stacks = {"w": torch.randn(300, 64, 33, generator=generator), "b": torch.randn(300, 33, generator=generator)}
    stacks["b"][17, 3] = float("nan")
    on_gpu = {k: StackedRows(t.cuda()) for k, t in stacks.items()}
    stacked = [{k: deferred_row(on_gpu[k], c) for k in stacks} for c in range(300)]
    plain = [{k: from_numpy(t[c].numpy()) for k, t in stacks.items()} for c in range(300)]
    weights = [float(n) for n in torch.randint(1, 500, (300,), generator=generator)]
    got, expected = mean_of_records(stacked, weights, accumulate), mean_of_records(plain, weights, accumulate)
    for k in expected:
        bits = np.uint32 if expected[k].dtype == np.float32 else np.uint64
        nan = np.isnan(expected[k])
        assert np.array_equal(np.isnan(got[k]), nan)
        assert np.array_equal(got[k].view(bits)[~nan], expected[k].view(bits)[~nan]), k
    assert np.isnan(expected["b"]).any()  # the NaN reached the mean, so its bits were compared by position
    assert [all_finite(r["b"]) for r in stacked] == [all_finite(r["b"]) for r in plain]
    assert all(rows._host is None for rows in on_gpu.values())


def _host_chunks(generator: torch.Generator, clients: int, dtype=torch.float32) -> tuple[list, list]:
    """Clients' arrays as rows of two host stacks (two chunks of a round),
    in an order that mixes them and skips rows, and as plain Arrays of the
    same values: a small array (summed a block of rows at a time), a
    1-value and a 0-d one and one larger than ``BLOCK_ROW_VALUES`` (summed
    row by row), magnitudes far apart, and NaNs of different signs and
    payloads and infinities in some rows."""
    half = clients // 2
    big = arrays_module.BLOCK_ROW_VALUES + 5
    chunks = [{"w": torch.randn(n, 5, 3, generator=generator, dtype=dtype) * torch.exp(
                   torch.randn(n, 1, 1, generator=generator, dtype=dtype) * 6),
               "one": torch.randn(n, 1, generator=generator, dtype=dtype) * 1e4,
               "scalar": torch.randn(n, generator=generator, dtype=dtype),
               "big": torch.randn(n, big, generator=generator, dtype=dtype),
               "edge": torch.randn(n, arrays_module.BLOCK_ROW_VALUES, generator=generator, dtype=dtype)}
              for n in (half + 1, clients - half + 1)]
    bits = np.uint32 if dtype == torch.float32 else np.uint64
    width = 32 if dtype == torch.float32 else 64
    nans = [bits(0xFFC00000 if width == 32 else 0xFFF8000000000000),  # -NaN
            bits(0x7FC00001 if width == 32 else 0x7FF8000000000001)]  # a NaN with a payload
    for chunk in chunks:
        for key in ("w", "one", "scalar", "big"):
            flat = chunk[key].numpy().reshape(len(chunk[key]), -1).view(bits)
            flat[1, 0], flat[2, 0] = nans  # -NaN and a NaN with a payload, in two clients' rows
            planted = chunk[key].numpy().reshape(len(chunk[key]), -1)[1:3, 0]
            assert np.isnan(planted).all() and np.signbit(planted).tolist() == [True, False]
        chunk["w"][3, 0, 1] = float("inf")
        chunk["big"][4, 7] = float("-inf")
    rows = [{k: StackedRows(t) for k, t in chunk.items()} for chunk in chunks]
    order = [(0, r) for r in range(half, -1, -2)] + [(1, r) for r in range(clients - half)] + [(0, r)
                                                                                                 for r in range(1, half, 2)]
    stacked = [{k: deferred_row(rows[c][k], r) for k in chunks[c]} for c, r in order]
    plain = [{k: from_numpy(chunks[c][k][r].numpy()) for k in chunks[c]} for c, r in order]
    return stacked, plain


def _same_as_the_loop(got: dict, expected: dict) -> None:
    """The same keys, types, dtypes, shapes and bytes (NaN payloads included)."""
    assert list(got) == list(expected)
    for key, want in expected.items():
        assert type(got[key]) is type(want), key
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        assert np.asarray(got[key]).tobytes() == np.asarray(want).tobytes(), key


@pytest.mark.parametrize("block_bytes", [arrays_module.SUM_BLOCK_BYTES, 100])
@pytest.mark.parametrize("accumulate", [None, np.float64, np.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_mean_of_host_stacks_is_the_loops_mean_bit_for_bit(dtype, accumulate, block_bytes, monkeypatch):
    """Rows of stacks in host memory (a batched round's uploads on a CPU)
    are averaged a block of rows at a time, in record order: the same bits
    as the record-by-record loop over plain Arrays, across two stacks, rows
    out of order, example weights and uniform, in one block per stack run
    and in blocks of a few rows; the loop's per-record reads are not made."""
    monkeypatch.setattr(arrays_module, "SUM_BLOCK_BYTES", block_bytes)
    generator = torch.Generator().manual_seed(11)
    stacked, plain = _host_chunks(generator, 101, dtype)
    weights = [float(n) for n in torch.randint(1, 500, (len(plain),), generator=generator)]
    expected = {w is None: mean_of_records(plain, w, accumulate) for w in (weights, None)}
    assert np.isnan(expected[True]["w"]).any() and np.isinf(expected[True]["big"]).any()
    monkeypatch.setattr(arrays_module, "to_numpy", lambda a: pytest.fail("read record by record"))
    for w in (weights, None):
        _same_as_the_loop(mean_of_records(stacked, w, accumulate), expected[w is None])


def test_sequential_sum_adds_rows_in_order_where_numpys_sum_would_not():
    """A column of one value per row: NumPy's own sum over it is pairwise
    (another order, other bits on these values); ``sequential_sum`` adds
    row after row, as the loop does, for one value and for many, and keeps
    a lone negative zero."""
    from fedaccel.arrays import sequential_sum

    rng = np.random.default_rng(4)
    for shape in [(1000,), (1000, 1), (1000, 2), (300, 4, 3)]:
        rows = rng.standard_normal(shape).astype(np.float32)
        acc = rows[0].copy()
        for row in rows[1:]:
            acc += row
        got = sequential_sum(rows)
        assert got.shape == shape[1:] and got.tobytes() == acc.tobytes(), shape
        if shape == (1000,):
            assert np.add.reduce(rows).tobytes() != acc.tobytes()  # so the check can fail
    assert np.signbit(sequential_sum(np.full((3, 2), -0.0))).all()


@pytest.mark.parametrize("block_bytes", [arrays_module.SUM_BLOCK_BYTES, 100])
@pytest.mark.parametrize("acc_dtype,dtype", [(np.float64, torch.float32), (np.float32, torch.float32),
                                             (np.float64, torch.float64)])
def test_add_records_is_the_loops_sum_bit_for_bit(acc_dtype, dtype, block_bytes, monkeypatch):
    """``acc += value`` record by record (SCAFFOLD's float64 sum of float32
    ``dc_i``, Douglas-Rachford's float32 sum): over rows of host stacks the
    same bits as the loop over plain Arrays, from a starting sum that is not
    zero (and negative zeros), in place, in one block and in several."""
    from fedaccel.arrays import add_records

    monkeypatch.setattr(arrays_module, "SUM_BLOCK_BYTES", block_bytes)

    generator = torch.Generator().manual_seed(12)
    stacked, plain = _host_chunks(generator, 64, dtype)
    start = {"w": np.full((5, 3), -0.0, acc_dtype), "one": np.array([2.5], acc_dtype),
             "scalar": np.array(-0.0, acc_dtype), "big": np.linspace(-1, 1, arrays_module.BLOCK_ROW_VALUES + 5,
                                                                     dtype=acc_dtype),
             # a view of every other value of a larger array: written through, as the loop's +=
             "edge": np.linspace(-2, 2, 2 * arrays_module.BLOCK_ROW_VALUES, dtype=acc_dtype)[::2]}
    expected = {k: v.copy() for k, v in start.items()}
    for record in plain:
        for key, value in record.items():
            expected[key] += value.numpy()
    got = {k: v.copy() for k, v in start.items()}
    base = np.linspace(-2, 2, 2 * arrays_module.BLOCK_ROW_VALUES, dtype=acc_dtype)
    got["edge"] = base[::2]
    kept = dict(got)
    monkeypatch.setattr(arrays_module, "to_numpy", lambda a: pytest.fail("read record by record"))
    add_records(got, stacked)
    _same_as_the_loop(got, expected)
    assert all(got[key] is kept[key] for key in kept)  # in place, as the loop's +=
    assert base[::2].tobytes() == expected["edge"].tobytes()


def test_add_records_falls_back_to_the_loop_where_a_column_would_round_otherwise():
    """float64 rows into a float32 sum (NumPy adds in float64 and rounds each
    step), rows mixed with plain Arrays: the loop, the loop's bits."""
    from fedaccel.arrays import add_records

    generator = torch.Generator().manual_seed(13)
    stacked, plain = _host_chunks(generator, 20, torch.float64)
    for records in (stacked, stacked[:3] + plain[3:]):
        got = {"w": np.zeros((5, 3), np.float32), "one": np.zeros(1, np.float32), "scalar": np.float32(0),
               "big": np.zeros(arrays_module.BLOCK_ROW_VALUES + 5, np.float32),
               "edge": np.zeros(arrays_module.BLOCK_ROW_VALUES, np.float32)}
        expected = {k: v.copy() for k, v in got.items()}
        for record in plain:
            for key, value in record.items():
                expected[key] += value.numpy()
        add_records(got, records)
        _same_as_the_loop(got, expected)
    # a sum kept as a NumPy scalar (not an array it could write into): the loop's rebinding
    got, expected = {"scalar": np.float64(1.5)}, {"scalar": np.float64(1.5)}
    for record in plain:
        expected["scalar"] += record["scalar"].numpy()
    add_records(got, [{"scalar": r["scalar"]} for r in stacked])
    _same_as_the_loop(got, expected)


def test_add_records_leaves_sums_it_cannot_write_alike_to_the_loop():
    """Sums the fast path would not leave as the loop does go through the
    loop: a masked array (the loop keeps its mask), a read-only array (the
    loop's error, nothing summed past the first record), and two keys whose
    sums share one array (the loop adds record by record, alternating)."""
    from fedaccel.arrays import add_records

    stacked, plain = _host_chunks(torch.Generator().manual_seed(14), 12, torch.float64)
    records = [{"w": r["w"], "edge": r["edge"]} for r in stacked]
    plain_records = [{"w": r["w"], "edge": r["edge"]} for r in plain]

    def both(make):
        got, expected = make(), make()
        for record in plain_records:
            for key, value in record.items():
                expected[key] += value.numpy()
        add_records(got, records)
        return got, expected

    got, expected = both(lambda: {"w": np.ma.masked_array(np.full((5, 3), 0.5), mask=np.eye(5, 3, dtype=bool)),
                                  "edge": np.zeros(arrays_module.BLOCK_ROW_VALUES)})
    assert type(got["w"]) is np.ma.MaskedArray and np.array_equal(got["w"].mask, expected["w"].mask)
    assert got["w"].data.tobytes() == expected["w"].data.tobytes()
    shared = np.zeros(arrays_module.BLOCK_ROW_VALUES)
    got, expected = {"w": np.zeros((5, 3)), "edge": shared}, {"w": np.zeros((5, 3)), "edge": shared.copy()}
    got["also"] = got["edge"][:]  # a second key on the same memory
    expected["also"] = expected["edge"][:]
    add_records(got, [{**r, "also": r["edge"]} for r in records])
    for record in plain_records:
        for key, value in {**record, "also": record["edge"]}.items():
            expected[key] += value.numpy()
    assert got["edge"].tobytes() == expected["edge"].tobytes()
    frozen = {"w": np.zeros((5, 3)), "edge": np.zeros(arrays_module.BLOCK_ROW_VALUES)}
    frozen["edge"].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        add_records(frozen, records)
    assert frozen["w"].tobytes() == plain_records[0]["w"].numpy().tobytes()  # the loop's state at its error


def test_to_numpy_is_a_read_only_view_of_the_payload():
    array = Array(np.arange(6, dtype=np.float32))
    view = to_numpy(array)
    assert not view.flags.writeable and not view.flags.owndata
    with pytest.raises(ValueError):
        view[0] = 1.0


def test_views_are_made_once_inside_views_reused_only():
    """Inside ``views_reused`` an Array's view is made once (the same object
    again, also in a nested block); outside it, and for a payload read the
    slow way (a fresh writable array each time), never."""
    import threading
    from fedaccel.arrays import views_reused
    array = Array(np.arange(6, dtype=np.float32))
    assert to_numpy(array) is not to_numpy(array)
    lying = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=array.data)
    with views_reused():
        first = to_numpy(array)
        with views_reused():
            assert to_numpy(array) is first
        assert to_numpy(array) is first
        assert to_numpy(lying) is not to_numpy(lying)
        other_thread = []
        thread = threading.Thread(target=lambda: other_thread.append(to_numpy(array)))
        thread.start()
        thread.join()
        assert other_thread[0] is not first  # the memo is this thread's
        np.testing.assert_array_equal(other_thread[0], first)
    assert to_numpy(array) is not first
    assert arrays_module._reuse.memo is None


def test_a_payload_that_disagrees_with_the_array_fields_goes_through_np_load():
    """The fast path is taken only when the header says what the fields say;
    otherwise Flower's np.load decides (here: the header's shape wins)."""
    values = np.arange(6, dtype=np.float32)
    lying = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=Array(values).data)
    assert to_numpy(lying).shape == (6,)  # what Array.numpy() gives
    truncated = Array(dtype="float32", shape=(6,), stype="numpy.ndarray", data=Array(values).data[:-4])
    with pytest.raises(ValueError):
        to_numpy(truncated)  # np.load's own error
    other = Array(dtype="float32", shape=(6,), stype="torch.tensor", data=b"x")
    with pytest.raises(TypeError, match="Unsupported serialization type"):
        to_numpy(other)


def test_tensor_round_trip_gives_fresh_writable_tensors():
    tensors = {"w": torch.randn(3, 2), "b": torch.arange(3)}
    record = tensors_to_record(tensors)
    assert list(record.keys()) == ["w", "b"]
    assert record["w"].data == Array(tensors["w"].numpy()).data
    back = record_to_tensors(record)
    for k in tensors:
        assert torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype
    back["w"].add_(1.0)  # writable, and not the record's memory
    assert torch.equal(torch.from_numpy(record["w"].numpy()), tensors["w"])
    assert from_tensor(tensors["b"]).data == Array(tensors["b"].numpy()).data


def _replies(rng, n=4):
    out = []
    for i in range(n):
        arrays = ArrayRecord({"w": Array(rng.standard_normal((5, 3)).astype(np.float32)),
                              "b": Array(rng.standard_normal(3).astype(np.float32)),
                              "s": Array(np.asarray(rng.standard_normal(), dtype=np.float64))})
        metrics = MetricRecord({"num-examples": int(rng.integers(1, 100))})
        out.append(RecordDict({"arrays": arrays, "metrics": metrics}))
    return out


def test_weighted_mean_of_replies_is_bit_identical_to_flowers():
    contents = _replies(np.random.default_rng(0))
    ours = weighted_mean_of_replies(contents, "num-examples")
    flowers = aggregate_arrayrecords(contents, "num-examples")
    assert list(ours.keys()) == list(flowers.keys())
    for k in flowers:
        assert ours[k].data == flowers[k].data, k  # same bytes: same dtype, shape and values


def test_load_into_copies_into_the_models_own_tensors():
    from fedaccel.arrays import load_into

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    params_before = [p for p in model.parameters()]
    source = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    source[1].running_mean.add_(3.0)
    source[1].num_batches_tracked.add_(7)
    load_into(model, tensors_to_record(source.state_dict()))
    for (k, got), want in zip(model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(got, want) and got.dtype == want.dtype, k
    assert all(a is b for a, b in zip(model.parameters(), params_before))  # same Parameter objects
    # float64 values into the float32 model: converted, as load_state_dict does
    wide = ArrayRecord({k: Array(v.numpy().astype(np.float64) if v.is_floating_point() else v.numpy())
                        for k, v in source.state_dict().items()})
    model[0].weight.data.zero_()
    load_into(model, wide)
    assert torch.equal(model[0].weight, source[0].weight)


def test_load_into_rejects_what_load_state_dict_rejects():
    from fedaccel.arrays import load_into

    model = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_into(model, tensors_to_record({"weight": torch.zeros(2, 3)}))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_into(model, tensors_to_record({"weight": torch.zeros(3, 3), "bias": torch.zeros(2)}))


def test_mean_of_records_by_hand():
    """weights 1 and 3 -> 0.25 [1, 2] + 0.75 [5, 6] = [4, 5]; unweighted [3, 4]."""
    import numpy as np

    from fedaccel.arrays import mean_of_records

    a = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    b = {"w": np.array([5.0, 6.0], dtype=np.float32)}
    weighted = mean_of_records([a, b], [1, 3])
    assert weighted["w"].dtype == np.float32 and weighted["w"].tolist() == [4.0, 5.0]
    assert mean_of_records([a, b])["w"].tolist() == [3.0, 4.0]
    assert mean_of_records([a, b], dtype=np.float64)["w"].dtype == np.float64


def test_mean_of_records_is_flowers_weighted_mean_bit_for_bit():
    import numpy as np
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fedaccel.arrays import from_numpy, mean_of_records

    rng = np.random.default_rng(0)
    contents = [RecordDict({"arrays": ArrayRecord({"w": from_numpy(rng.standard_normal((7, 5)).astype(np.float32))}),
                            "metrics": MetricRecord({"num-examples": int(n)})})
                for n in rng.integers(1, 100, size=9)]
    flower = aggregate_arrayrecords(contents, "num-examples")["w"].numpy()
    ours = mean_of_records([c["arrays"] for c in contents],
                           [c["metrics"]["num-examples"] for c in contents])["w"]
    assert ours.dtype == flower.dtype and np.array_equal(ours, flower)


@pytest.mark.parametrize("weights,match", [(None, "at least one"), ([1.0, 2.0], "2 weights for 1"),
                                            ([0.0], "sum to > 0")])
def test_mean_of_records_refuses_what_it_cannot_average(weights, match):
    import numpy as np

    from fedaccel.arrays import mean_of_records

    records = [] if weights is None else [{"w": np.ones(2)}]
    with pytest.raises(ValueError, match=match):
        mean_of_records(records, weights)
