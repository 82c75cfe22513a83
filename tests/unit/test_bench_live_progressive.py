"""`alise bench live-progressive`'s plan, aggregation, fresh data dirs and ceiling, and the
temperature the live load generator sends (the live runs themselves are benchmarks)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.bench_live_progressive import (
    fresh_data_dir,
    over_repeats,
    plan,
    record_predictions,
    sim_replay,
    verdicts,
)
from bench.live import LiveResult, _body, predicted_length, request_seed
from lab.workload.metrics import RequestRecord
from lab.workload.traces.trace import TraceItem


def _args(**kw) -> argparse.Namespace:
    base = dict(temperatures="1,0", rates="1,3", repeats=2, policies="fcfs,hybrid",
                once_policies="sarathi,alise")  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_plan_runs_fcfs_and_hybrid_everywhere_and_the_others_once():
    runs = plan(_args())
    assert len(runs) == 2 * 2 * (2 * 2 + 2)
    once = [r for r in runs if r["policy"] in ("sarathi", "alise")]
    assert {r["repeat"] for r in once} == {0} and len(once) == 2 * 2 * 2
    assert {(r["temperature"], r["rate"]) for r in once} == {(1, 1), (1, 3), (0, 1), (0, 3)}
    assert runs[0] == {"temperature": 1.0, "rate": 1.0, "repeat": 0, "policy": "fcfs"}


def _point(policy, repeat, mnl, tbt, gain=None, rate=1.0, temperature=1.0):
    return {"policy": policy, "repeat": repeat, "rate": rate, "temperature": temperature,
            "mean_normalized_latency": mnl, "p99_tbt_s": tbt, "ceiling_gain": gain}  # fmt: skip


def test_spread_over_repeats_and_the_verdict_per_point():
    points = [
        _point("fcfs", 0, 0.20, 0.8),
        _point("hybrid", 0, 0.18, 0.3, gain=0.12),  # 10% of fcfs won, ceiling 12%: 0.83
        _point("fcfs", 1, 0.22, 0.6),
        _point("hybrid", 1, 0.215, 0.4, gain=0.02),  # ceiling floored at 5%: share 0.45
    ]
    over_repeats(points)
    spread = points[1]["over_repeats"]["mean_normalized_latency"]
    assert spread == {"mean": pytest.approx(0.1975), "min": 0.18, "max": 0.215, "n": 2}
    assert points[0]["over_repeats"]["p99_tbt_s"]["max"] == 0.8
    first, second = verdicts(points)
    assert first["share_of_ceiling"] == pytest.approx(0.1 / 0.12) and first["met"]
    assert second["ceiling_gain_floored"] == 0.05 and not second["met"]
    assert second["p99_tbt_vs_fcfs"] == pytest.approx(0.4 / 0.6)


def test_fresh_data_dir_links_models_and_caches_but_not_the_store(tmp_path):
    shared = tmp_path / "shared"
    for path in ("models/m", "traces/t.json", "predictor/embeddings/e.npz",
                 "predictor/qdrant-edge/c/x", "redis/aof"):  # fmt: skip
        (shared / path).parent.mkdir(parents=True, exist_ok=True)
        (shared / path).write_text("x")
    (shared / "predictor" / "mlp-m-s.pt").write_text("w")
    fresh = fresh_data_dir(shared, tmp_path / "fresh")
    assert (fresh / "models" / "m").exists() and (fresh / "traces" / "t.json").exists()
    assert (fresh / "predictor" / "embeddings" / "e.npz").exists()
    assert (fresh / "predictor" / "mlp-m-s.pt").read_text() == "w"
    assert not (fresh / "predictor" / "qdrant-edge").exists() and not (fresh / "redis").exists()
    fresh_data_dir(shared, tmp_path / "fresh")  # again: nothing to redo, no error


def test_live_requests_send_the_api_default_temperature_unless_told():
    item = TraceItem("r", 0.0, 4, 16, prompt="hi")
    assert _body(item, "m", False)["temperature"] == 1.0 and "seed" not in _body(item, "m", False)
    greedy = _body(item, "m", False, 0.0, seed=request_seed(1, 2))
    assert greedy["temperature"] == 0.0 and greedy["seed"] == 1_000_003 + 2
    assert request_seed(None, 5) is None


def test_a_runs_predictions_are_kept_under_the_traces_ids(tmp_path):
    assert predicted_length("length=123; source=retrieval") == 123
    assert predicted_length("none") is None and predicted_length("length=x") is None
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        '{"step_id": 1, "forecasts": [["s0", 1, 5.0, 20.0, 90.0, 0.1], ["zz", 1, 1, 2, 3, 0]]}\n'
        '{"step_id": 2}\n{"step_id": 3, "forecasts": [["s1", 16, 2.0, 8.0, 30.0, 0.0]]}\n'
    )
    results = [
        LiveResult(RequestRecord("r0", 0.0, 8), "a", None, 30, "s0", 40),
        LiveResult(RequestRecord("r1", 0.1, 8), "b", None, 20, "s1", 25),
        LiveResult(RequestRecord("r2", 0.2, 8), "", "HTTP 500", 0, "", None),
    ]
    got = record_predictions(results, steps, tmp_path, "hybrid-t1-r1-0")
    assert got["forecasts_recorded"] == 2  # the unknown "zz" is no request of this trace
    forecasts = [json.loads(x) for x in open(got["forecasts_file"])]
    assert [(f["id"], f["generated"], f["q50"]) for f in forecasts] == [
        ("r0", 1, 20.0),
        ("r1", 16, 8.0),
    ]
    predictions = [json.loads(x) for x in open(got["predictions_file"])]
    assert predictions == [{"id": "r0", "predicted_len": 40}, {"id": "r1", "predicted_len": 25}]
    results[1].predicted_len = None  # a request the predictor did not answer: no replay
    assert record_predictions(results, steps, tmp_path, "x")["predictions_file"] is None


def test_a_run_is_simulated_with_its_own_predictions_and_forecasts(tmp_path):
    from bench.live_ceiling import served_profile
    from lab.sim.forecasts import SyntheticForecasts, write_forecasts

    rows = [{"request_id": f"r{i}", "arrival_s": 0.3 * i, "prompt_len": 40 + 7 * i,
             "output_len": 20 + (37 * i) % 200} for i in range(30)]  # fmt: skip
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(
        json.dumps({"id": r["request_id"], "predicted_len": 100}) + "\n" for r in rows
    ))  # fmt: skip
    src = SyntheticForecasts(0.2, 0.05, 16, seed=1)  # near the truth: it must reorder
    made = [(r["request_id"], src.at(r["request_id"], g, r["output_len"], 256))
            for r in rows for g in (1, 16, 32)]  # fmt: skip
    forecasts = tmp_path / "forecasts.jsonl"
    write_forecasts(str(forecasts), [(k, fc) for k, fc in made if fc is not None])
    point = {"policy": "hybrid", "predictions_file": str(predictions),
             "forecasts_file": str(forecasts)}  # fmt: skip
    got = sim_replay(point, rows, {"token_budget": 128, "gpu_job_limit": 4}, served_profile())
    assert str(forecasts) in got["sim_replay_prediction"]
    assert got["sim_replay_mean_normalized_latency"] > 0
    assert got["sim_arrival_only_mean_normalized_latency"] > 0
    # every arrival prediction says 100: only the forecasts tell long from short
    assert (
        got["sim_replay_mean_normalized_latency"] != got["sim_arrival_only_mean_normalized_latency"]
    )
    assert sim_replay({"policy": "hybrid"}, rows, {}, served_profile()) == {
        "sim_replay_mean_normalized_latency": None
    }


def test_ceiling_is_the_best_oracle_hybrid_on_the_runs_trace():
    from bench.live_ceiling import best_hybrid, served_profile

    rows = [{"request_id": f"r{i}", "arrival_s": 0.05 * i, "prompt_len": 40 + 7 * i,
             "output_len": 200 if i % 3 == 0 else 12} for i in range(24)]  # fmt: skip
    got = best_hybrid(rows, served_profile())
    best = min(got["ceiling_grid"].values())  # rounded to 5 digits
    assert got["ceiling_mean_normalized_latency"] == pytest.approx(best, abs=1e-5)
    assert got["ceiling_config"]["prediction"] == "oracle"
    assert got["ceiling_gain"] == pytest.approx(
        1 - got["ceiling_mean_normalized_latency"] / got["sim_fcfs_mean_normalized_latency"]
    )
