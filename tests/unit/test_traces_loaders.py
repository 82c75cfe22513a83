"""Trace loaders and builders on small fixture files of each format."""

from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from lab.workload.traces.arrivals import gamma_arrivals, make_arrivals, scale_timestamps
from lab.workload.traces.csv_replay import load_csv, parse_timestamp
from lab.workload.traces.slo import assign_slos
from lab.workload.traces.spec import make_trace, parse_spec
from lab.workload.traces.trace import Shape, SloSpec, TraceItem, build_trace, load_jsonl, save_jsonl
from lab.workload.traces.workloads import mixed_long_prompt_shapes, sample_shapes
from services.predictor import sharegpt

FIX = Path(__file__).parents[1] / "fixtures" / "traces"


def test_azure_csv_parses_dates_sorts_and_drops_zero_outputs():
    t = load_csv(FIX / "azure_small.csv")
    assert t.format == "azure" and t.dropped == 1
    assert [s.prompt_len for s in t.shapes] == [350, 1200, 410, 25]  # sorted by time
    assert [s.output_len for s in t.shapes] == [40, 12, 100, 300]
    base = datetime(2024, 2, 3, 9, 0, 1, 250000).timestamp()
    assert t.timestamps[0] == pytest.approx(base)
    assert t.timestamps[-1] - t.timestamps[0] == pytest.approx(10.01, abs=1e-5)


def test_burstgpt_csv_keeps_ties_in_file_order():
    t = load_csv(FIX / "burstgpt_small.csv")
    assert t.format == "burstgpt" and t.dropped == 1
    assert t.timestamps == [5.0, 118.0, 118.0, 204.0]
    assert [(s.prompt_len, s.output_len) for s in t.shapes] == [
        (500, 20),
        (400, 280),
        (1300, 350),
        (30, 90),
    ]


def test_csv_errors_are_clear():
    with pytest.raises(ValueError, match="unrecognised CSV header"):
        load_csv(FIX / "bad_header.csv")
    with pytest.raises(FileNotFoundError):
        load_csv(FIX / "missing.csv")
    with pytest.raises(ValueError, match="cannot parse timestamp"):
        parse_timestamp("yesterday")


def test_sharegpt_incremental_parse_stops_at_truncation():
    convs = list(sharegpt.iter_conversations(FIX / "sharegpt_truncated.json", chunk_size=17))
    assert [c["id"] for c in convs] == ["a1", "b2", "c3"]
    assert sharegpt.first_exchange(convs[1]) is None
    assert sharegpt.first_exchange(convs[2])[1] == "ok ]"


def test_scale_timestamps_hits_target_rate():
    ts = scale_timestamps([100.0, 101.0, 103.0, 104.0], target_rate=6.0)
    assert ts[0] == 0.0 and (len(ts) - 1) / ts[-1] == pytest.approx(6.0)
    assert np.allclose(np.diff(ts), [0.125, 0.25, 0.125])  # gaps 1,2,1 x (0.75/6)
    with pytest.raises(ValueError):
        scale_timestamps([3.0, 3.0], 1.0)


def test_gamma_arrivals_mean_rate_and_burstiness():
    calm = np.diff(gamma_arrivals(20000, rate=4.0, burstiness=4.0, seed=1))
    bursty = np.diff(gamma_arrivals(20000, rate=4.0, burstiness=0.25, seed=1))
    assert calm.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.mean() == pytest.approx(0.25, rel=0.08)
    assert bursty.std() > 3 * calm.std()  # CV = 1/sqrt(shape): 2 vs 0.5
    assert gamma_arrivals(5, 2.0, seed=3) == gamma_arrivals(5, 2.0, seed=3)
    with pytest.raises(ValueError, match="unknown arrival"):
        make_arrivals(3, "weibull", 1.0)


def test_jsonl_roundtrip(tmp_path):
    items = [
        TraceItem("r0", 0.5, 10, 20, "hi", "s0", SloSpec(ttft_s=1.0, tbt_s=0.2)),
        TraceItem("r1", 1.5, 7, 3),
    ]
    save_jsonl(items, tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl") == items


def test_build_trace_orders_by_arrival_and_checks_lengths():
    items = build_trace([Shape(5, 6), Shape(7, 8)], [2.0, 1.0])
    assert [(i.request_id, i.prompt_len) for i in items] == [("req-0", 7), ("req-1", 5)]
    with pytest.raises(ValueError):
        build_trace([Shape(5, 6)], [1.0, 2.0])
    with pytest.raises(ValueError):
        Shape(0, 3)


def test_mixed_workload_long_share_and_range():
    pool = [Shape(100 + i, 50 + i) for i in range(50)]
    shapes = mixed_long_prompt_shapes(pool, 4000, long_share=0.3, seed=2)
    long = [s for s in shapes if s.prompt_len >= 4096]
    assert 0.27 < len(long) / len(shapes) < 0.33
    assert all(s.prompt_len <= 32768 and s.prompt is None for s in long)
    assert shapes == mixed_long_prompt_shapes(pool, 4000, long_share=0.3, seed=2)
    assert len(sample_shapes(pool, 10, seed=0)) == 10


def test_heterogeneous_slos_follow_accelgen_ranges():
    items = build_trace([Shape(p, 10) for p in range(100, 2100, 10)], list(range(200)))
    prefill = lambda p: 1e-4 * p  # noqa: E731
    out = assign_slos(items, "heterogeneous", prefill_time=prefill, seed=0)
    assert {o.slo.tbt_s for o in out} == {0.1875 * s for s in (0.25, 0.5, 1.0, 2.0)}
    for o in out:
        group = [i.prompt_len for i in items if i.prompt_len // 512 == o.prompt_len // 512]
        base = np.mean([prefill(p) for p in group])
        assert 0.5 * base <= o.slo.ttft_s <= 1.5 * base
    jct = assign_slos(items, "none", prefill_time=prefill, jct_share=0.5, seed=0)
    with_deadline = [o for o in jct if o.slo.deadline_s is not None]
    assert 60 < len(with_deadline) < 140
    assert all(o.slo.ttft_s is None for o in with_deadline)
    with pytest.raises(ValueError, match="prefill_time"):
        assign_slos(items, "heterogeneous")


def test_make_trace_from_specs():
    assert parse_spec("mixed:long_share=0.2,split=test") == (
        "mixed",
        {"long_share": "0.2", "split": "test"},
    )
    items = make_trace(f"csv:{FIX / 'burstgpt_small.csv'}", None, rate=3.0, slo="uniform:tbt=0.1")
    assert len(items) == 4 and items[0].arrival_s == 0.0
    assert 3 / items[-1].arrival_s == pytest.approx(3.0)
    assert all(i.slo.tbt_s == 0.1 for i in items)
    pois = make_trace(f"csv:{FIX / 'azure_small.csv'}", None, rate=2.0, arrival="poisson")
    assert [i.prompt_len for i in pois] == [350, 1200, 410, 25]
    with pytest.raises(ValueError, match="unknown option"):
        make_trace(f"csv:{FIX / 'azure_small.csv'}", None, 1.0, slo="uniform:tbd=3")
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("alpaca", 10, 1.0)
