"""`hybrid`'s SLO-driven steps: steps sized in time (tbt_slo_s and per-request TBT objectives,
with each chunk charged its context and the fitted attention term), the prefill lane for a
TTFT objective only a step of its own can meet, and missed TTFT objectives losing urgency."""

import pytest

from services.common.step import StepOutcome
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.policies.parts.steptime import AttentionFit, chunk_time, chunk_tokens
from services.scheduler.core.request import Slo
from tests.unit.test_core_util import SIMPLE, drive, make_sched, plan, req

# context reads that matter: 1 us per token of context (a long prompt's chunk pays for it)
READS = CostModel(c0=1e-3, c_prefill=1e-4, c_decode=1e-4, c_context=1e-6)


def _apply(s, out, now, elapsed=None):
    """Apply `out` as if it ran for `elapsed` (default: the cost model's time)."""
    elapsed = s.cost_model.step_time(out.shape) if elapsed is None else elapsed
    sampled = {
        rid: (7, -0.5)
        for rid, n in out.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens
    }
    s.update(StepOutcome(out.step_id, sampled, elapsed), now + elapsed)
    return now + elapsed


def _decoding(s, n, context, slo=None, now=0.0):
    """`n` requests decoding (prompt of `context` tokens, long answers); returns the time."""
    for i in range(n):
        s.admit(req(f"d{i}", context, 500, t=now, slo=slo or Slo()))
    while any(s.requests[f"d{i}"].num_output_tokens == 0 for i in range(n)):
        now = _apply(s, plan(s, now), now)
    return now


def test_tbt_target_sizes_each_step_in_time_with_the_decodes_it_carries():
    """tau from tbt_slo_s is computed for a step without decodes (static, as Sarathi); hybrid
    instead fits every step to the target with the decodes and context it actually holds."""
    target = 0.05
    budgets = {}
    for n in (2, 40):
        s = make_sched(
            "hybrid",
            cost=READS,
            efficiency=None,
            device_blocks=4096,
            tbt_slo_s=target,
            tile_size=16,
        )
        now = _decoding(s, n, 300)
        s.admit(req("big", 4000, 2, t=now))
        out = plan(s, now)
        assert READS.step_time(out.shape) <= target
        budgets[n] = out.token_budget
        static = make_sched(
            "hybrid", cost=READS, efficiency=None, tbt_slo_s=target, slo_aware_budget=False
        )
        assert static.policy.limits.tokens == READS.token_budget(target, 128)  # the old, static tau
    assert budgets[40] < budgets[2]


def test_a_chunk_is_charged_the_reads_of_its_own_context():
    """The second chunk of a long prompt reads the first one: a token count sized for the
    decodes alone would overrun the step's time by those reads."""
    s = make_sched(
        "hybrid", cost=READS, device_blocks=4096, max_model_len=16384, tbt_slo_s=0.2, tile_size=16
    )
    now = _decoding(s, 4, 100)
    s.admit(req("big", 9000, 2, t=now))
    for _ in range(3):  # three chunks: the later ones carry thousands of tokens of context
        out = plan(s, now)
        assert "big" in out.num_scheduled_tokens
        assert READS.step_time(out.shape) <= 0.2 + 1e-9
        now = _apply(s, out, now)
    assert s.requests["big"].num_computed_tokens > 2500


def test_attention_fit_recovers_the_missing_quadratic_term():
    fit = AttentionFit()
    coef = 3e-9
    for pairs in (1e5, 4e6, 2.5e7, 9e6):
        fit.observe(0.01 + coef * pairs, 0.01, pairs)
    assert fit.coef == pytest.approx(coef)
    fit.observe(0.02, 0.03, 1e6)  # a faster step than modelled pulls it down, never below 0
    assert 0 <= fit.coef < coef
    cost, ctx = READS, 8000
    m = chunk_tokens(cost, coef, 0.05, ctx, 10_000)
    spent = m * (cost.c_prefill + cost.c_context) + chunk_time(cost, coef, ctx, m)
    more = (m + 1) * (cost.c_prefill + cost.c_context) + chunk_time(cost, coef, ctx, m + 1)
    assert spent <= 0.05 < more
    assert chunk_tokens(cost, 1e-30, 0.05, 700, 10_000) > 0  # no cancellation to zero


def test_hybrid_learns_the_attention_term_from_step_times():
    s = make_sched(
        "hybrid", cost=READS, device_blocks=4096, max_model_len=16384, tbt_slo_s=0.1, tile_size=16
    )
    s.admit(req("big", 12000, 2, t=0.0))
    now, coef = 0.0, 2e-8
    while s.requests["big"].num_output_tokens == 0:
        out = plan(s, now)
        pairs = AttentionFit.pairs(out.num_scheduled_tokens, s.requests)
        now = _apply(s, out, now, READS.step_time(out.shape) + coef * pairs)
    assert s.policy.attention.coef == pytest.approx(coef, rel=1e-6)
    s.admit(req("next", 12000, 2, t=now))
    for _ in range(3):
        out = plan(s, now)
        pairs = AttentionFit.pairs(out.num_scheduled_tokens, s.requests)
        assert READS.step_time(out.shape) + coef * pairs <= 0.1 + 1e-9  # its chunks now fit
        now = _apply(s, out, now, READS.step_time(out.shape) + coef * pairs)


def test_late_decodes_do_not_bound_the_step():
    s = make_sched("hybrid", cost=READS, efficiency=None, device_blocks=4096, tile_size=16)
    now = _decoding(s, 3, 100, slo=Slo(tbt_s=0.02))
    assert s.policy.decode_slack(s.requests["d0"], now) == pytest.approx(0.02)
    s.admit(req("big", 4000, 2, t=now))
    tight = plan(s, now).token_budget
    s2 = make_sched("hybrid", cost=READS, efficiency=None, device_blocks=4096, tile_size=16)
    later = _decoding(s2, 3, 100, slo=Slo(tbt_s=0.02)) + 0.05  # every next token already late
    s2.admit(req("big", 4000, 2, t=later))
    assert plan(s2, later).token_budget > tight


def test_prefill_lane_runs_a_prompt_alone_when_that_meets_its_ttft():
    """Loose decodes sit out a short step so that a prompt whose TTFT objective is its lone
    prefill time meets it; a tight decode and a decode without objective stay in."""
    s = make_sched("hybrid", cost=READS, efficiency=None, device_blocks=4096, tile_size=16)
    loose = [req(f"l{i}", 50, 500, t=0.0, slo=Slo(tbt_s=1.0)) for i in range(6)]
    tight = req("tight", 50, 500, t=0.0, slo=Slo(tbt_s=0.004))
    plain = req("plain", 50, 500, t=0.0)
    now = 0.0
    for r in loose + [tight, plain]:
        s.admit(r)
    while any(r.num_output_tokens < 2 for r in loose + [tight, plain]):
        now = _apply(s, plan(s, now), now)
    lone = READS.iteration_time(200, 0, 200)
    s.admit(req("chat", 200, 5, t=now, slo=Slo(ttft_s=lone * 1.05, tbt_s=1.0)))
    out = plan(s, now)
    assert out.num_scheduled_tokens.get("chat") == 200
    assert set(out.num_scheduled_tokens) == {"chat", "tight", "plain"}
    assert READS.step_time(out.shape) <= lone * 1.05
    off = make_sched(
        "hybrid", cost=READS, efficiency=None, device_blocks=4096, tile_size=16, prefill_lane=False
    )
    for r in [req(f"l{i}", 50, 500, t=0.0, slo=Slo(tbt_s=1.0)) for i in range(6)]:
        off.admit(r)
    t = 0.0
    while any(off.requests[f"l{i}"].num_output_tokens < 2 for i in range(6)):
        t = _apply(off, plan(off, t), t)
    off.admit(req("chat", 200, 5, t=t, slo=Slo(ttft_s=lone * 1.05, tbt_s=1.0)))
    assert len(plan(off, t).num_scheduled_tokens) == 7  # a shared step: decodes and chat


def test_missed_ttft_objectives_no_longer_jump_the_queue():
    """Two prompts whose TTFT passed long ago and one whose TTFT can still be met, one slot:
    the one that can still meet it goes first (EDF over missed deadlines would take the
    oldest)."""
    s = make_sched("hybrid", token_budget=64, tile_size=16, max_num_seqs=1, prefill_lane=False)
    s.admit(req("old1", 40, 5, t=0.0, slo=Slo(ttft_s=0.001)))
    s.admit(req("old2", 40, 5, t=0.0, slo=Slo(ttft_s=0.002)))
    s.admit(req("fresh", 40, 5, t=0.5, slo=Slo(ttft_s=0.004)))  # due: its prefill estimate
    out = plan(s, 0.5)
    assert list(out.num_scheduled_tokens) == ["fresh"]


def test_without_objectives_hybrid_keeps_a_static_tau():
    """No TBT or TTFT objective anywhere: every step packs against the static tau (the
    step-time curve's, or Sarathi's 512 with `efficiency=None`)."""
    from services.scheduler.core.policies.parts.steptime import efficient_chunk

    for knobs, tau in (({}, efficient_chunk(SIMPLE, 0.9, 128, 512)), ({"efficiency": None}, 512)):
        s = make_sched("hybrid", device_blocks=1024, **knobs)
        decoders = [req(f"d{i}", 16, 50, t=0.0) for i in range(4)]
        trace = drive(s, decoders + [req("big", 3000, 2, t=0.001)])
        assert {out.token_budget for _, _, out in trace} == {tau}
        assert SIMPLE.step_time(trace[-1][2].shape) > 0


def test_lane_miss_limit_keeps_a_long_prompt_from_stalling_many_decodes():
    """A long prompt's lane is longer than every decode's objective: each of them misses once.
    `lane_max_misses` bounds that number (the goodput / iteration-attainment trade-off)."""

    def first_step(**knobs):
        s = make_sched("hybrid", cost=READS, device_blocks=4096, max_model_len=16384, **knobs)
        now = 0.0
        for i in range(6):
            s.admit(req(f"d{i}", 50, 500, t=0.0, slo=Slo(tbt_s=0.05)))
        while any(s.requests[f"d{i}"].num_output_tokens < 2 for i in range(6)):
            now = _apply(s, plan(s, now), now)
        lone = READS.iteration_time(6000, 0, 6000)
        s.admit(req("doc", 6000, 5, t=now, slo=Slo(ttft_s=lone * 1.1, tbt_s=0.05)))
        return plan(s, now).num_scheduled_tokens

    assert first_step().get("doc") == 6000  # the whole prompt in one step: 6 decodes miss
    assert first_step(lane_max_misses=3).get("doc", 0) < 6000  # chunked instead
    with pytest.raises(ValueError, match="lane_max_misses"):
        make_sched("hybrid", lane_max_misses=-1)
