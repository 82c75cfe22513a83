"""The live load generator against a real gateway + scheduler + executor (tiny model):
every request of a trace arrives on time, streams exactly its max_tokens (ignore_eos), and
the records turn into the shared metrics."""
from __future__ import annotations

import asyncio

import pytest

from bench.live import run_trace, served_model
from bench.metrics import summarize
from bench.traces.trace import SloSpec, TraceItem
from services.gateway.testing import inprocess_stack


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    from services.scheduler.testing import cached_tiny_model

    model = cached_tiny_model()
    with inprocess_stack(tmp_path_factory.mktemp("bench-live"), model) as stack:
        yield stack["url"]


def test_trace_replays_with_exact_token_counts_and_metrics(gateway_url):
    items = [TraceItem(f"r{i}", 0.2 * i, 8, 5 + i, prompt=f"Count to {i + 3}.",
                       slo=SloSpec(ttft_s=60.0, tbt_s=30.0)) for i in range(4)]
    model = asyncio.run(served_model(gateway_url))
    results = asyncio.run(run_trace(gateway_url, items, model, ignore_eos=True))
    assert [r.error for r in results] == [None] * 4
    assert [r.completion_tokens for r in results] == [5, 6, 7, 8]
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
