"""Level queues and the aging clock (policies/parts/levels.py)."""

import signal

import pytest

from services.scheduler.core.policies.parts.levels import AgingClock
from tests.unit.test_core_util import make_sched, req

NOW = 1.7e9  # a wall-clock `now` (time.time()) against an arrival stamped 0.0


@pytest.fixture
def hang_guard():
    """Fail instead of hanging if due() ever loops once per elapsed period again."""

    def boom(*_):
        raise AssertionError("AgingClock.due() did not return within 60 s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_due_counts_periods_and_fires_each_once_per_period():
    clock = AgingClock(5.0)
    clock.start("a", 0.0)
    clock.start("b", 3.0)
    assert clock.due(4.9) == {}
    assert clock.due(5.0) == {"a": 1}
    assert clock.due(9.9) == {"b": 1}  # b: 8
    clock.start("c", 9.9)
    assert clock.due(23.0) == {"a": 3, "b": 3, "c": 2}  # a: 10 15 20, b: 13 18 23, c: 14.9 19.9
    clock.stop("a")
    assert clock.due(1000.0) == {"b": 195, "c": 196}  # b: 28..998, c: 24.9..999.9
    assert len(clock._heap) == 2  # a's entry is gone once popped


def _naive_fires(starts, stops, calls, k):
    """Reference: every request fires at start + k, start + 2k, ... while it waits."""
    out = []
    prev = float("-inf")
    for now in calls:
        fired = {}
        for rid, t0 in starts.items():
            end = stops.get(rid, float("inf"))
            n = sum(1 for i in range(1, 200) if prev < t0 + i * k <= min(now, end - 1e-9))
            if n and now < end:
                fired[rid] = n
        out.append(fired)
        prev = now
    return out


@pytest.mark.parametrize("seed", range(5))
def test_due_matches_a_per_period_reference(seed):
    import random

    rng = random.Random(seed)
    k = rng.choice([0.5, 1.0, 2.5])
    starts = {f"r{i}": round(rng.uniform(0, 20), 2) for i in range(8)}
    stops = {
        rid: t + round(rng.uniform(0.1, 30), 2) for rid, t in starts.items() if rng.random() < 0.5
    }
    calls = sorted(round(rng.uniform(0, 60), 2) for _ in range(12))
    events = sorted(
        [(t, 0, rid) for rid, t in starts.items()]
        + [(t, 1, rid) for rid, t in stops.items()]
        + [(t, 2, None) for t in calls]
    )
    clock, got = AgingClock(k), []
    for t, kind, rid in events:
        if kind == 0:
            clock.start(rid, t)
        elif kind == 1:
            clock.stop(rid)
        else:
            got.append(clock.due(t))
    assert got == _naive_fires(starts, stops, calls, k)


def test_due_after_a_huge_gap_is_one_pop(hang_guard):
    clock = AgingClock(5.0)
    clock.start("a", 0.0)
    assert clock.due(NOW) == {"a": int(NOW // 5.0)}
    assert len(clock._heap) == 1 and clock.due(NOW + 1.0) == {}
    next_due = clock._heap[0][0]
    assert NOW < next_due <= NOW + 5.0
    assert clock.due(next_due) == {"a": 1}


@pytest.mark.parametrize("policy", ["alise", "fastserve"])
def test_request_that_arrived_at_zero_ages_to_the_top_at_once(policy, hang_guard):
    s = make_sched(policy, aging_threshold_s=5.0)
    long = req("long", 3000, 2000, t=0.0)  # enters a low level
    s.admit(long)
    level = s.policy.levels.level_of["long"]
    assert level > 0
    out = s.schedule(NOW)  # wall clock vs. arrival 0.0
    assert s.policy.levels.level_of["long"] == 0 and s.policy.levels.boost["long"] == level
    assert out.num_scheduled_tokens == {"long": 3000}


def test_due_with_a_limit_spreads_a_cohort_and_keeps_every_period():
    clock = AgingClock(5.0)
    for rid in "abcde":
        clock.start(rid, 0.0)
    assert clock.due(5.0, limit=2) == {"a": 1, "b": 1}
    assert clock.due(5.0, limit=2) == {"c": 1, "d": 1}
    assert clock.due(11.0, limit=2) == {"e": 2, "a": 1}  # e waited 5 and 10: both count
    assert clock.due(11.0) == {"b": 1, "c": 1, "d": 1}


def test_aging_per_step_bounds_promotions_per_step():
    s = make_sched("alise", aging_threshold_s=1.0, aging_per_step=3)
    for i in range(7):
        s.admit(req(f"w{i}", 2000, 2000, t=0.0))  # a cohort, all below the top
    before = dict(s.policy.levels.level_of)
    assert min(before.values()) > 0
    promoted = []
    for _ in range(3):
        s.policy.levels.age(1.5)
        after = s.policy.levels.level_of
        promoted.append(sum(1 for rid in before if after[rid] == before[rid] - 1))
    assert promoted == [3, 6, 7]
    with pytest.raises(ValueError, match="aging_per_step"):
        make_sched("alise", aging_per_step=0)
