"""Smoke test: the scheduler benchmark builds its state and reports every figure (no timing
assertions: speed targets live in the benchmark itself)."""

from bench.bench_scheduler import bench_policy


def test_bench_policy_reports_figures_and_keeps_state_size():
    r = bench_policy(
        "hybrid", running=8, waiting=20, steps=5, seed=1, profile="h100-80g/llama-3-8b"
    )
    assert set(r) >= {"p50_ms", "p99_ms", "wall_p50_ms", "wall_p99_ms", "running", "waiting"}
    assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["waiting"] >= 20 and r["running"] >= 1


def test_bench_repeats_report_least_disturbed_figures():
    r = bench_policy(
        "alise", running=8, waiting=20, steps=5, seed=1, profile="h100-80g/llama-3-8b", repeats=2
    )
    assert 0 < r["min_p50_ms"] <= r["min_p99_ms"]
    assert r["min_p50_ms"] <= r["p99_ms"]
