"""Property tests: random arrivals, lengths, pools, knobs and sampled tokens never break block
invariants, budgets or pools (checked after every step by `check_step`), and every request
finishes, for every policy."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.step import RemainingForecast, StepOutcome
from services.scheduler.core.policies import available_policies
from services.scheduler.core.request import Request, Slo
from tests.unit.test_core_util import EOS, check_step, drive, make_sched, plan

POLICIES = available_policies()
KNOBS = {
    "fcfs": [{}, {"preemption_mode": "swap"}],
    "priority": [{}, {"preemption_mode": "swap", "max_num_seqs": 3}],
    "sarathi": [
        {"token_budget": 32, "tile_size": 16},
        {"preemption_mode": "swap", "token_budget": 64},
    ],
    "alise": [
        {},
        {"memory_mode": "recompute"},
        {"memory_mode": "defer"},
        {"gpu_job_limit": 3, "aging_threshold_s": 0.01},
        {"gpu_job_limit": 2, "forecast_rule": "gittins", "protect_fraction": 0.5},
    ],
    "oracle": [{}, {"memory_mode": "recompute"}],
    "fastserve": [{}, {"memory_mode": "defer", "aging_threshold_s": 0.02}],
    "accelgen": [{}, {"max_token_budget": 48, "default_ttft_s": 0.01, "preemption_mode": "swap"}],
    "hybrid": [
        {},
        {"token_budget": 32, "tile_size": 16, "memory_mode": "recompute"},
        {"tbt_slo_s": 0.01, "tile_size": 8, "gpu_job_limit": 2, "preempt_level_gap": 1},
        {"gpu_job_limit": 3, "forecast_rule": "quantile", "protect_kv_share": 0.2},
        {"gpu_job_limit": 2, "preempt_level_gap": 1, "protect_fraction": 0.3},
    ],
    "orca": [{}, {"max_batch_size": 2}],
    "request": [{}, {"max_batch_size": 3}],
}


def test_every_policy_has_property_knob_sets():
    assert sorted(KNOBS) == sorted(POLICIES)


workload = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 10_000),
        "n": st.integers(1, 14),
        "block_size": st.sampled_from([1, 4, 16]),
        "device_tokens": st.integers(48, 600),
        "host_blocks": st.integers(0, 40),
        "knob_set": st.integers(0, 3),
        "prefix_caching": st.booleans(),
    }
)


def _requests(rng, n, max_len):
    reqs = []
    for i in range(n):
        prompt = rng.randint(1, min(120, max_len - 1))
        out = rng.randint(1, 60)
        ignore = rng.random() < 0.5
        slo = Slo(
            ttft_s=rng.choice([None, 0.005, 0.5]),
            tbt_s=rng.choice([None, 0.002, 0.05]),
            deadline_s=rng.choice([None, None, 0.3]),
        )
        reqs.append(
            Request(
                f"r{i}",
                [3] * prompt,
                out,
                rng.random() * 0.05,
                ignore_eos=ignore,
                eos_token_ids=(EOS,),
                min_tokens=rng.randint(0, min(out, 3)),
                predicted_len=rng.choice([None, rng.randint(1, 80)]),
                slo=slo,
                true_len=rng.choice([None, out]),
            )
        )
    return reqs


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workload)
def test_random_workloads_finish_within_limits(policy, w):
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    blocks = max(4, w["device_tokens"] // bs)
    knobs = KNOBS[policy][w["knob_set"] % len(KNOBS[policy])]
    s = make_sched(
        policy,
        device_blocks=blocks,
        host_blocks=w["host_blocks"],
        block_size=bs,
        max_model_len=256,
        prefix_caching=w["prefix_caching"],
        **knobs,
    )
    reqs = _requests(rng, w["n"], s.max_model_len)
    eos_rate = rng.choice([0.0, 0.05, 0.3])

    def token(r, i):
        if rng.random() < 0.3:  # a forecast of the served model (read by alise/hybrid)
            q50 = rng.choice([1.0, 5.0, 40.0])
            r.forecast = RemainingForecast(i, q50 / 2, q50, q50 * 3, rng.choice([0.0, 0.9]))
        return EOS if rng.random() < eos_rate else 11

    drive(s, reqs, token=token, max_steps=20_000)
    bm = s.block_manager
    assert not s.has_unfinished
    assert bm.num_free_device_blocks == bm.num_device_blocks
    bm.begin_step()
    assert bm.num_free_host_blocks == bm.num_host_blocks
    for r in reqs:
        assert r.is_finished and r.finish_reason in ("stop", "length")
        assert 1 <= r.num_output_tokens <= r.max_tokens
        assert r.num_tokens <= s.max_model_len
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == s.max_model_len
        else:
            assert r.output_token_ids[-1] == EOS and r.num_output_tokens >= r.min_tokens
        assert r.token_times == sorted(r.token_times) and r.first_scheduled_time >= r.arrival_time


def test_accelgen_swapped_in_request_that_cannot_grow_is_not_retried_forever():
    """Regression (found by the property test): a request swapped in during a step, whose
    chunk then did not fit, could neither be preempted nor scheduled, yet was re-queued as
    preempted, so one `schedule` call popped and retried it forever."""
    rng = random.Random(6)
    bs = rng.choice([1, 4, 16])
    blocks, host, n = max(4, rng.randint(48, 600) // bs), rng.randint(0, 40), rng.randint(1, 14)
    s = make_sched(
        "accelgen",
        device_blocks=blocks,
        host_blocks=host,
        block_size=bs,
        max_model_len=256,
        **KNOBS["accelgen"][1],
    )
    reqs = _requests(rng, n, s.max_model_len)
    eos_rate = rng.choice([0.0, 0.05, 0.3])
    drive(s, reqs, token=lambda r, i: EOS if rng.random() < eos_rate else 11, max_steps=20_000)
    assert all(r.is_finished for r in reqs)


# -- prefix caching: sharing, eviction, swaps, recompute and aborts ----------------------------
CACHE_POLICIES = {
    "fcfs": {"preemption_mode": "swap"},
    "sarathi": {"token_budget": 48, "tile_size": 16},
    "hybrid": {"token_budget": 64, "tile_size": 16},
    "alise": {"memory_mode": "recompute"},
    "accelgen": {"preemption_mode": "swap", "max_token_budget": 64},
}


class _CachedWorkload:
    """300 requests made on the fly: shared system prompts, follow-ups that extend a finished
    request's tokens (multi-turn) and fresh prompts, from a tiny vocabulary (accidental
    sharing too); random aborts while waiting, running or swapped."""

    def __init__(self, rng, s, total=300):
        self.rng, self.s, self.total, self.made = rng, s, total, 0
        self.systems = [[rng.randrange(6) for _ in range(rng.randint(4, 40))] for _ in range(3)]
        self.finished: list[Request] = []
        self.reqs: list[Request] = []

    def prompt(self):
        rng, kind = self.rng, self.rng.random()
        tail = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
        if kind < 0.35 and self.finished:
            return rng.choice(self.finished).all_token_ids + tail  # the next turn
        if kind < 0.75:
            return rng.choice(self.systems) + tail
        return tail

    def add(self, now):
        rng = self.rng
        prompt = self.prompt()[: self.s.max_model_len - 2]
        r = Request(
            f"q{self.made}",
            prompt,
            rng.randint(1, 24),
            now,
            eos_token_ids=(EOS,),
            ignore_eos=rng.random() < 0.5,
            predicted_len=rng.choice([None, rng.randint(1, 30)]),
            slo=Slo(ttft_s=rng.choice([None, 0.01]), tbt_s=rng.choice([None, 0.005])),
        )
        self.made += 1
        self.s.admit(r)
        self.reqs.append(r)

    def abort_some(self, now):
        live = [r for r in self.reqs if not r.is_finished]
        if live and self.rng.random() < 0.08:
            self.s.abort(self.rng.choice(live).request_id, now)


@pytest.mark.parametrize("policy", sorted(CACHE_POLICIES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 4, 16]))
def test_prefix_cache_leaks_nothing_over_300_random_requests(policy, seed, block_size):
    rng = random.Random(seed)
    blocks = max(8, rng.randint(160, 640) // block_size)
    s = make_sched(
        policy,
        device_blocks=blocks,
        host_blocks=rng.randint(0, 30),
        block_size=block_size,
        max_model_len=192,
        prefix_caching=True,
        **CACHE_POLICIES[policy],
    )
    w = _CachedWorkload(rng, s)
    now, concurrency = 0.0, rng.randint(3, 12)
    for _ in range(50_000):
        while w.made < w.total and len(s.requests) < concurrency:
            w.add(now)
        if not s.has_unfinished and w.made == w.total:
            break
        w.abort_some(now)
        out = plan(s, now)
        check_step(s, out)
        if out.num_scheduled_tokens or out.swap_out or out.swap_in:
            reqs = s.requests
            sampled = {
                rid: (EOS if rng.random() < 0.1 else rng.randrange(6), -0.1)
                for rid, n in out.num_scheduled_tokens.items()
                if reqs[rid].num_computed_tokens + n >= reqs[rid].num_tokens
            }
            now += max(s.cost_model.step_time(out.shape), 1e-4)
            for u in s.update(StepOutcome(out.step_id, sampled, 0.0), now):
                if u.finished:
                    w.finished.append(reqs[u.request_id])
    bm = s.block_manager
    assert w.made == 300 and not s.has_unfinished
    assert all(r.is_finished for r in w.reqs)
    assert bm.num_free_device_blocks == bm.num_device_blocks  # free or cached-evictable
    assert not any(bm.cache.ref) and bm.num_device_blocks_of("q0") == 0
    bm.begin_step()
    assert bm.num_free_host_blocks == bm.num_host_blocks
    assert s.stats()["prefix_cache_hits"] > 0  # the workload does share prefixes
