"""The served model's remaining-length forecasts in the scheduling core: taken into the request
by `Scheduler.update`, turned into a remaining length in one place (core/remaining.py), used by
`alise`/`hybrid` instead of blind doubling, limited preemption, and nothing changed without
them."""

import math

import pytest

from services.common.step import RemainingForecast, StepOutcome
from services.scheduler.core.policies.base import KnobError
from services.scheduler.core.remaining import (
    expected_remaining,
    forecast_points,
    gittins_key,
    remaining_tokens,
)
from tests.unit.test_core_util import drive, make_sched, plan, req


def _step(s, now, forecasts=None):
    """One step; every request that completes its known tokens samples token 7."""
    out = plan(s, now)
    sampled = {
        rid: (7, -0.5)
        for rid, n in out.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens
    }
    s.update(StepOutcome(out.step_id, sampled, 0.01, dict(forecasts or {})), now + 0.01)
    return out


def _fc(generated, q50, p_cap=0.0, spread=1.5):
    return RemainingForecast(generated, q50 / spread, q50, q50 * spread, p_cap)


def test_update_takes_the_forecast_into_the_request_and_the_prediction():
    s = make_sched("hybrid")
    r = req("a", 16, 500, predicted_len=20)
    s.admit(r)
    fc = _fc(1, 300.0)
    out = _step(s, 0.0, {"a": fc, "unknown": fc})  # the prefill step: forecast at generated=1
    assert out.new_requests[0].max_tokens == 500  # the probe's "tokens left" needs the cap
    assert r.forecast is fc
    assert abs(s.policy.rank.pred["a"] - (1 + 300)) <= 1  # the median left, not 20 doubled
    assert s.policy.rank.demotions.get("a") is None


def test_ranking_follows_a_forecast_of_an_early_end_against_running_to_the_cap():
    """Two requests with the same arrival prediction: the one whose forecast says it is about
    to end ranks above the one forecast to run to max_tokens, under every rule."""
    for rule in ("median", "quantile", "mean", "gittins"):
        s = make_sched("hybrid", forecast_rule=rule)
        a, b = req("a", 16, 400, predicted_len=100), req("b", 16, 400, predicted_len=100)
        s.admit(a)
        s.admit(b)
        _step(s, 0.0, {"a": _fc(1, 3.0), "b": _fc(1, 120.0, p_cap=0.9)})
        level = s.policy.levels.level_of
        assert level["a"] < level["b"], rule
        assert s.policy.rank.pred["a"] < 10 and s.policy.rank.pred["b"] > 300, rule


def test_no_forecast_keeps_the_old_behaviour():
    """Without forecasts (or with forecast_rule=off) every step is the same as before: the
    arrival prediction, doubled on a miss."""

    def run(**knobs):
        s = make_sched("hybrid", **knobs)
        reqs = [
            req(f"r{i}", 30 + 5 * i, 10 + 13 * i, t=0.002 * i, predicted_len=8) for i in range(8)
        ]
        trace = drive(s, reqs)
        return [(dict(o.num_scheduled_tokens), o.preempted_request_ids) for _, _, o in trace]

    assert run() == run(forecast_rule="off") == run(forecast_rule="gittins")
    s = make_sched("alise", queue_base_s=0.003, forecast_rule="median")
    job = req("j", 20, 40, predicted_len=5)
    demotions = []
    drive(s, [job], on_step=lambda s, o: demotions.append(s.policy.rank.demotions.get("j")))
    assert demotions[-2] == 3  # 5 -> 10 -> 20 -> 40, as without forecasts


def test_forecast_rule_off_ignores_forecasts_and_oracle_never_uses_them():
    for policy, knobs in (("hybrid", {"forecast_rule": "off"}), ("oracle", {})):
        s = make_sched(policy, **knobs)
        r = req("a", 16, 50, predicted_len=20)
        s.admit(r)
        _step(s, 0.0, {"a": _fc(1, 400.0)})
        assert r.forecast is not None
        assert s.policy.rank.pred["a"] in (20, 50)  # the prediction, or oracle's true length


def _limited(protect_fraction):
    """M = 1: `old` has run 30 tokens and its forecast says 40 more (30 of 70: 43%); `new`,
    predicted at 2 tokens, arrives. Returns the requests `new`'s arrival paused or offloaded."""
    s = make_sched("hybrid", gpu_job_limit=1, protect_fraction=protect_fraction, rank="remaining")
    old = req("old", 16, 100, predicted_len=40)
    s.admit(old)
    now = 0.0
    for _ in range(30):
        _step(s, now, {"old": _fc(old.num_output_tokens + 1, 40.0)})
        now += 0.01
    s.admit(req("new", 4, 2, t=now, predicted_len=2))
    out = _step(s, now)
    return s, out


def test_limited_preemption_protects_a_request_past_the_fraction():
    s, out = _limited(None)
    assert "old" not in out.num_scheduled_tokens and "new" in out.num_scheduled_tokens
    assert s.requests["old"].status.value == "swapped"  # offloaded past M
    s, out = _limited(0.4)  # 30 of a predicted 70 tokens: protected
    assert "old" in out.num_scheduled_tokens and not out.preempted_request_ids


def test_knobs_are_validated():
    for knobs in ({"forecast_rule": "p95"}, {"forecast_quantile": 1.0}, {"protect_fraction": 0}):
        with pytest.raises(KnobError):
            make_sched("hybrid", **knobs)


def test_points_follow_the_quantiles_and_the_cap():
    pts = forecast_points(RemainingForecast(0, 10.0, 20.0, 80.0, 0.0), cap=1000.0)
    assert len(pts) == 16 and pts == sorted(pts)
    assert pts[7] < 20.0 < pts[8] and pts[1] < 10.0 and pts[-2] > 80.0  # q10/q50/q90 kept
    capped = forecast_points(RemainingForecast(0, 10.0, 20.0, 80.0, 0.5), cap=100.0)
    assert capped[8:] == [100.0] * 8 and max(capped) == 100.0


def test_rules_on_a_heavy_tailed_forecast():
    """40% of the mass ends within ~5 tokens, 60% runs to a cap of 1000: the median is the
    cap, the mean in between, the Gittins key short (the request is worth trying: it ends
    soon with probability 0.4)."""
    pts = forecast_points(RemainingForecast(0, 2.0, 4.0, 8.0, 0.6), cap=1000.0)
    median = expected_remaining(pts, 0, "median", 0.7)
    mean = expected_remaining(pts, 0, "mean", 0.7)
    gittins = expected_remaining(pts, 0, "gittins", 0.7)
    assert median == 1000.0 and 550 < mean < 650 and gittins < 20
    assert gittins == pytest.approx(gittins_key(pts))
    # 10 tokens later the short half is gone: only the cap is left
    assert expected_remaining(pts, 10, "gittins", 0.7) == 990.0


def test_remaining_shifts_by_tokens_since_the_forecast_and_caps_at_max_tokens():
    r = req("a", 16, 60, ignore_eos=False)
    r.output_token_ids = [7] * 20
    r.forecast = RemainingForecast(10, 50.0, 100.0, 200.0, 0.0)
    pts = forecast_points(r.forecast, cap=50.0)  # max_tokens 60 - generated 10
    left = remaining_tokens(r, 8, "median", 0.7, pts)
    assert left == 40.0  # capped at what max_tokens still allows (60 - 20)
    assert remaining_tokens(r, 25, "median", 0.7, None) == 5.0  # no forecast: the prediction
    assert math.isclose(remaining_tokens(r, 8, "off", 0.7, pts), 1.0)  # outgrown: at least 1
