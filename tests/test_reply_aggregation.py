"""The server's reply checks and metric mean are Flower's, bit for bit.

:func:`fedaccel.strategies.server_steps.mean_metric_records` and
:func:`~fedaccel.strategies.server_steps.check_reply_consistency` re-do
Flower's ``aggregate_metricrecords`` and ``validate_message_reply_consistency``
on plain reads of the records (Flower's read through synced views). Here both
are run side by side with Flower's on the same replies: the same metrics to the
last bit, the same exception with the same reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, validate_message_reply_consistency

from fedaccel.arrays import from_numpy
from fedaccel.strategies.server_steps import check_reply_consistency, mean_metric_records


def reply(metrics: dict, arrays: dict | None = None, extra: dict | None = None,
          metrics_name: str = "metrics") -> RecordDict:
    content = RecordDict()
    content["arrays"] = ArrayRecord({k: from_numpy(np.asarray(v, np.float32))
                                     for k, v in (arrays or {"w": [1.0, 2.0]}).items()})
    for name, record in (extra or {}).items():
        content[name] = record
    content[metrics_name] = MetricRecord(metrics)
    return content


def test_the_metric_mean_is_flowers_to_the_last_bit():
    rng = np.random.default_rng(3)
    contents = [reply({"num-examples": int(rng.integers(1, 500)), "train-loss": float(rng.random()) * 3,
                       "local-steps": int(rng.integers(1, 40)), "curve": [float(v) for v in rng.random(3)]})
                for _ in range(37)]
    ours, flowers = mean_metric_records(contents, "num-examples"), aggregate_metricrecords(contents, "num-examples")
    assert list(ours.keys()) == list(flowers.keys()) == ["train-loss", "local-steps", "curve"]
    for key in ours:
        assert ours[key] == flowers[key]  # exact, floats and lists alike
        assert type(ours[key]) is type(flowers[key])


def test_the_metric_mean_by_hand():
    contents = [reply({"num-examples": 1, "loss": 4.0}), reply({"num-examples": 3, "loss": 0.0})]
    assert mean_metric_records(contents, "num-examples")["loss"] == 1.0


MALFORMED = {
    "two array records": [reply({"num-examples": 1}), reply({"num-examples": 1},
                                                             extra={"x": ArrayRecord({"a": from_numpy(np.ones(1))})})],
    "array keys differ": [reply({"num-examples": 1}), reply({"num-examples": 1}, arrays={"v": [1.0]})],
    "two metric records": [reply({"num-examples": 1}),
                           reply({"num-examples": 1}, extra={"more": MetricRecord({"a": 1})})],
    "metric keys differ": [reply({"num-examples": 1, "a": 1.0}), reply({"num-examples": 1, "b": 1.0})],
    "metric record named differently": [reply({"num-examples": 1}), reply({"num-examples": 1}, metrics_name="m")],
    "no weight key": [reply({"examples": 1}), reply({"examples": 2})],
    "weight is a list": [reply({"num-examples": [1, 2]}), reply({"num-examples": [1, 2]})],
}


@pytest.mark.parametrize("check_arrays", [True, False])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_replies_are_refused_with_flowers_reason(case, check_arrays):
    contents = MALFORMED[case]
    try:
        validate_message_reply_consistency(contents, "num-examples", check_arrays)
        flowers = None
    except InconsistentMessageReplies as err:
        flowers = str(err)
    if flowers is None:
        check_reply_consistency(contents, "num-examples", check_arrays)  # accepted by both
        assert not check_arrays and case in ("two array records", "array keys differ")
        return
    with pytest.raises(InconsistentMessageReplies) as ours:
        check_reply_consistency(contents, "num-examples", check_arrays)
    assert str(ours.value) == flowers


def test_consistent_replies_pass_both_checks():
    contents = [reply({"num-examples": n, "train-loss": 0.5}) for n in (1, 2, 3)]
    validate_message_reply_consistency(contents, "num-examples", True)
    check_reply_consistency(contents, "num-examples", True)
    check_reply_consistency([], "num-examples")
