"""`alise bench live-robust`'s bookkeeping: resuming skips the runs already measured, the
paired intervals and verdicts follow the numbers, the state-forecast predictions come from
the other seeds' draws only, and the profile check reads a step trace."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench.bench_live_robust import (
    key_of,
    plan,
    profile_check,
    ratio_interval,
    state_forecasts,
    summarize,
)
from bench.live_ceiling import served_profile


def _args(**kw) -> argparse.Namespace:
    base = dict(rates="1,4", temperatures="1,0", seeds=2, arms="fcfs,fcfs_aa,hybrid")
    return argparse.Namespace(**(base | kw))


def test_plan_skips_what_was_measured_and_orders_seed_by_seed():
    full = plan(_args(), set())
    assert len(full) == 2 * 2 * 2 * 3
    assert [r["seed"] for r in full] == sorted(r["seed"] for r in full)
    done = {key_of(r) for r in full[:5]}
    rest = plan(_args(), done)
    assert rest == full[5:]
    with pytest.raises(argparse.ArgumentTypeError):
        plan(_args(arms="fcfs,srpt"), set())


def test_ratio_interval_is_a_paired_geometric_mean_with_a_t_interval():
    got = ratio_interval([(1.1, 1.0), (2.2, 2.0), (0.55, 0.5)])
    assert got["mean"] == pytest.approx(1.1) and got["n"] == 3
    assert got["lo"] == pytest.approx(1.1) and got["hi"] == pytest.approx(1.1)  # no spread
    spread = ratio_interval([(1.2, 1.0), (1.0, 1.0), (0.9, 1.0)])
    assert spread["lo"] < spread["mean"] < spread["hi"]
    logs = [math.log(1.2), 0.0, math.log(0.9)]
    assert math.log(spread["mean"]) == pytest.approx(sum(logs) / 3)
    assert ratio_interval([(1.0, 1.0)]) is None


def _point(arm, seed, mnl, tbt, temperature=1.0, rate=4.0, lens=(10, 20), **extra):
    return {
        "arm": arm, "seed": seed, "rate": rate, "temperature": temperature,
        "mean_normalized_latency": mnl, "p99_tbt_s": tbt,
        "requests": {"id": ["a", "b"], "output_len": list(lens)}, **extra,
    }  # fmt: skip


def test_summary_verdicts_follow_the_numbers():
    points = []
    for seed, (f, a, h) in enumerate([(1.0, 1.02, 0.9), (1.2, 1.18, 1.09), (0.8, 0.81, 0.71)]):
        points += [_point("fcfs", seed, f, 2.0), _point("fcfs_aa", seed, a, 2.1),
                   _point("hybrid", seed, h, 1.0)]  # fmt: skip
    (group,) = summarize(points)
    assert group["seeds"] == 3 and group["never_worse"] is True
    assert group["hybrid_mnl_ratio"]["hi"] < 1.0  # a gain outside the noise
    assert group["aa_mnl_ratio"]["lo"] < 1.0 < group["aa_mnl_ratio"]["hi"]
    assert group["p99_tbt_met"] is True
    worse = [p | {"mean_normalized_latency": 2.0} if p["arm"] == "hybrid" else p for p in points]
    (group,) = summarize(worse)
    assert group["never_worse"] is False
    assert group["hybrid_mnl_ratio"]["lo"] > 1.0


def test_state_forecasts_use_only_the_other_seeds_at_the_same_temperature():
    mine = _point("hybrid", 0, 1.0, 1.0, lens=(100, 100))
    others = [
        _point("fcfs", 1, 1.0, 1.0, lens=(10, 30)),
        _point("hybrid", 2, 1.0, 1.0, lens=(20, 50)),
        _point("fcfs_aa", 2, 1.0, 1.0, lens=(30, 40)),
        _point("fcfs", 3, 1.0, 1.0, temperature=0.0, lens=(999, 999)),
    ]
    assert state_forecasts(mine, [mine, others[0]]) is None  # one other seed only
    table = state_forecasts(mine, [mine, *others])
    assert table == {"a": 20, "b": 40}


def test_profile_check_compares_decode_steps_with_the_profile(tmp_path):
    from services.scheduler.core.cost_model import CostModel

    profile = served_profile()
    cost = CostModel.from_profile(profile)
    rows = []
    for decode, n in ((1, 5), (8, 4), (32, 3), (64, 1)):
        t = cost.iteration_time(0, decode, 100 * decode)
        rows += [{"prefill": 0, "decode": decode, "context": 100 * decode, "exec_s": t}] * n
    rows.append({"prefill": 50, "decode": 1, "context": 150, "exec_s": 9.0})  # not a decode step
    steps = tmp_path / "steps.jsonl"
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = profile_check(steps, profile)
    assert set(got["batches"]) == {"1", "8", "32"} and got["within_10pct"] is True
    slow = [r | {"exec_s": r["exec_s"] * 1.2} if r["decode"] == 8 else r for r in rows]
    steps.write_text("".join(json.dumps(r) + "\n" for r in slow))
    assert profile_check(steps, profile)["within_10pct"] is False
