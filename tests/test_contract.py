"""The message contract (fedaccel/contract.py): declared once, checked on both sides.

Every registered algorithm's strategy refers to its solver's contract; a
missing or unknown record or config value is refused with a line naming the
algorithm and the key, on the client (an error reply) and on the server (a
rejected reply, or an error before a bad message leaves).
"""

from __future__ import annotations

import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

import numpy as np

from fedaccel.contract import ContractError, MessageContract, TrainConfig, train_config_record
from fedaccel.local_run import default_run_config
from fedaccel.registry import all_algorithms
from fedaccel.run_config import parse_run_config
from fakes import StubGrid
from fedaccel.membership import Federation

pytestmark = pytest.mark.usefixtures("server_identity")

SCAFFOLD_LIKE = MessageContract(to_client=("x.c",), to_server=("x.dc",), config=("x-mu",))


def test_every_strategy_uses_its_solvers_contract_object() -> None:
    for name, spec in all_algorithms().items():
        cfg = default_run_config()
        cfg.update({"algo": name, "clients-per-round": 2})
        strategy = spec.build_strategy(parse_run_config(cfg), Federation({0: 10, 1: 11}))
        assert strategy.messages is spec.solver.messages, name


def test_reading_a_training_config_types_it() -> None:
    config = {**train_config_record(3, 0.5, 2, {"x-mu": 0.1}), "accepted-round": 2}
    got = SCAFFOLD_LIKE.read_train_config("algo-x", config, stateful=True)
    assert got == TrainConfig(server_round=3, lr=0.5, local_epochs=2, accepted_round=2,
                              values={"x-mu": 0.1})
    assert got.get("x-mu") == 0.1


@pytest.mark.parametrize("config, message", [
    (train_config_record(1, 0.5, 2), r"^algo-x: the training message's config lacks 'x-mu'"),
    ({"lr": 0.5, "local-epochs": 2, "x-mu": 0.1}, r"lacks 'server-round'"),
    ({**train_config_record(1, 0.5, 2, {"x-mu": 0.1}), "x-nu": 1}, r"carries 'x-nu', which algo-x's"),
])
def test_a_config_that_breaks_the_contract_names_algorithm_and_key(config, message) -> None:
    with pytest.raises(ContractError, match=message):
        SCAFFOLD_LIKE.read_train_config("algo-x", config, stateful=False)


def test_a_stateful_algorithm_needs_accepted_round() -> None:
    config = train_config_record(1, 0.5, 2, {"x-mu": 0.1})
    with pytest.raises(ContractError, match="lacks 'accepted-round'"):
        SCAFFOLD_LIKE.read_train_config("algo-x", config, stateful=True)


@pytest.mark.parametrize("names, problem", [
    (["arrays", "x.c"], None),
    (["arrays"], "algo-x: the training message lacks the record 'x.c'"),
    (["arrays", "x.c", "x.cc"], "algo-x: the training message carries the record 'x.cc'"),
])
def test_records_are_checked_by_direction(names, problem) -> None:
    got = SCAFFOLD_LIKE.records_problem("algo-x", "to_client", names)
    assert (got is None) if problem is None else got.startswith(problem)


def _run(algo: str, **extra):
    cfg = default_run_config()
    cfg.update({"algo": algo, "clients-per-round": 2, **extra})
    spec = all_algorithms()[algo]
    return spec, parse_run_config(cfg)


def test_the_server_rejects_a_scaffold_reply_without_its_record() -> None:
    spec, cfg = _run("scaffold")
    strategy = spec.build_strategy(cfg, Federation({0: 10, 1: 11}))
    weights = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    strategy.global_arrays = weights
    content = RecordDict({"arrays": weights, "metrics": MetricRecord({"num-examples": 5})})
    reply = Message(content, 10, MessageType.TRAIN)
    assert strategy.reply_problem(reply).startswith("scaffold: the reply lacks the record 'scaffold.dc'")
    content["scaffold.dc"] = weights
    content["other.x"] = weights
    assert "carries the record 'other.x'" in strategy.reply_problem(reply)
    del content["other.x"]
    assert strategy.reply_problem(reply) is None


def test_the_server_will_not_send_an_undeclared_record() -> None:
    spec, cfg = _run("fedavg")
    strategy = spec.build_strategy(cfg, Federation({0: 10, 1: 11}))
    strategy.broadcast_records = lambda server_round: {"fedavg.secret": ArrayRecord()}
    weights = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    with pytest.raises(ContractError, match="fedavg: the training message carries the record 'fedavg.secret'"):
        strategy.configure_train(1, weights, ConfigRecord(), StubGrid([10, 11]))



@pytest.mark.parametrize("algo", ["scaffold", "fedavg"])
def test_every_client_s_own_config_is_checked_before_it_is_sent(algo) -> None:
    """A per-client config value (here one the contract does not declare,
    in the second client's message only) is checked in that client's message too, not only
    in the first message of the round (messages are checked once per shape)."""
    spec, cfg = _run(algo, **{"straggler-fraction": 0.5} if algo == "fedavg" else {})
    strategy = spec.build_strategy(cfg, Federation({0: 10, 1: 11}))
    own, calls = type(strategy)._client_updates, []

    def updates(partition, log_):  # the second client's message only, whichever comes second
        calls.append(partition)
        return {**own(strategy, partition, log_), **({"secret": 1} if len(calls) == 2 else {})}

    strategy._client_updates = updates
    weights = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    with pytest.raises(ContractError, match=f"{algo}: the training message's config carries 'secret'"):
        strategy.configure_train(1, weights, ConfigRecord(), StubGrid([10, 11]))

def test_a_scaffold_client_without_the_control_variate_replies_with_an_error() -> None:
    """Through the real ClientApp: an error reply naming node, algorithm and key."""
    from flwr.app import Context

    from fedaccel.apps.client_app import train

    cfg = default_run_config()
    cfg.update({"algo": "scaffold", "clients-per-round": 2})
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config=cfg)
    from fedaccel.apps.client_app import client_runtime
    from fedaccel.torch_utils import state_to_arrays

    weights = state_to_arrays(client_runtime(context).model)
    config = ConfigRecord({**train_config_record(1, 0.05, 1), "accepted-round": 0})
    msg = Message(RecordDict({"arrays": weights, "config": config}), 7, MessageType.TRAIN)
    reply = train(msg, context)
    assert reply.has_error()
    assert reply.error.reason.startswith("node 7 (partition 0): scaffold: the training message lacks "
                                         "the record 'scaffold.c'")
