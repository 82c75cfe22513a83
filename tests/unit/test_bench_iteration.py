"""`alise bench iteration`: the scheduler's in-process work per decode iteration."""

from bench.bench_iteration import PARTS, measure


def test_every_part_of_an_iteration_is_timed():
    result = measure(requests=8, iterations=20, warmup=5)
    assert set(result["median_us"]) == set(PARTS)
    assert all(us > 0 for us in result["median_us"].values())
    assert result["total_median_us"] == round(sum(result["median_us"].values()), 1)
