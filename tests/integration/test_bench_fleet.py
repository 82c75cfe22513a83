"""`alise bench overhead --fake-executors`: stub executors registered in Redis, one and two
scheduler shards sharing them, a client placing requests through the gateway's shard rule."""

import argparse

from bench.fleet import gate_figures, run_fleet, summarize


def test_a_small_fleet_run_uses_every_executor_on_both_shard_counts():
    args = argparse.Namespace(
        fake_executors="4",
        shards="1,2",
        step_ms=20.0,
        per_executor=2,
        warmup_s=0.5,
        window_s=1.5,
        budget_ms=2.0,
        policies="fcfs",
    )
    result = run_fleet(args)
    one, two = result["points"]
    assert one["executors_per_shard"] == [4] and two["executors_per_shard"] == [2, 2]
    assert one["requests_per_shard"] == [8] and sum(two["requests_per_shard"]) == 8
    assert min(two["requests_per_shard"]) >= 2  # the gateway's placement used both shards
    for p in (one, two):
        # 4 executors at 20 ms per Step: at most 200 Steps/s, and well above half of it
        assert 100 < p["iterations_per_s"] <= 200
        assert p["gap_p50_ms"] > 0 and p["cpu_ms_per_iteration"]["scheduler"] > 0
    assert set(result["throughput_vs_one_shard"]["4"]) == {"1", "2"}
    # the gate figures: one scheduler's utilization (Steps run / Steps the step time allows)
    assert 0.5 < result["utilization"]["4"] == one["utilization"] <= 1.0
    assert result["scheduler_cpu_ms_per_iteration"]["4"] == one["cpu_ms_per_iteration"]["scheduler"]


def test_gate_figures_are_medians_per_executor_count():
    points = [
        {"shards": 1, "executors": 1, "utilization": u, "cpu_ms_per_iteration": {"scheduler": c}}
        for u, c in ((0.8, 3.0), (0.9, 2.0), (0.5, 4.0))
    ] + [
        {"shards": 2, "executors": 1, "utilization": 0.1, "cpu_ms_per_iteration": {"scheduler": 9}}
    ]
    g = gate_figures(points)
    assert g["utilization"] == {"1": 0.8} and g["utilization_range"] == {"1": [0.5, 0.9]}
    assert g["scheduler_cpu_ms_per_iteration"] == {"1": 3.0}


def test_summary_takes_the_largest_fleet_within_the_budget():
    points = [
        {"shards": 1, "executors": n, "gap_p50_ms": gap, "iterations_per_s": ips}
        for n, gap, ips in ((8, 1.0, 300.0), (16, 1.9, 600.0), (32, 3.0, 900.0))
    ] + [{"shards": 2, "executors": 32, "gap_p50_ms": 1.5, "iterations_per_s": 1200.0}]
    s = summarize(points, 2.0)
    assert s["executors_sustained"] == {"1": 16, "2": 32}
    assert s["throughput_vs_one_shard"]["32"] == {"1": 1.0, "2": 1.33}
