"""Cohort samplers, the step learning-rate schedule and stragglers.

Samplers are checked as pure functions and through the strategies that pick
them (``sampler='auto'`` resolves per algorithm); stragglers through real
``configure_train`` / ``aggregate_train`` calls with Flower ``Message``
replies, as in ``tests/test_strategy_base.py``.
"""

from __future__ import annotations


import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedaccel.run_config import parse_run_config
from fedaccel.local_run import default_run_config, fuse
from fedaccel.registry import get_algorithm
from fedaccel.samplers import (
    cohort,
    reshuffle_cohort,
    reshuffled_cohorts,
    rounds_per_meta_epoch,
    uniform_cohort,
)
from fedaccel.membership import Federation

from fakes import StubGrid

pytestmark = pytest.mark.usefixtures("server_identity")

NODES8 = {pid: 500 + 3 * pid for pid in range(8)}


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #

def make_cfg(algo: str = "fedavg", **changes):
    return parse_run_config(fuse(default_run_config(), {
        "algo": algo, "clients-per-round": 4, "momentum": 0.0, "weight-decay": 0.0, **changes}))


def build(algo: str = "fedavg", nodes: dict[int, int] = NODES8, **changes):
    return get_algorithm(algo).build_strategy(make_cfg(algo, **changes), Federation(dict(nodes)))


def configure(strategy, server_round: int, record: ArrayRecord, nodes=NODES8) -> list[Message]:
    msgs = list(strategy.configure_train(server_round, record, ConfigRecord(),
                                         StubGrid(nodes.values())))
    for i, m in enumerate(msgs):
        m.metadata.__dict__["_message_id"] = f"r{server_round}-m{i}"
    return msgs


def model_reply(instruction: Message, w, n: int = 10) -> Message:
    content = RecordDict({
        "arrays": ArrayRecord({"w": Array(np.asarray(w, dtype=np.float64))}),
        "metrics": MetricRecord({"num-examples": n, "train-loss": 1.0}),
    })
    return Message(content, reply_to=instruction)


# --------------------------------------------------------------------------- #
# reshuffle sampler
# --------------------------------------------------------------------------- #
def test_reshuffle_meta_epoch_visits_every_client_once():
    n, c = 20, 5
    assert rounds_per_meta_epoch(n, c) == 4
    rounds = [reshuffle_cohort(0, r, n, c) for r in range(1, 5)]
    flat = [p for cohort_ in rounds for p in cohort_]
    assert sorted(flat) == list(range(n))  # every client exactly once, none repeated
    for cohort_ in rounds:
        assert len(cohort_) == c and cohort_ == sorted(cohort_)
        assert all(isinstance(p, int) for p in cohort_)
    # the rounds of a meta-epoch are the consecutive chunks of one permutation
    assert rounds == reshuffled_cohorts(0, 0, n, c)


def test_reshuffle_consecutive_meta_epochs_use_different_permutations():
    n, c = 20, 5
    epoch0 = [reshuffle_cohort(0, r, n, c) for r in range(1, 5)]
    epoch1 = [reshuffle_cohort(0, r, n, c) for r in range(5, 9)]
    epoch2 = [reshuffle_cohort(0, r, n, c) for r in range(9, 13)]
    for epoch in (epoch1, epoch2):
        assert sorted(p for chunk in epoch for p in chunk) == list(range(n))
    assert epoch0 != epoch1 and epoch1 != epoch2
    assert epoch1 == reshuffled_cohorts(0, 1, n, c)


def test_reshuffle_is_deterministic_per_seed_and_seeds_differ():
    n, c = 20, 5
    a = [reshuffle_cohort(3, r, n, c) for r in range(1, 13)]
    assert a == [reshuffle_cohort(3, r, n, c) for r in range(1, 13)]
    b = [reshuffle_cohort(4, r, n, c) for r in range(1, 13)]
    assert a != b


def test_reshuffle_when_cohort_size_does_not_divide_clients():
    n, c = 10, 4
    assert rounds_per_meta_epoch(n, c) == 3
    for meta_epoch in range(4):
        rounds = [reshuffle_cohort(1, 3 * meta_epoch + r, n, c) for r in (1, 2, 3)]
        assert [len(x) for x in rounds] == [4, 4, 2]
        assert sorted(p for x in rounds for p in x) == list(range(n))
    # round 4 starts the next meta-epoch: a full cohort again
    assert len(reshuffle_cohort(1, 4, n, c)) == 4


def test_reshuffle_full_participation_is_everyone_every_round():
    assert all(reshuffle_cohort(0, r, 7, 7) == list(range(7)) for r in range(1, 5))


# --------------------------------------------------------------------------- #
# uniform sampler and dispatch
# --------------------------------------------------------------------------- #
def test_uniform_cohort_sorted_unique_right_size():
    for r in range(1, 30):
        got = uniform_cohort(5, r, 20, 6)
        assert got == sorted(got) and len(set(got)) == 6
        assert all(0 <= p < 20 for p in got)
        assert got == uniform_cohort(5, r, 20, 6)


def test_uniform_cohort_is_deterministic_sorted_unique():
    a = uniform_cohort(0, 5, 100, 10)
    assert a == uniform_cohort(0, 5, 100, 10)
    assert a == sorted(a)
    assert len(set(a)) == 10
    assert all(0 <= p < 100 for p in a)
    assert all(isinstance(p, int) for p in a)


def test_uniform_cohort_changes_with_round_and_seed():
    base = uniform_cohort(0, 1, 100, 10)
    assert uniform_cohort(0, 2, 100, 10) != base
    assert uniform_cohort(1, 1, 100, 10) != base


def test_uniform_cohort_covers_every_client():
    seen = set()
    for r in range(1, 201):
        seen.update(uniform_cohort(3, r, 20, 5))
    assert seen == set(range(20))


def test_uniform_cohort_full_federation():
    assert uniform_cohort(0, 1, 7, 7) == list(range(7))


def test_uniform_rounds_are_independent_so_clients_repeat_within_a_meta_epoch():
    """Unlike reshuffling, 4 uniform rounds of 5 out of 20 do not cover everyone."""
    covered = [len({p for r in range(k, k + 4) for p in uniform_cohort(0, r, 20, 5)})
               for k in range(1, 41, 4)]
    assert any(c < 20 for c in covered)


def test_cohort_dispatch():
    assert cohort("uniform", 2, 3, 20, 5) == uniform_cohort(2, 3, 20, 5)
    assert cohort("reshuffle", 2, 3, 20, 5) == reshuffle_cohort(2, 3, 20, 5)
    with pytest.raises(ValueError, match="auto"):
        cohort("auto", 2, 3, 20, 5)


@pytest.mark.parametrize("algo, sampler, expected", [
    ("fedcdr", "auto", "reshuffle"),
    ("feddr", "auto", "uniform"),
    ("fedavg", "auto", "uniform"),
    ("fedavg", "reshuffle", "reshuffle"),  # CR+FedAvg
    ("fedcdr", "uniform", "uniform"),
])
def test_strategy_picks_sampler(algo, sampler, expected):
    strategy = build(algo, sampler=sampler)
    assert strategy.sampler == expected
    pick = reshuffle_cohort if expected == "reshuffle" else uniform_cohort
    for r in range(1, 7):
        assert strategy.sample_cohort(r) == pick(strategy.run_cfg.seed, r, 8, 4)


def test_cr_fedavg_cohorts_through_configure_train():
    """fedavg + sampler='reshuffle', 8 clients, 4 per round: rounds (1, 2) and
    (3, 4) each cover all 8 clients; messages go to exactly those nodes."""
    strategy = build("fedavg", sampler="reshuffle", seed=11)
    sampled = []
    for r in range(1, 5):
        msgs = configure(strategy, r, ArrayRecord({"w": Array(np.zeros(1))}))
        sampled.append(strategy.rounds[r].sampled)
        assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(NODES8[p] for p in sampled[-1])
    assert sorted(sampled[0] + sampled[1]) == list(range(8))
    assert sorted(sampled[2] + sampled[3]) == list(range(8))
    assert sampled[:2] != sampled[2:]


# --------------------------------------------------------------------------- #
# learning-rate schedule
# --------------------------------------------------------------------------- #
def test_step_schedule_8_rounds():
    cfg = make_cfg(lr=0.2, **{"lr-schedule": "step", "num-server-rounds": 8})
    got = [cfg.lr_at(r) for r in range(1, 9)]
    expected = [0.2] * 4 + [0.2 * 0.1] * 2 + [0.2 * 0.01] * 2
    assert got == pytest.approx(expected, rel=1e-12)


def test_constant_schedule():
    cfg = make_cfg(lr=0.2, **{"lr-schedule": "constant", "num-server-rounds": 8})
    assert all(cfg.lr_at(r) == 0.2 for r in range(1, 9))


@pytest.mark.parametrize("algo", ["fedavg", "fedcdr"])
def test_round_config_and_messages_follow_schedule(algo):
    strategy = build(algo, lr=0.2, **{"lr-schedule": "step", "num-server-rounds": 8})
    for r in range(1, 9):
        lr = strategy.run_cfg.lr_at(r)
        assert strategy.round_config(r)["lr"] == lr
        msgs = configure(strategy, r, ArrayRecord({"w": Array(np.zeros(1))}))
        assert {m.content["config"]["lr"] for m in msgs} == {lr}


# --------------------------------------------------------------------------- #
# stragglers
# --------------------------------------------------------------------------- #
STRAG = {"straggler-fraction": 0.5, "local-epochs": 4}


def test_choose_stragglers_count_epochs_and_determinism():
    strategy = build("fedavg", **STRAG)
    cohort_ = [1, 3, 4, 6]
    seen_epochs = set()
    for r in range(1, 21):
        chosen = strategy.choose_stragglers(r, cohort_)
        assert len(chosen) == 2
        assert set(chosen) <= set(cohort_)
        assert all(1 <= e <= 4 and isinstance(e, int) for e in chosen.values())
        assert chosen == strategy.choose_stragglers(r, cohort_)
        assert chosen == build("fedavg", **STRAG).choose_stragglers(r, cohort_)
        seen_epochs.update(chosen.values())
    assert len(seen_epochs) > 1  # really drawn, not a constant
    assert build("fedavg", **{**STRAG, "straggler-fraction": 0.0}).choose_stragglers(1, cohort_) == {}


def test_straggler_messages_carry_their_epochs():
    strategy = build("fedavg", lr=0.03, **STRAG)
    for r in (1, 2, 3):
        msgs = configure(strategy, r, ArrayRecord({"w": Array(np.arange(3.0))}))
        log = strategy.rounds[r]
        assert len(log.stragglers) == 2 and set(log.stragglers) <= set(log.sampled)
        pid = {node: p for p, node in NODES8.items()}
        assert sorted(pid[m.metadata.dst_node_id] for m in msgs) == log.sampled
        for m in msgs:
            p = pid[m.metadata.dst_node_id]
            config = m.content["config"]
            assert config["local-epochs"] == log.stragglers.get(p, 4)
            # everything else is untouched
            assert config["lr"] == pytest.approx(0.03) and config["server-round"] == r
            np.testing.assert_array_equal(m.content["arrays"]["w"].numpy(), np.arange(3.0))
            assert m.metadata.message_type == "train"


def _straggler_round(strategy):
    msgs = configure(strategy, 1, ArrayRecord({"w": Array(np.zeros(2))}))
    pid = {node: p for p, node in NODES8.items()}
    models = {pid[m.metadata.dst_node_id]: np.array([pid[m.metadata.dst_node_id] ** 2, 1.0])
              for m in msgs}
    replies = [model_reply(m, models[pid[m.metadata.dst_node_id]]) for m in msgs]
    out, _ = strategy.aggregate_train(1, replies)
    return out, models, strategy.rounds[1]


def test_drop_policy_excludes_straggler_replies():
    strategy = build("fedavg", **STRAG)  # fedavg: 'auto' -> drop
    assert strategy.straggler_policy == "drop"
    out, models, log = _straggler_round(strategy)
    kept = [p for p in log.sampled if p not in log.stragglers]
    assert len(kept) == 2
    np.testing.assert_allclose(out["w"].numpy(), np.mean([models[p] for p in kept], axis=0))
    assert log.dropped == 2
    assert log.replies == 2  # aggregated: the two dropped are counted in dropped, not in clients


def test_partial_policy_uses_straggler_replies():
    strategy = build("fedavg", **{**STRAG, "straggler-policy": "partial"})
    out, models, log = _straggler_round(strategy)
    np.testing.assert_allclose(out["w"].numpy(), np.mean(list(models.values()), axis=0))
    assert log.dropped == 0 and len(log.stragglers) == 2


def test_a_drop_policy_that_makes_every_client_a_straggler_is_refused():
    """straggler-fraction 0.9 of 4 clients a round is 4 stragglers: with
    'drop' every reply of every round would be dropped and the model never
    change, so the run is refused in one line before its first round."""
    from fedaccel.config import ConfigError

    with pytest.raises(ConfigError, match="every client of a round of 4 is a straggler"):
        build("fedavg", **{"straggler-fraction": 0.9, "local-epochs": 4})
    build("fedavg", **{"straggler-fraction": 0.9, "local-epochs": 4, "straggler-policy": "partial"})  # used


def test_drop_policy_keeps_the_model_when_only_straggler_replies_came():
    """The non-stragglers of a round failed, the stragglers' replies are
    dropped: no reply is left, the model stays as it was (None), with a
    warning."""
    from test_strategy_base import error_reply

    strategy = build("fedavg", **STRAG)
    msgs = configure(strategy, 1, ArrayRecord({"w": Array(np.zeros(2))}))
    pid = {node: p for p, node in NODES8.items()}
    stragglers = strategy.rounds[1].stragglers
    replies = [model_reply(m, [1.0, 2.0]) if pid[m.metadata.dst_node_id] in stragglers else error_reply(m)
               for m in msgs]
    out, _ = strategy.aggregate_train(1, replies)
    log = strategy.rounds[1]
    assert len(log.stragglers) == 2 and log.dropped == 2 and out is None


@pytest.mark.parametrize("algo", ["fedcdr", "feddr"])
def test_douglas_rachford_accepts_drop_policy(algo):
    """Dropping a DR reply is sound now that clients roll back the state of a
    round whose reply was not applied (tests/test_state_protocol.py checks
    x = mean(xhat) every round with dropped stragglers)."""
    strategy = build(algo, **{**STRAG, "straggler-policy": "drop"})
    assert strategy.straggler_policy == "drop"


@pytest.mark.parametrize("algo", ["fedcdr", "feddr"])
def test_douglas_rachford_auto_policy_is_partial(algo):
    strategy = build(algo, **STRAG)
    assert strategy.straggler_policy == "partial"
    msgs = configure(strategy, 1, ArrayRecord({"w": Array(np.zeros(2))}))
    pid = {node: p for p, node in NODES8.items()}
    replies = [model_reply(m, [1.0, 2.0]) for m in msgs]  # g_i
    out, _ = strategy.aggregate_train(1, replies)
    assert strategy.rounds[1].dropped == 0
    # x + (1/n) sum over all 4 replies, n = 8 clients
    np.testing.assert_allclose(out["w"].numpy(), np.array([4.0, 8.0]) / 8)
    assert sorted(pid[m.metadata.dst_node_id] for m in msgs) == strategy.rounds[1].sampled
