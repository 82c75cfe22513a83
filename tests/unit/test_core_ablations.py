"""Ablation knobs of `sarathi` (Sarathi-Serve Table 4) and `accelgen` (AccelGen Fig. 12): each
knob changes the schedule in a small scenario, and every ablated policy keeps the scheduling
invariants (check_step after every step, each request finishing exactly once)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab.sim.config import SimConfig, load_profile, parse_policy
from lab.sim.engine import Simulation
from lab.workload.traces.arrivals import poisson_arrivals
from lab.workload.traces.trace import Shape, build_trace
from lab.workload.traces.workloads import mixed_long_prompt_shapes
from services.scheduler.core.policies import make_policy
from services.scheduler.core.request import Slo
from tests.unit.test_core_properties import _requests
from tests.unit.test_core_util import EOS, SIMPLE, drive, make_sched, plan, req

# -- Sarathi-Serve: hybrid-batching-only / chunked-prefills-only ------------------------------


def _decoders_and_prompt(prompt_len=600, budget=128, **knobs):
    """Four decoding requests, then a long prompt arriving while they decode."""
    s = make_sched("sarathi", token_budget=budget, tile_size=16, device_blocks=1024, **knobs)
    decoders = [req(f"d{i}", 16, 60, t=0.0) for i in range(4)]
    big = req("big", prompt_len, 3, t=0.01)
    return drive(s, decoders + [big]), decoders, big


def test_sarathi_without_chunking_admits_the_whole_prompt_beside_decodes():
    trace, decoders, _ = _decoders_and_prompt(chunked_prefill=False)
    steps = [o for _, _, o in trace if "big" in o.num_scheduled_tokens]
    first = steps[0]
    assert first.num_scheduled_tokens["big"] == 600  # one step, past tau = 128
    assert {d.request_id for d in decoders} <= set(first.decode_request_ids)  # piggyback
    assert first.token_budget == first.total_num_scheduled_tokens > 128
    # budgeted steps without the prompt stay within tau
    assert all(o.token_budget == 128 for _, _, o in trace if "big" not in o.num_scheduled_tokens)


def test_sarathi_default_chunks_the_same_prompt():
    trace, _, _ = _decoders_and_prompt()
    chunks = [o.num_scheduled_tokens["big"] for _, _, o in trace if "big" in o.num_scheduled_tokens]
    assert max(chunks) <= 128 and sum(chunks[:-1]) + chunks[-1] >= 600 and len(chunks) >= 5


@pytest.mark.parametrize("chunked", [True, False])
def test_sarathi_whole_prompts_wait_when_the_leftover_budget_is_short(chunked):
    s = make_sched("sarathi", token_budget=128, tile_size=16, chunked_prefill=chunked)
    s.admit(req("a", 100, 4))
    s.admit(req("b", 100, 4))
    out = plan(s, 0.0)
    expect = {"a": 100, "b": 28} if chunked else {"a": 100}  # no chunk of b: it waits whole
    assert out.num_scheduled_tokens == expect


def test_sarathi_chunked_prefills_only_never_mixes_prefill_and_decode():
    trace, decoders, big = _decoders_and_prompt(hybrid_batching=False)
    kinds = []
    for _, _, o in trace:
        prefill = set(o.num_scheduled_tokens) - set(o.decode_request_ids)
        assert not (prefill and o.decode_request_ids), o.num_scheduled_tokens
        assert o.total_num_scheduled_tokens <= 128
        kinds.append("P" if prefill else "D")
    # while both kinds have work the steps alternate, so decodes wait at most one prefill step
    big_steps = [i for i, (_, _, o) in enumerate(trace) if o.num_scheduled_tokens.get("big", 0) > 1]
    assert len(big_steps) >= 5  # chunks of <= 128 tokens
    assert all(kinds[i + 1] == "D" for i in big_steps if i + 1 < len(kinds))
    assert all(kinds[i - 1] == "D" for i in big_steps[1:])
    assert all(d.num_output_tokens == 60 for d in decoders) and big.num_output_tokens == 3


def test_sarathi_default_mixes_prefill_chunks_with_decodes():
    trace, _, _ = _decoders_and_prompt()
    assert any(
        set(o.num_scheduled_tokens) - set(o.decode_request_ids) and o.decode_request_ids
        for _, _, o in trace
    )


def test_sarathi_chunked_prefills_only_runs_prefills_back_to_back_without_decodes():
    s = make_sched("sarathi", token_budget=64, tile_size=16, hybrid_batching=False)
    s.admit(req("p", 200, 2))
    trace = drive(s, [])
    assert [o.num_scheduled_tokens["p"] for _, _, o in trace] == [64, 64, 64, 8, 1]


def test_sarathi_ablation_knob_checks():
    with pytest.raises(ValueError, match="fcfs"):
        make_policy("sarathi", chunked_prefill=False, hybrid_batching=False)
    with pytest.raises(ValueError, match="hybrid_batching"):
        make_policy("sarathi", hybrid_batching="no")
    assert parse_policy("sarathi:chunked_prefill=false") == ("sarathi", {"chunked_prefill": False})


# -- AccelGen: /Chunk, /Order, /Batch ---------------------------------------------------------


def _accel(**knobs):
    knobs.setdefault("min_token_budget", 64)
    knobs.setdefault("max_token_budget", 64)
    return make_sched("accelgen", device_blocks=64, block_size=16, watermark=0.0, **knobs)


def test_accelgen_without_slack_ordering_admits_in_arrival_order():
    def first_step(**knobs):
        s = _accel(**knobs)
        s.admit(req("early", 64, 2, t=0.0, slo=Slo(ttft_s=10.0)))
        s.admit(req("late", 64, 2, t=0.0005, slo=Slo(ttft_s=0.002)))  # far less slack
        return plan(s, 0.001).num_scheduled_tokens

    assert first_step() == {"late": 64}
    assert first_step(slack_ordering=False) == {"early": 64}


def test_accelgen_without_slack_ordering_keeps_arrival_order_over_a_run():
    s = _accel(slack_ordering=False, max_num_seqs=1)
    reqs = [req(f"r{i}", 30, 3, t=0.0001 * i, slo=Slo(ttft_s=0.5 - 0.1 * i)) for i in range(4)]
    drive(s, reqs)
    firsts = [r.first_scheduled_time for r in reqs]
    assert firsts == sorted(firsts) and len(set(firsts)) == 4


def _window(**knobs):
    # admit_whole=False: a waiting prompt may be chunked into the last free blocks, so the
    # window's order decides what fills them
    s = _accel(admit_whole=False, **knobs)
    s.block_manager.allocate(req("hog", 60 * 16, 1), 60 * 16)  # leave 4 free blocks = 64 tokens
    for rid, n in (("c20", 20), ("a60", 60), ("b48", 48), ("e64", 64)):
        s.admit(req(rid, n, 2, t=0.0, slo=Slo(ttft_s=10.0)))
    return plan(s, 0.0).num_scheduled_tokens


def test_accelgen_without_multires_takes_the_window_in_queue_order():
    assert _window() == {"e64": 64}  # nearest (compute, KV) demand
    # queue order: c20 whole (2 blocks), then a60 chunked to the 2 blocks left; then KV is full
    assert _window(multires=False) == {"c20": 20, "a60": 32}


def test_accelgen_without_dynamic_chunking_has_one_fixed_budget():
    budgets = {}
    for dynamic in (True, False):
        for tbt in (0.02, 2.0):
            s = make_sched("accelgen", dynamic_chunking=dynamic)
            s.admit(req("r", 10, 2, slo=Slo(tbt_s=tbt)))
            budgets[dynamic, tbt] = plan(s, 0.0).token_budget
    assert budgets[True, 0.02] < budgets[True, 2.0]
    fixed = max(16, SIMPLE.token_budget(0.1875))  # S_b at default_tbt_s
    assert budgets[False, 0.02] == budgets[False, 2.0] == fixed


def test_accelgen_without_dynamic_chunking_takes_prompts_whole():
    s = _accel(dynamic_chunking=False)
    s.admit(req("x", 40, 2, t=0.0, slo=Slo(ttft_s=10.0)))
    s.admit(req("y", 40, 2, t=0.0, slo=Slo(ttft_s=10.0)))
    out = plan(s, 0.0)
    assert out.num_scheduled_tokens == {"x": 40}  # y is not chunked into 24
    s2 = _accel()
    s2.admit(req("x", 40, 2, t=0.0, slo=Slo(ttft_s=10.0)))
    s2.admit(req("y", 40, 2, t=0.0, slo=Slo(ttft_s=10.0)))
    assert sorted(plan(s2, 0.0).num_scheduled_tokens.values()) == [24, 40]


def test_accelgen_without_dynamic_chunking_runs_a_long_prompt_in_one_step():
    def prompt_steps(**knobs):
        s = _accel(**knobs)
        decoders = [req(f"d{i}", 8, 30, t=0.0, slo=Slo(ttft_s=10.0)) for i in range(3)]
        big = req("big", 600, 2, t=0.005, slo=Slo(ttft_s=10.0))
        trace = drive(s, decoders + [big])
        return [o for _, _, o in trace if o.num_scheduled_tokens.get("big", 0) > 1]

    whole = prompt_steps(dynamic_chunking=False)
    assert len(whole) == 1 and whole[0].num_scheduled_tokens["big"] == 600
    assert whole[0].token_budget == whole[0].total_num_scheduled_tokens > 64
    assert len(prompt_steps()) >= 600 // 64  # chunked by default


@pytest.mark.parametrize("knob", ["dynamic_chunking", "slack_ordering", "multires"])
def test_accelgen_ablation_knobs_are_booleans(knob):
    assert make_policy("accelgen", **{knob: False}).knobs.as_dict()[knob] is False
    with pytest.raises(ValueError, match=knob):
        make_policy("accelgen", **{knob: "off"})


# -- invariants -------------------------------------------------------------------------------

ABLATIONS = [
    ("sarathi", {"chunked_prefill": False}),
    ("sarathi", {"hybrid_batching": False}),
    ("sarathi", {"hybrid_batching": False, "preemption_mode": "swap"}),
    ("accelgen", {"dynamic_chunking": False}),
    ("accelgen", {"dynamic_chunking": False, "era": False}),
    ("accelgen", {"slack_ordering": False}),
    ("accelgen", {"multires": False}),
    ("accelgen", {"slack_ordering": False, "multires": False, "preemption_mode": "swap"}),
]
ABLATION_IDS = [p + ":" + ",".join(f"{k}={v}" for k, v in kn.items()) for p, kn in ABLATIONS]


@pytest.mark.parametrize("policy,knobs", ABLATIONS, ids=ABLATION_IDS)
def test_ablations_finish_every_request_once_in_the_simulator(policy, knobs):
    pool = [Shape(20 + (i * 37) % 900, 5 + (i * 53) % 200) for i in range(97)]
    items = build_trace(
        mixed_long_prompt_shapes(pool, 150, long_share=0.0, seed=3),
        poisson_arrivals(150, 12.0, seed=3),
    )
    config = SimConfig(policy=policy, knobs=knobs, num_device_blocks=400, num_host_blocks=2000)
    sim = Simulation(items, config, profile=load_profile("a100-80g/llama-2-7b")).run()
    assert sim.finish_count == {i.request_id: 1 for i in items}
    for item in items:
        rec = sim.requests[item.request_id]
        assert rec.num_output_tokens == item.output_len == len(rec.token_times)
    for ex in sim.executors:
        ex.scheduler.block_manager.check_invariants()


@pytest.mark.parametrize("policy,knobs", ABLATIONS, ids=ABLATION_IDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    device_tokens=st.integers(48, 600),
    host_blocks=st.integers(0, 40),
)
def test_ablations_keep_step_invariants_on_random_workloads(
    policy, knobs, seed, n, block_size, device_tokens, host_blocks
):
    rng = random.Random(seed)
    knobs = dict(
        knobs,
        **(
            {"token_budget": 32, "tile_size": 16}
            if policy == "sarathi"
            else {"max_token_budget": 48}
        ),
    )
    s = make_sched(
        policy,
        device_blocks=max(4, device_tokens // block_size),
        host_blocks=host_blocks,
        block_size=block_size,
        max_model_len=256,
        **knobs,
    )
    reqs = _requests(rng, n, s.max_model_len)
    drive(s, reqs, token=lambda r, i: EOS if rng.random() < 0.1 else 11, max_steps=20_000)
    assert not s.has_unfinished and all(r.finish_reason in ("stop", "length") for r in reqs)
    assert s.block_manager.num_free_device_blocks == s.block_manager.num_device_blocks
