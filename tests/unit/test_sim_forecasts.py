"""Progressive predictions in the simulator: the synthetic source (an ablation, labelled) whose
error shrinks with progress, replayed forecast files, the checkpoints, hidden lengths, and the
oracle ceiling helper."""

import math

import pytest

from lab.sim.ceiling import oracle_ceiling
from lab.sim.config import SimConfig, load_profile
from lab.sim.engine import Simulation
from lab.sim.forecasts import (
    SyntheticForecasts,
    forecasts_from_step_trace,
    make_forecasts,
    split_spec,
    write_forecasts,
)
from lab.workload.traces.arrivals import poisson_arrivals
from lab.workload.traces.trace import Shape, build_trace
from services.common.pb import executor_pb2
from services.common.step import SchedulerOutput

PROFILE = load_profile("a100-80g/llama-2-7b")


def _trace(n=120, rate=20.0):
    shapes = [Shape(20 + (i * 37) % 600, 5 + (i * 53) % 300) for i in range(n)]
    return build_trace(shapes, poisson_arrivals(n, rate, seed=0))


def test_spec_split_and_validation():
    assert split_spec("file:a.json+synthetic:sigma=0.5") == ("file:a.json", "synthetic:sigma=0.5")
    assert split_spec("noisy:sigma=1") == ("noisy:sigma=1", None)
    assert split_spec("oracle+replay:f.jsonl") == ("oracle", "replay:f.jsonl")
    with pytest.raises(ValueError):
        make_forecasts("synthetic:bogus=1")


def test_synthetic_source_is_labelled_and_its_error_shrinks_with_progress():
    src = make_forecasts("synthetic:sigma=1.0,floor=0.1")
    assert isinstance(src, SyntheticForecasts) and "ablation" in src.label
    early, late = [], []
    for i in range(400):
        key, true_len = f"r{i}", 160 + i % 200
        a = src.at(key, 1, true_len, 4000)
        b = src.at(key, 128, true_len, 4000)
        assert a is not None and b is not None and a.q10 < a.q50 <= a.q90
        early.append(abs(math.log(a.q50 / (true_len - 1))))
        late.append(abs(math.log(b.q50 / (true_len - 128))))
    assert sum(late) / len(late) < 0.6 * sum(early) / len(early)
    assert src.at("r0", 17, 200, 4000) is None  # only at checkpoints (1, 16, 32, ...)


def test_sim_emits_forecasts_at_checkpoints_without_telling_lengths():
    items = _trace(n=60)
    spec = "oracle+synthetic:sigma=0.8"
    sim = Simulation(items, SimConfig(policy="hybrid", prediction=spec), profile=PROFILE).run()
    assert sim.finish_count == {i.request_id: 1 for i in items}
    for item in items:
        r = sim.requests[item.request_id]
        assert r.num_output_tokens == item.output_len  # ended by its EOS at the true length
        assert r.max_tokens == 4096 - item.prompt_len  # max_tokens is the cap, not the length
        if item.output_len > 16:
            assert r.forecast is not None and r.forecast.generated % 16 == 0
    assert sim.forecasts is not None and "ablation" in sim.forecasts.label


def test_replayed_forecasts_reach_the_requests(tmp_path):
    items = _trace(n=40)
    src = SyntheticForecasts(0.5, 0.1, 16, seed=3)
    rows = []
    for item in items:
        for g in (1, 16, 32):
            fc = src.at(item.request_id, g, item.output_len, 4096 - item.prompt_len)
            if fc is not None:
                rows.append((item.request_id, fc))
    path = tmp_path / "forecasts.jsonl"
    assert write_forecasts(str(path), rows) == len(rows)
    config = SimConfig(policy="alise", prediction=f"oracle+replay:{path}")
    sim = Simulation(items, config, profile=PROFILE).run()
    recorded = dict(((rid, fc.generated), fc) for rid, fc in rows)
    for item in items:  # the row of G arrives with the step that samples token G
        fc = sim.requests[item.request_id].forecast
        if item.output_len > 33:
            assert fc is not None and fc == recorded[(item.request_id, 32)]
        elif item.output_len > 17:
            assert fc is not None and fc == recorded[(item.request_id, 16)]


def test_a_live_step_trace_replays_its_forecasts_under_the_traces_ids(tmp_path):
    """What a live scheduler writes (`ALISE_STEP_TRACE`, StepTrace from real StepResults) is
    read back under the trace's ids and replayed by the simulator."""
    from services.scheduler.core.shape import StepShape
    from services.scheduler.loop.step_trace import StepTrace

    items = _trace(n=12)
    served = {item.request_id: f"srv-{i:03d}" for i, item in enumerate(items)}
    src = SyntheticForecasts(0.5, 0.1, 16, seed=5)
    trace = StepTrace(tmp_path / "steps.jsonl")
    made = {}
    for g in (1, 16, 32, 48):
        result = executor_pb2.StepResult(step_id=g)
        for item in items:
            fc = src.at(item.request_id, g, item.output_len, 4096 - item.prompt_len)
            if fc is not None:
                made[(item.request_id, g)] = fc
                result.forecasts.add(request_id=served[item.request_id], generated=g,
                                     q10=fc.q10, q50=fc.q50, q90=fc.q90, p_cap=fc.p_cap)  # fmt: skip
        trace.write("exec-0", 0.0, SchedulerOutput(step_id=g), StepShape(), result, 0.01, 0.02)
    empty = executor_pb2.StepResult()
    trace.write("exec-0", 0.0, SchedulerOutput(step_id=99), StepShape(), empty, 0.01, 0.02)
    trace.close()
    ids = {v: k for k, v in served.items() if k != items[0].request_id}  # one left out
    rows = forecasts_from_step_trace(tmp_path / "steps.jsonl", ids)
    assert {(rid, fc.generated) for rid, fc in rows} == {
        key for key in made if key[0] != items[0].request_id
    }
    for rid, fc in rows:  # floats survive the JSON line (q50 exactly: the file keeps reprs)
        assert fc.q50 == pytest.approx(made[(rid, fc.generated)].q50, rel=1e-6)
    path = tmp_path / "forecasts.jsonl"
    write_forecasts(str(path), rows)
    config = SimConfig(policy="hybrid", prediction=f"oracle+replay:{path}")
    sim = Simulation(items, config, profile=PROFILE).run()
    for item in items[1:]:
        if item.output_len > 49:
            fc = sim.requests[item.request_id].forecast
            assert fc is not None and fc.generated == 48


def test_oracle_ceiling_picks_the_best_configuration():
    items = _trace(n=60, rate=40.0)
    grid = [{}, {"gpu_job_limit": 4}, {"rank": "remaining", "token_budget": 128}]
    result = oracle_ceiling(items, SimConfig(policy="hybrid"), PROFILE, grid)
    scores = [t["mean_normalized_latency"] for t in result["tried"]]
    assert len(scores) == 3 and result["ceiling_mean_normalized_latency"] == min(scores)
    assert result["best_knobs"] == grid[scores.index(min(scores))]
    assert result["fcfs_mean_normalized_latency"] > 0
