"""lab.workload.metrics against hand-computed examples."""

import pytest

from lab.workload import metrics as m
from lab.workload.metrics import IterationRecord, RequestRecord


def _a():
    # arrives 1.0, scheduled 1.5, tokens at 2.0, 2.25, 2.75, 3.0
    return RequestRecord(
        "a", 1.0, 10, [2.0, 2.25, 2.75, 3.0], first_scheduled_s=1.5, slo_ttft_s=1.2, slo_tbt_s=0.3
    )


def _b():
    # arrives 0.0, tokens at 4.0 and 6.0, deadline 5 s (missed: e2e = 6)
    return RequestRecord("b", 0.0, 20, [4.0, 6.0], first_scheduled_s=3.0, slo_deadline_s=5.0)


def test_per_request_metrics_by_hand():
    a = _a()
    assert m.ttft(a) == pytest.approx(1.0)
    assert m.tbts(a) == pytest.approx([0.25, 0.5, 0.25])
    assert m.tpot(a) == pytest.approx(1.0 / 3)
    assert m.e2e(a) == pytest.approx(2.0)
    assert m.normalized_latency(a) == pytest.approx(0.5)
    assert m.scheduling_delay(a) == pytest.approx(0.5)
    # TTFT 1.0 <= 1.2, TPOT 0.333 > 0.3 -> not good; iterations: ttft ok, gaps .25 ok .5 no .25 ok
    assert not m.meets_slo(a)
    assert m.iteration_slo_hits(a) == (3, 4)
    b = _b()
    assert not m.meets_slo(b) and m.iteration_slo_hits(b) == (0, 0)
    assert m.meets_slo(RequestRecord("c", 0.0, 5, [1.0]))  # no SLO: good once completed
    assert not m.meets_slo(RequestRecord("d", 0.0, 5, [1.0], completed=False))
    assert m.tpot(RequestRecord("e", 0.0, 5, [1.0])) is None


def test_summary_by_hand():
    c = RequestRecord("c", 2.0, 4, [2.5, 2.7, 2.9], first_scheduled_s=2.1, slo_tbt_s=0.25)
    s = m.summarize([_a(), _b(), c])
    assert s["duration_s"] == pytest.approx(6.0)  # first arrival 0 -> last finish 6
    assert s["throughput_tok_s"] == pytest.approx(9 / 6)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["mean_ttft"] == pytest.approx((1.0 + 4.0 + 0.5) / 3)
    assert s["median_ttft"] == pytest.approx(1.0)
    # normalized latency: a 2/4, b 6/2, c 0.9/3
    assert s["mean_normalized_latency"] == pytest.approx((0.5 + 3.0 + 0.3) / 3)
    # pooled gaps: .25 .5 .25 | 2.0 | .2 .2 -> sorted .2 .2 .25 .25 .5 2.0
    assert s["median_tbt"] == pytest.approx(0.25)
    assert s["p99_tbt"] == pytest.approx(0.5 + 0.95 * 1.5)
    assert s["mean_scheduling_delay"] == pytest.approx((0.5 + 3.0 + 0.1) / 3)
    # only c is good: goodput 1/6 req/s, attainment 1/3
    assert s["goodput"] == pytest.approx(1 / 6)
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    # iteration SLO: a 3/4, c 2/2 -> 5/6; jct: b missed
    assert s["iteration_slo_attainment"] == pytest.approx(5 / 6)
    assert s["jct_slo_attainment"] == 0.0


def test_utilization_by_hand():
    its = [
        IterationRecord(0.0, 1.0, 300, 20, 0.5, token_budget=512),
        IterationRecord(1.0, 4.0, 0, 64, 0.9, token_budget=None),
    ]
    assert m.kv_utilization(its) == pytest.approx((0.5 * 1 + 0.9 * 3) / 4)
    assert m.compute_utilization(its) == pytest.approx(320 / 512)
    assert m.compute_utilization(its, reference_tokens=128) == pytest.approx((1.0 + 0.5) / 2)
    assert m.kv_utilization([]) is None


def test_empty_and_percentiles():
    assert m.percentile([], 99) is None
    assert m.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    s = m.summarize([])
    assert s["completed"] == 0 and s["goodput"] is None and s["mean_ttft"] is None
