"""Simulator: determinism, conservation, swap accounting, predictions, several executors."""

import pytest

from lab.sim.config import SimConfig, load_profile, parse_policy
from lab.sim.engine import Simulation
from lab.sim.predictions import predict_lengths
from lab.sim.run import simulate
from lab.workload.traces.arrivals import poisson_arrivals
from lab.workload.traces.trace import Shape, TraceItem, build_trace
from lab.workload.traces.workloads import mixed_long_prompt_shapes
from services.scheduler.core.cost_model import CostModel

PROFILE = load_profile("a100-80g/llama-2-7b")


def _trace(n=300, rate=12.0, seed=0):
    pool = [Shape(20 + (i * 37) % 900, 5 + (i * 53) % 400) for i in range(97)]
    shapes = mixed_long_prompt_shapes(pool, n, long_share=0.0, seed=seed)
    return build_trace(shapes, poisson_arrivals(n, rate, seed=seed))


def _tight(**kw):
    # a small KV pool so preemption and swapping really happen
    return SimConfig(num_device_blocks=400, num_host_blocks=2000, **kw)


def test_same_seed_same_results():
    a = simulate(_trace(), _tight(policy="fcfs"), PROFILE)
    b = simulate(_trace(), _tight(policy="fcfs"), PROFILE)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert [(i.start_s, i.num_prefill_tokens, i.num_decode_tokens) for i in a.iterations] == [
        (i.start_s, i.num_prefill_tokens, i.num_decode_tokens) for i in b.iterations
    ]
    assert {k: v for k, v in a.summary.items() if k != "sim_wall_s"} == {
        k: v for k, v in b.summary.items() if k != "sim_wall_s"
    }
    c = simulate(_trace(seed=1), _tight(policy="fcfs"), PROFILE)
    assert c.summary["mean_e2e"] != a.summary["mean_e2e"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_conservation_under_preemption(mode):
    items = _trace()
    sim = Simulation(
        items, _tight(policy="fcfs", knobs={"preemption_mode": mode}), profile=PROFILE
    ).run()
    assert sim.finish_count == {i.request_id: 1 for i in items}  # each finishes exactly once
    for item in items:
        req = sim.requests[item.request_id]
        assert req.num_output_tokens == item.output_len == len(req.token_times)
        assert req.token_times == sorted(req.token_times) and req.token_times[0] > item.arrival_s
    # every output token is one sampled token of one iteration; every prompt token was computed
    computed = sum(i.num_prefill_tokens + i.num_decode_tokens for i in sim.iterations)
    preempted = sum(i.num_preempted for i in sim.iterations)
    assert preempted > 0, "the small pool should force preemptions"
    minimum = sum(i.prompt_len + i.output_len - 1 for i in items)
    if mode == "swap":
        assert sum(i.num_swap_out_blocks for i in sim.iterations) > 0
        assert sum(i.num_swap_out_blocks for i in sim.iterations) == sum(
            i.num_swap_in_blocks for i in sim.iterations
        )
    assert computed >= minimum  # recompute redoes work; nothing is skipped
    for ex in sim.executors:
        ex.scheduler.block_manager.check_invariants()
        assert ex.scheduler.block_manager.num_free_device_blocks == 400


def test_clock_is_the_cost_model():
    item = TraceItem("r", 1.0, 100, 3)
    sim = Simulation([item], SimConfig(policy="fcfs"), profile=PROFILE).run()
    cost = CostModel.from_profile(PROFILE)
    t1 = 1.0 + cost.iteration_time(100, 0, 100)
    t2 = t1 + cost.iteration_time(0, 1, 101)
    t3 = t2 + cost.iteration_time(0, 1, 102)
    assert sim.requests["r"].token_times == pytest.approx([t1, t2, t3])
    assert sim.requests["r"].first_scheduled_time == 1.0


def test_swaps_cost_time_when_not_overlapped():
    items = _trace(200, 15.0)
    base = _tight(policy="fcfs", knobs={"preemption_mode": "swap"})
    slow = simulate(items, base.with_(overlap_swaps=False, swap_bandwidth_gbs=1.0), PROFILE)
    fast = simulate(items, base, PROFILE)
    assert slow.summary["num_swapped_blocks"] > 0
    assert slow.summary["mean_e2e"] > fast.summary["mean_e2e"]


def test_several_executors_share_the_load():
    items = _trace(200, 20.0)
    one = simulate(items, SimConfig(policy="fcfs"), PROFILE)
    two = Simulation(items, SimConfig(policy="fcfs", num_executors=2), profile=PROFILE).run()
    used = {i.executor for i in two.iterations}
    assert used == {"0", "1"}
    assert len(two.finish_count) == len(items)
    two_summary = simulate(items, SimConfig(policy="fcfs", num_executors=2), PROFILE).summary
    assert two_summary["mean_e2e"] < one.summary["mean_e2e"]


def test_predictions(tmp_path):
    items = [TraceItem(f"r{i}", 0.0, 10, 10 * (i + 1), sample_id=f"s{i}") for i in range(50)]
    assert predict_lengths(items, "oracle")[0] == [i.output_len for i in items]
    assert set(predict_lengths(items, "mean")[0]) == {255}
    assert predict_lengths(items, "mean:value=7")[0] == [7] * 50
    noisy, source = predict_lengths(items, "noisy:sigma=0.5", seed=3)
    assert source == "noisy" and noisy != [i.output_len for i in items]
    assert noisy == predict_lengths(items, "noisy:sigma=0.5", seed=3)[0]
    assert predict_lengths(items, "noisy:sigma=0")[0] == [i.output_len for i in items]
    path = tmp_path / "pred.jsonl"
    path.write_text("".join(f'{{"id": "s{i}", "predicted_len": {i + 1}}}\n' for i in range(50)))
    assert predict_lengths(items, f"file:{path}")[0] == list(range(1, 51))
    path.write_text('{"s0": 3}')
    with pytest.raises(ValueError, match="no prediction for 49"):
        predict_lengths(items, f"file:{path}")
    with pytest.raises(ValueError, match="bad prediction spec"):
        predict_lengths(items, "perfect")


def test_policy_spec_parsing_and_bad_knobs():
    assert parse_policy("alise:memory=recompute,aging=0.5,x=true") == (
        "alise",
        {"memory": "recompute", "aging": 0.5, "x": True},
    )
    with pytest.raises(ValueError, match="knob"):
        Simulation(_trace(5), SimConfig(policy="fcfs", knobs={"nope": 1}), profile=PROFILE)
    with pytest.raises(ValueError, match="max_model_len"):
        Simulation([TraceItem("r", 0.0, 5000, 3)], SimConfig(), profile=PROFILE).run()


def test_prefill_attention_term_charges_long_prompts_quadratically():
    cost = CostModel.from_profile(PROFILE)
    times = {}
    for n in (1000, 4000):
        sim = Simulation(
            [TraceItem("r", 0.0, n, 1)], SimConfig(prefill_attention_s=1e-9), profile=PROFILE
        ).run()
        times[n] = sim.requests["r"].token_times[0] - cost.iteration_time(n, 0, n)
    assert times[1000] == pytest.approx(1e-9 * 1000 * 1001 / 2)
    assert times[4000] == pytest.approx(16 * times[1000], rel=0.01)
    auto = Simulation([], SimConfig(prefill_attention_s=-1), profile=PROFILE)
    assert auto.attn_s == pytest.approx(4 * 32 * 4096 / (0.6 * 312e12))


def test_measured_clock_uses_profile_samples_and_fit_clock_ignores_them():
    from tests.unit.test_core_cost_model import _curved_samples

    profile = CostModel.fit(
        _curved_samples(), num_device_blocks=400, num_host_blocks=400, block_size=16
    ).to_profile()
    cost = CostModel.from_profile(profile)
    item = TraceItem("r", 0.0, 100, 3)
    runs = {
        clock: Simulation([item], SimConfig(policy="fcfs", clock=clock), profile=profile)
        .run()
        .requests["r"]
        .token_times
        for clock in ("measured", "fit")
    }
    step = [(100, 0, 100), (0, 1, 101), (0, 1, 102)]
    for clock, fn in (("measured", cost.measured_time), ("fit", cost.iteration_time)):
        expected, t = [], 0.0
        for shape in step:
            t += fn(*shape)
            expected.append(t)
        assert runs[clock] == pytest.approx(expected)
    assert runs["measured"][-1] > runs["fit"][-1]  # one-sequence decodes run slow here
    with pytest.raises(ValueError, match="clock"):
        Simulation([item], SimConfig(policy="fcfs", clock="wall"), profile=profile)
