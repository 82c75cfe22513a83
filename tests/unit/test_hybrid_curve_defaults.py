"""`hybrid`'s default token budget comes from the step-time curve (`steptime.efficient_chunk`,
`hybrid.curve_defaults`); the opt-in job limit from it too (`efficient_batch`,
`job_limit_efficiency`), and that limit holds new work back without ever pausing a running
request."""

from __future__ import annotations

import pytest

from services.scheduler.core.cost_model import CostModel, roofline_profile
from services.scheduler.core.policies.hybrid import TYPICAL_CONTEXT, HybridKnobs, curve_defaults
from services.scheduler.core.policies.parts.steptime import LARGE
from tests.unit.test_core_util import drive, make_sched, req


def _decode_rate(cost: CostModel, n: int) -> float:
    return n / cost.iteration_time(0, n, n * TYPICAL_CONTEXT)


def _prefill_rate(cost: CostModel, n: int) -> float:
    return n / cost.iteration_time(n, 0, n)


def test_cpu_defaults_are_the_smallest_shapes_keeping_the_share_of_throughput():
    from bench.live_ceiling import served_profile

    cost = CostModel.from_profile(served_profile())
    assert curve_defaults(HybridKnobs(), cost)[1] is None  # no job limit unless asked
    budget, limit = curve_defaults(HybridKnobs(job_limit_efficiency=0.9), cost)
    assert limit is not None and 1 < limit < HybridKnobs().max_num_seqs
    full = _decode_rate(cost, LARGE)
    assert _decode_rate(cost, limit) >= 0.9 * full > _decode_rate(cost, limit - 1)
    tile = HybridKnobs().tile_size
    assert budget % tile == 0 and budget <= 512
    assert _prefill_rate(cost, budget) >= 0.9 * _prefill_rate(cost, LARGE)
    assert budget == tile or _prefill_rate(cost, budget - tile) < 0.9 * _prefill_rate(cost, LARGE)


def test_gpu_defaults_stay_sarathis_and_unlimited():
    cost = CostModel.from_profile(roofline_profile("a100-80g/llama-2-7b"))
    assert curve_defaults(HybridKnobs(), cost) == (512, None)
    assert curve_defaults(HybridKnobs(job_limit_efficiency=0.9), cost) == (512, None)  # M 650


def test_knobs_set_by_hand_win():
    cost = CostModel.from_profile(roofline_profile("a100-80g/llama-2-7b"))
    assert curve_defaults(HybridKnobs(token_budget=256, gpu_job_limit=8), cost) == (256, 8)
    assert curve_defaults(HybridKnobs(efficiency=None), cost) == (512, None)
    with pytest.raises(ValueError):
        HybridKnobs(efficiency=1.0)
    with pytest.raises(ValueError):
        HybridKnobs(job_limit_efficiency=0.0)


# c0 against c_decode: the curve flattens at 2 rows, so the curve's limit is 2
TWO = CostModel(c0=1e-3, c_prefill=1e-5, c_decode=5e-3, c_context=0.0)


def test_the_curves_limit_holds_new_work_back_and_never_pauses_a_running_request():
    assert curve_defaults(HybridKnobs(job_limit_efficiency=0.9), TWO)[1] == 2
    s = make_sched("hybrid", cost=TWO, device_blocks=1024, job_limit_efficiency=0.9)
    long_ones = [req(f"long{i}", 16, 40, t=0.0, predicted_len=400) for i in range(2)]
    short = req("short", 16, 3, t=0.01, predicted_len=3)  # ranked first once it arrives
    trace = drive(s, long_ones + [short])
    for _, _, out in trace:
        assert len(out.num_scheduled_tokens) <= 2
        assert not out.preempted_request_ids and not out.swap_out
    first_short = next(
        i for i, (_, _, out) in enumerate(trace) if "short" in out.num_scheduled_tokens
    )
    before = trace[first_short - 1][2].num_scheduled_tokens
    assert set(before) == {"long0", "long1"}  # both kept running while it waited
    # with the same limit set by hand, ranking pauses a running request for the short one
    s = make_sched("hybrid", cost=TWO, device_blocks=1024, gpu_job_limit=2)
    ranked = drive(s, [req(f"long{i}", 16, 40, t=0.0, predicted_len=400) for i in range(2)]
                   + [req("short", 16, 3, t=0.01, predicted_len=3)])  # fmt: skip
    done = {rid for _, _, out in ranked[:first_short] for rid in out.num_scheduled_tokens}
    assert "short" in done
