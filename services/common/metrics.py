"""Prometheus helpers shared by the services (prometheus-client underneath).

Names follow vLLM's where one exists, under the `alise:` prefix
(e.g. `alise:time_to_first_token_seconds`).
"""

from __future__ import annotations

from collections.abc import Sequence

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


class Metrics:
    """A registry of metrics for one service; each service subclasses or composes it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def histogram(
        self,
        name: str,
        doc: str,
        buckets: Sequence[float] = LATENCY_BUCKETS,
        labels: tuple[str, ...] = (),
    ) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        """Text exposition format, for a `/metrics` handler."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose the registry on its own HTTP port (gRPC services)."""
        start_http_server(port, addr=addr, registry=self.registry)
