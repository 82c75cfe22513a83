"""The parts policies hold (policies/parts/), each on its own: the books they keep and the
order they give, checked against a direct computation."""

from __future__ import annotations

import pytest

from services.scheduler.core.policies.base import KnobError
from services.scheduler.core.policies.parts import admission
from services.scheduler.core.policies.parts.budget import StepLimits
from services.scheduler.core.policies.parts.fifo import ARRIVAL, PRIORITY
from services.scheduler.core.policies.parts.levels import LevelRule, Levels
from services.scheduler.core.policies.parts.protection import Protection, ProtectRule
from services.scheduler.core.policies.parts.ranking import RankRule, RemainingRank
from services.scheduler.core.policies.parts.reserve import Reservations
from tests.unit.test_core_util import SIMPLE, make_sched, plan, req


def sums_by_level(levels: Levels) -> list[float]:
    out = [0.0] * levels.rule.num_queues
    for rid, level in levels.level_of.items():
        out[level] += levels.rem.get(rid, 0.0)
    return out


def test_levels_keep_the_remaining_time_per_level_through_puts_aging_and_finish():
    levels = Levels(LevelRule(num_queues=4, aging_threshold_s=1.0, aging_per_step=None))
    a, b, c = req("a", 8, 8), req("b", 8, 8), req("c", 8, 8)
    levels.add(a, 3, 0.0, rem=2.0)
    levels.add(b, 1, 0.0, rem=0.5)
    levels.add(c, 9, 0.0, rem=7.0)  # clamped to the last level
    assert levels.level_of == {"a": 3, "b": 1, "c": 3}
    assert levels.level_rem == pytest.approx(sums_by_level(levels))
    levels.put(a, 2, rem=1.5)
    assert levels.level_rem == pytest.approx(sums_by_level(levels))
    levels.age(2.5)  # two thresholds waited: every waiter two levels up, b to the top
    assert levels.level_of == {"a": 0, "b": 0, "c": 1}
    assert levels.boost == {"a": 2, "b": 1, "c": 2}
    assert levels.level_rem == pytest.approx(sums_by_level(levels))
    levels.finish("a")
    assert "a" not in levels and "a" not in levels.boost and "a" not in levels.rem
    assert levels.level_rem == pytest.approx(sums_by_level(levels))
    assert [r.request_id for r in levels.in_order()] == ["b", "c"]


def test_levels_age_only_who_waits():
    s = make_sched("alise", aging_threshold_s=1.0, device_blocks=64)
    for rid in ("a", "b"):
        s.admit(req(rid, 32, 64, predicted_len=64))
    levels = s.policy.levels
    plan(s, 0.0)  # both run: neither waits any more
    assert levels.aging.since == {}
    levels.prev = {"a": None, "b": None}
    b = s.new_batch(0.5)
    b.scheduled = {"b": 1}
    levels.track_waits(b, 0.5)  # a sat this step out: it waits from now
    assert levels.aging.since == {"a": 0.5} and list(levels.prev) == ["b"]


def test_the_rank_buckets_predicted_remaining_time_and_doubles_what_outlives_it():
    boost: dict[str, int] = {}
    rank = RemainingRank(RankRule(queue_base_s=0.01, queue_ratio=2.0), SIMPLE, 8, boost)
    short, long = req("s", 4, 8, predicted_len=2), req("l", 4, 400, predicted_len=400)
    (ls, rs), (ll, rl) = rank.arrived(short), rank.arrived(long)
    assert rs == pytest.approx(SIMPLE.remaining_time(short, 2))
    assert rl == pytest.approx(SIMPLE.remaining_time(long, 400))
    assert ls == 0 < ll  # 2 tokens is under a 10 ms base; 400 are not
    boost["l"] = 1
    assert rank.level(long)[0] == ll - 1  # aging's levels come off
    short.output_token_ids.extend([7, 7])  # reached its prediction of 2
    rank.ran(short)
    assert rank.pred["s"] == 4 and rank.demotions["s"] == 1
    normalized = RemainingRank(RankRule(rank="normalized", rank_ref_len=4), SIMPLE, 8, {})
    assert normalized.arrived(long)[1] == pytest.approx(rl)  # the same time, another key
    with pytest.raises(KnobError, match="queue_ratio"):
        RankRule(queue_ratio=1.0)


def test_a_prior_replaces_the_arrival_prediction():
    rank = RemainingRank(RankRule(), SIMPLE, 8, {}, prior=lambda r: 5)
    r = req("a", 4, 100, predicted_len=90)
    rank.arrived(r)
    assert rank.initial(r) == 5 and rank.predicted(r) == 5
    plain = RemainingRank(RankRule(default_predicted_len=33), SIMPLE, 8, {})
    assert plain.initial(r) == 90 and plain.initial(req("b", 4, 10)) == 33


def test_protection_by_share_of_the_prediction_and_of_the_kv():
    s = make_sched("fcfs", device_blocks=100)
    pred = {"a": 10}
    by_len = Protection(ProtectRule(protect_fraction=0.5), s.block_manager, pred)
    a = req("a", 4, 10)
    assert not by_len.protected(a)
    a.output_token_ids.extend([7] * 5)
    assert by_len.protected(a)
    by_kv = Protection(ProtectRule(protect_kv_share=0.05), s.block_manager, pred)
    assert by_kv.kv_guard == 5
    s.admit(req("big", 16 * 6, 4))
    plan(s, 0.0)  # holds 6 blocks of 100
    assert by_kv.protected(s.requests["big"])
    with pytest.raises(KnobError):
        ProtectRule(protect_fraction=1.5)


def test_eviction_without_aging_takes_the_lowest_level_newest_first():
    s = make_sched("alise", aging_threshold_s=None, device_blocks=256)
    for rid, pred in (("short", 4), ("mid", 64), ("long", 1024), ("long2", 1024)):
        s.admit(req(rid, 16, 2048, predicted_len=pred))
    plan(s, 0.0)  # all four resident
    evict = s.policy.evict
    evict.begin([])
    order = [r.request_id for _, r in evict.candidates(s.new_batch(0.0))]
    assert order == ["long2", "long", "mid", "short"]


def test_eviction_with_aging_ranks_by_estimated_wait():
    s = make_sched("alise", aging_threshold_s=1.0, device_blocks=256)
    for rid, pred in (("a", 1024), ("b", 1024)):
        s.admit(req(rid, 16, 2048, predicted_len=pred))
    plan(s, 0.0)
    levels = s.policy.levels
    assert levels.level_of["a"] == levels.level_of["b"] > 0
    levels.aging.start("b", 0.0)  # b has waited since 0: it is promoted sooner
    evict = s.policy.evict
    evict.begin([])
    order = [r.request_id for _, r in evict.candidates(s.new_batch(0.9))]
    assert order == ["a", "b"]


def test_select_skips_what_does_not_fit_at_most_max_skips_times():
    s = make_sched("alise", aging_threshold_s=None)
    for rid, prompt, pred in (("big", 300, 1), ("small", 20, 2000), ("small2", 20, 2000)):
        s.admit(req(rid, prompt, 4, predicted_len=pred))
    levels = s.policy.levels
    assert [r.request_id for r in levels.in_order()] == ["big", "small", "small2"]
    b = s.new_batch(0.0, 100)
    assert [r.request_id for r, _ in admission.select(b, levels, 8, 1)] == ["small", "small2"]
    assert [r.request_id for r, _ in admission.select(b, levels, 8, 0)] == []
    assert [r.request_id for r, _ in admission.select(b, levels, 1, 2)] == ["small"]


def test_step_limits_bound_the_batch_by_tokens_and_the_job_limit():
    assert StepLimits.of(512, 256) == StepLimits(512, 256, None)
    assert StepLimits.of(64, 256) == StepLimits(64, 64, None)
    assert StepLimits.of(512, 256, 8) == StepLimits(512, 8, 8)


def test_orders_serve_by_arrival_or_by_priority_and_yield_the_last():
    s = make_sched("fcfs")
    for rid, prio, t in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 2, 2.0), ("d", 1, 3.0)):
        s.admit(req(rid, 4, 4, t=t, priority=prio))
    queue = s.waiting
    assert ARRIVAL.serve(queue) is None  # the queue's own order
    assert [r.request_id for r in ARRIVAL.victims(queue)] == ["d", "c", "b", "a"]
    assert [r.request_id for r in PRIORITY.serve(queue) or []] == ["b", "d", "a", "c"]
    assert [r.request_id for r in PRIORITY.victims(queue)] == ["c", "a", "d", "b"]


def test_reservations_promise_the_maximum_length_and_release_it():
    s = make_sched("fcfs", device_blocks=10, block_size=16)
    for rid in ("a", "b", "c"):
        s.admit(req(rid, 16, 48))  # 64 tokens at most: 4 blocks each
    reserve = Reservations(s, max_batch_size=8)
    reserve.admit(s.new_batch(0.0, 4096))
    assert reserve.promise == {"a": 4, "b": 4} and reserve.reserved == 8  # c would need 12
    reserve.release("a")
    assert reserve.reserved == 4 and "a" not in reserve.promise
