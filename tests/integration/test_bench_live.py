"""The live load generator against a real gateway + scheduler + executor (tiny model):
every request of a trace arrives on time, streams exactly its max_tokens (ignore_eos), and
the records turn into the shared metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.bench_serve import run_point
from bench.live import run_trace, served_model
from lab.gateway.testing import inprocess_stack
from lab.workload.metrics import summarize
from lab.workload.traces.trace import SloSpec, TraceItem


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-trace") / "steps.jsonl"


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, trace_path):
    from lab.scheduler.testing import cached_tiny_model

    model = cached_tiny_model()
    with inprocess_stack(
        tmp_path_factory.mktemp("bench-live"), model, scheduler_kw={"step_trace": trace_path}
    ) as stack:
        yield stack["url"]


def test_trace_replays_with_exact_token_counts_and_metrics(gateway_url):
    items = [
        TraceItem(
            f"r{i}",
            0.2 * i,
            8,
            5 + i,
            prompt=f"Count to {i + 3}.",
            slo=SloSpec(ttft_s=60.0, tbt_s=30.0),
        )
        for i in range(4)
    ]
    model = asyncio.run(served_model(gateway_url))
    results = asyncio.run(run_trace(gateway_url, items, model, ignore_eos=True))
    assert [r.error for r in results] == [None] * 4
    assert [r.completion_tokens for r in results] == [5, 6, 7, 8]
    # the stack's own ids (the chunks' `chatcmpl-` ids), one per request, kept to map what the
    # scheduler recorded (its step trace's forecasts) back to the trace
    assert len({r.served_id for r in results}) == 4 and all(r.served_id for r in results)
    for item, result in zip(items, results):
        record = result.record
        assert record.output_len == item.output_len
        assert record.arrival_s >= item.arrival_s - 0.05  # sent no earlier than scheduled
        assert record.token_times == sorted(record.token_times)
        assert record.prompt_len > 8  # the server's count, chat template included
    summary = summarize([r.record for r in results])
    assert summary["completed"] == 4
    assert summary["slo_attainment"] == 1.0
    assert 0 < summary["mean_ttft"] <= summary["mean_e2e"]


def test_refused_requests_are_recorded_as_errors(gateway_url):
    item = TraceItem("bad", 0.0, 8, 4, prompt="hello")
    results = asyncio.run(run_trace(gateway_url, [item], "no-such-model"))
    assert results[0].error and "404" in results[0].error
    assert not results[0].record.completed


def test_detailed_point_and_step_trace(gateway_url, trace_path):
    items = [TraceItem(f"d{i}", 0.1 * i, 8, 3 + 2 * i, prompt=f"Say {i}.") for i in range(3)]
    before = len(trace_path.read_text().splitlines()) if trace_path.exists() else 0
    summary = run_point(gateway_url, items, ignore_eos=True, max_concurrency=None, detailed=True)
    rows = summary["requests"]
    assert [r["request_id"] for r in rows] == ["d0", "d1", "d2"]
    assert [r["output_len"] for r in rows] == [3, 5, 7]
    for r in rows:
        assert r["error"] is None
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["normalized_latency"] == pytest.approx(r["e2e_s"] / r["output_len"], abs=1e-3)
        # 0 when every token after the first came in one event batch: a commit that lagged
        # behind its Steps (a loaded machine) carries several Steps' tokens at once
        assert 0 <= r["max_tbt_s"] <= r["e2e_s"]
    steps = [json.loads(line) for line in trace_path.read_text().splitlines()[before:]]
    # every output token comes from one Step; prompts were prefilled in some of them
    assert sum(s["decode"] for s in steps) + len(rows) >= sum(r["output_len"] for r in rows)
    # (the three prompts share the chat template's first blocks: the prefix cache serves them)
    cached = sum(r["cached_tokens"] for r in rows)
    assert cached > 0 and all(r["cached_tokens"] % 16 == 0 for r in rows)
    assert sum(s["prefill"] for s in steps) >= sum(r["prompt_len"] for r in rows) - cached - 3
    assert all(s["exec_s"] > 0 and s["round_trip_s"] >= s["exec_s"] for s in steps)
