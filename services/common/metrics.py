"""Prometheus helpers shared by the services (prometheus-client underneath).

The scheduler, which plays vLLM's engine, exports vLLM's own names where vLLM has one, with
its `model_name` label (`vllm:time_to_first_token_seconds{model_name="..."}`: dashboards and
autoscalers written for vLLM read them unchanged). Everything else is `alise:`-prefixed, and
no name is exported by two services (the gateway's own latencies are `alise:gateway_*`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for HTTP handlers)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

PREFIX = "alise:"
VLLM_PREFIX = "vllm:"


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every value, at the cost of one increment per bucket hit
    and one of the sum (the scheduler records one inter-token latency per running request per
    step: 64 observes cost ~120 us, this ~15 us). `histogram` is an unlabelled Histogram or a
    labelled child (a `ModelLabelled` passes its child)."""
    if not values:
        return
    child = getattr(histogram, "_child", None) or histogram
    bounds = child._upper_bounds  # prometheus_client's own bucket bounds (last: +Inf)
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)  # the first bucket whose bound is >= v, as observe() picks
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        child._buckets[i].inc(n)
    child._sum.inc(sum(values))


# Bucket sets in seconds, log-spaced for latencies from sub-millisecond to minutes.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ModelLabelled:
    """A vLLM-named metric whose `model_name` label is filled in: `.labels(...)` takes the
    other labels; with none, `inc`/`set`/`observe` go to the model's child directly."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name
        self._child: Any = None
        if tuple(metric._labelnames) == ("model_name",):
            # exported (at 0) before the first event; kept: `labels()` costs ~3 us a call,
            # paid per token otherwise
            self._child = metric.labels(model_name=model_name)

    def labels(self, *values: str, **named: str) -> Any:
        if named:
            return self.metric.labels(model_name=self.model_name, **named)
        return self.metric.labels(self.model_name, *values)

    def __getattr__(self, name: str) -> Any:
        child = self._child
        if child is None:
            child = self.metric.labels(model_name=self.model_name)
        return getattr(child, name)


class Metrics:
    """A registry of metrics for one service; each service subclasses or composes it.
    `vllm=True` names a metric as vLLM does (`vllm:` prefix, a `model_name` label)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name

    def _make(
        self, kind: Any, name: str, doc: str, labels: tuple[str, ...], vllm: bool, **kw: Any
    ) -> Any:
        if not vllm:
            return kind(PREFIX + name, doc, labels, registry=self.registry, **kw)
        metric = kind(
            VLLM_PREFIX + name, doc, ("model_name", *labels), registry=self.registry, **kw
        )
        return ModelLabelled(metric, self.model_name)

    def counter(
        self, name: str, doc: str, labels: tuple[str, ...] = (), vllm: bool = False
    ) -> Any:  # a Counter (a ModelLabelled one when vllm)
        return self._make(Counter, name, doc, labels, vllm)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = (), vllm: bool = False) -> Any:
        return self._make(Gauge, name, doc, labels, vllm)

    def histogram(
        self,
        name: str,
        doc: str,
        buckets: Sequence[float] = LATENCY_BUCKETS,
        labels: tuple[str, ...] = (),
        vllm: bool = False,
    ) -> Any:  # a Histogram (a ModelLabelled one when vllm)
        return self._make(Histogram, name, doc, labels, vllm, buckets=buckets)

    def render(self) -> bytes:
        """Text exposition format, for a `/metrics` handler."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose the registry on its own HTTP port (gRPC services)."""
        start_http_server(port, addr=addr, registry=self.registry)
