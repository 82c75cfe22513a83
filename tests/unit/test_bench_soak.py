"""The soak benchmark's arithmetic: the fitted growth per hour, the residual spread it is read
against, which series grow beyond their noise, and process restarts seen in the samples."""

from __future__ import annotations

import random

import pytest

from bench.bench_soak import Sampler, beyond_noise, fit, series_growth


def test_fit_recovers_a_known_slope_and_spread():
    rng = random.Random(3)
    points = [(t * 10.0, 100.0 + 0.5 * t * 10.0 + rng.gauss(0, 2)) for t in range(200)]
    slope, spread = fit(points)
    assert slope == pytest.approx(0.5, abs=0.01)
    assert spread == pytest.approx(2.0, rel=0.2)
    assert fit([(0.0, 5.0), (10.0, 5.0), (20.0, 5.0)]) == (0.0, 0.0)


def test_growth_is_fitted_after_the_warm_up_and_judged_against_noise():
    rng = random.Random(7)
    samples = []
    for i in range(40):
        t = i * 10.0
        samples.append(
            (
                t,
                {
                    # start-up growth, then flat with noise: not growing
                    "gateway.rss_mib": (100 + t if t < 90 else 190) + rng.gauss(0, 1.0),
                    "redis.keys": 50 + 2 * t,  # a steady climb: growing
                    "kv_blocks_used": rng.choice([0, 8, 16]),  # noise only
                },
            )
        )
    series = series_growth(samples, warmup_s=90)
    assert series["gateway.rss_mib"]["first"] < 105 and series["gateway.rss_mib"]["min"] < 105
    assert abs(series["gateway.rss_mib"]["growth_per_hour"]) < 60  # flat after the warm-up
    assert series["redis.keys"]["growth_per_hour"] == pytest.approx(7200)
    assert series["redis.keys"]["samples_fitted"] == 31
    assert beyond_noise(series) == ["redis.keys"]


def test_restarts_count_process_id_changes():
    sampler = Sampler.__new__(Sampler)
    sampler.pids = [
        {"redis": 1, "scheduler": 2},
        {"redis": 1, "scheduler": 2},
        {"redis": 5, "scheduler": 2},
        {"redis": 5, "scheduler": 2, "gateway": 9},
        {"redis": 6, "scheduler": 2, "gateway": 9},
    ]
    assert sampler.restarts() == {"redis": 2}
