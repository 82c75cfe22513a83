"""Gateway Prometheus metrics, all `alise:gateway_*`: what the HTTP client saw (the scheduler
exports vLLM's names for the engine's view; no name is shared)."""

from __future__ import annotations

from services.common.metrics import TOKEN_BUCKETS, Metrics


class GatewayMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        self.requests = self.counter(
            "gateway_requests", "HTTP requests by route and status", ("route", "status")
        )
        self.request_seconds = self.histogram(
            "gateway_request_duration_seconds", "HTTP request duration", labels=("route",)
        )
        self.active_streams = self.gauge(
            "gateway_active_streams", "Generations in flight (streaming or not)"
        )
        self.ttft = self.histogram(
            "gateway_time_to_first_token_seconds", "Gateway arrival to first text sent"
        )
        self.e2e = self.histogram(
            "gateway_e2e_request_latency_seconds", "Gateway arrival to last text sent"
        )
        self.prompt_tokens = self.histogram(
            "gateway_request_prompt_tokens", "Prompt length", buckets=TOKEN_BUCKETS
        )
        self.generation_tokens = self.histogram(
            "gateway_request_generation_tokens", "Output length", buckets=TOKEN_BUCKETS
        )
        self.finished = self.counter(
            "gateway_request_success", "Finished generations by reason", ("finished_reason",)
        )
        self.predictions = self.counter(
            "gateway_predictions",
            "Predictions asked for, by source (none = no answer)",
            ("source",),
        )
        self.aborts = self.counter(
            "gateway_upstream_aborts", "Requests aborted upstream, by cause", ("cause",)
        )
