"""Policy knobs: typed dataclasses with their defaults, checked at construction."""

import dataclasses
import json

import pytest

from services.scheduler.core.policies import (
    available_policies,
    make_policy,
    policy_class,
    policy_knobs,
)
from services.scheduler.core.policies.base import KnobError, Knobs, Policy, registered_policies
from services.scheduler.core.policies.hybrid import HybridKnobs
from services.scheduler.core.policies.parts.levels import LevelRule
from services.scheduler.core.policies.parts.memory import MemoryRule
from services.scheduler.core.policies.parts.ranking import RankRule
from tests.unit.test_core_util import make_sched


@pytest.mark.parametrize("name", available_policies())
def test_every_policy_has_frozen_knobs_with_json_defaults(name):
    policy = make_policy(name)
    assert isinstance(policy.knobs, Knobs)
    assert policy.describe() == {"name": name, "knobs": policy_knobs(name)}
    assert json.loads(json.dumps(policy_knobs(name))) == policy_knobs(name)
    field = next(iter(policy_knobs(name)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy.knobs, field, None)


def test_each_policy_lists_its_own_knobs_and_drops_nothing_silently():
    alise, hybrid = policy_knobs("alise"), policy_knobs("hybrid")
    assert (alise["num_queues"], hybrid["num_queues"]) == (8, 16)
    assert (alise["rank"], hybrid["rank"]) == ("remaining", "normalized")
    assert alise["aging_threshold_s"] == hybrid["aging_threshold_s"] == 5.0
    assert policy_knobs("fastserve")["aging_threshold_s"] is None
    assert "max_num_batched_tokens" in alise and "max_num_batched_tokens" not in hybrid
    with pytest.raises(ValueError, match="valid knobs"):
        make_policy("hybrid", max_num_batched_tokens=4096)
    # cut from hybrid (no measured effect, bench/results/hybrid_knob_effects.json); alise keeps
    for cut in ("aging_per_step", "prefetch_per_step", "default_predicted_len"):
        assert cut in alise and cut not in hybrid, cut
        with pytest.raises(ValueError, match="valid knobs"):
            make_policy("hybrid", **{cut: 1})


def test_no_policy_extends_another_a_variant_holds_another_part():
    for name, entry in registered_policies().items():
        assert entry.cls.__bases__ == (Policy,), name
        assert entry.cls.knobs_type.__bases__ == (Knobs,), name
    assert policy_class("oracle") is policy_class("alise")
    assert policy_class("priority") is policy_class("fcfs")
    assert policy_class("request") is policy_class("orca")
    assert make_policy("oracle").name == "oracle" and make_policy("alise").name == "alise"
    assert make_policy("priority").orders_by_priority and not make_policy("fcfs").orders_by_priority
    with pytest.raises(ValueError, match="oracle: queue_ratio"):
        make_policy("oracle", queue_ratio=1)


def test_a_part_rule_takes_the_policy_knobs_of_its_names_and_checks_them():
    k = HybridKnobs(num_queues=4, aging_threshold_s=2.0, queue_ratio=3.0)
    assert k.rule(LevelRule) == LevelRule(num_queues=4, aging_threshold_s=2.0)  # per step: 64
    assert k.rule(RankRule).queue_ratio == 3.0 and k.rule(RankRule).rank == "normalized"
    assert k.rule(RankRule).default_predicted_len == RankRule().default_predicted_len
    assert k.rule(MemoryRule) == MemoryRule()
    for rule, bad in ((LevelRule, {"num_queues": 0}), (MemoryRule, {"memory_mode": "x"})):
        with pytest.raises(KnobError):
            rule(**bad)


def test_knob_values_as_json_gives_them():
    p = make_policy("alise", aging_threshold_s=2, queue_ratio=3, gpu_job_limit=None)
    assert p.knobs.aging_threshold_s == 2 and p.knobs.queue_ratio == 3
    assert p.describe()["knobs"]["gpu_job_limit"] is None
    s = make_sched("alise", aging_threshold_s=2, memory_mode="recompute")
    assert s.policy.knobs.memory_mode == "recompute" and s.policy.levels.aging.threshold == 2


@pytest.mark.parametrize(
    "name, knobs, message",
    [
        ("alise", {"queue_ratio": 1}, "alise: queue_ratio must be > 1"),
        ("oracle", {"memory_mode": "drop"}, "oracle: memory_mode must be one of"),
        ("fastserve", {"quantum_ratio": 0.5}, "fastserve: quantum_ratio must be > 1"),
        ("hybrid", {"preempt_level_gap": 0}, "hybrid: preempt_level_gap must be >= 1 or None"),
        ("sarathi", {"tile_size": 0}, "sarathi: tile_size must be a positive int"),
        ("fcfs", {"watermark": 1.0}, r"fcfs: watermark must be in \[0, 1\)"),
        ("orca", {"max_batch_size": 0}, "orca: max_batch_size must be a positive int"),
        ("accelgen", {"budget_rule": "x"}, "accelgen: budget_rule must be 'profile' or 'eq6'"),
    ],
)
def test_bad_knob_values_name_the_policy_and_the_knob(name, knobs, message):
    with pytest.raises(ValueError, match=message):
        make_policy(name, **knobs)


def test_unknown_knob_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        make_policy("orca", watermark=0.1)
    assert str(err.value) == (
        "unknown knob(s) ['watermark'] for policy 'orca'; "
        "valid knobs: ['max_batch_size', 'max_num_batched_tokens']"
    )


def test_an_unbound_policy_says_so():
    with pytest.raises(RuntimeError, match="not bound"):
        make_policy("fcfs").schedule(0.0)


@pytest.mark.parametrize("name", available_policies())
def test_an_unbound_policy_answers_its_prior(name):
    """The live service asks an unbound policy of its kind for the prediction it will use
    (`SchedulerService.prediction_used`), before any scheduler is bound."""
    from tests.unit.test_core_util import req

    policy = make_policy(name)
    with_prediction, without = req("a", 4, 100, predicted_len=40), req("b", 4, 100)
    expected = 100 if name == "oracle" else 40  # oracle: the true length (ignore_eos: 100)
    assert policy.initial_prediction(with_prediction) == expected
    assert policy.predicted_len(with_prediction) == expected
    assert policy.initial_prediction(without) in (100, 256)  # max_tokens, or the prior
