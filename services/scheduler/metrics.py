"""Scheduler metrics: vLLM's names and `model_name` label where vLLM has the metric
(`vllm:`), `alise:` for the rest (predictions, swaps, the prefix cache, executors)."""

from __future__ import annotations

from services.common.metrics import TOKEN_BUCKETS, Metrics

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)
RELATIVE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class SchedulerMetrics(Metrics):
    def __init__(self, model_name: str = "") -> None:
        super().__init__(model_name=model_name)
        e = ("executor",)
        v = {"vllm": True}
        self.waiting = self.gauge("num_requests_waiting", "Requests waiting to be scheduled.", **v)
        self.running = self.gauge("num_requests_running", "Requests with KV on a device.", **v)
        self.swapped = self.gauge("num_requests_swapped", "Requests with KV in host memory.", **v)
        self.kv_usage = self.gauge(
            "kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1).", e, **v
        )
        self.executor_up = self.gauge("executor_up", "1 while the executor answers.", e)
        self.preemptions = self.counter("num_preemptions", "Preemptions (recompute or swap).", **v)
        self.swap_out = self.counter("swap_out_blocks", "KV blocks swapped device -> host.")
        self.swap_in = self.counter("swap_in_blocks", "KV blocks swapped host -> device.")
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens admitted.", **v)
        self.generation_tokens = self.counter("generation_tokens", "Output tokens generated.", **v)
        self.success = self.counter(
            "request_success", "Finished requests.", ("finished_reason",), **v
        )
        self.rejected = self.counter("request_rejected", "Generate calls refused.", ("reason",))
        self.queue_time = self.histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", **v
        )
        self.ttft = self.histogram("time_to_first_token_seconds", "Arrival to first token.", **v)
        self.itl = self.histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens of a request.", **v
        )
        self.e2e = self.histogram("e2e_request_latency_seconds", "Arrival to finish.", **v)
        self.iteration_tokens = self.histogram(
            "iteration_tokens_total", "Tokens computed per iteration.", TOKEN_BUCKETS, **v
        )
        self.prediction_error = self.histogram(
            "prediction_error_tokens",
            "|predicted - true| output length (finished on a stop).",
            TOKEN_BUCKETS,
        )
        self.prediction_relative_error = self.histogram(
            "prediction_relative_error",
            "|predicted - true| / true output length.",
            RELATIVE_BUCKETS,
        )
        self.prefix_queries = self.counter(
            "prefix_cache_queries", "Prompt tokens of finished requests (prefix cache look-ups)."
        )
        self.prefix_hits = self.counter(
            "prefix_cache_hits", "Of those, prompt tokens whose KV came from the prefix cache."
        )
        self.prefix_evictions = self.gauge(
            "prefix_cache_evicted_blocks",
            "Cached blocks evicted since the executor's scheduler started.",
            e,
        )
        self.overhead = self.histogram(
            "scheduler_iteration_overhead_seconds",
            "Wall time between consecutive Steps minus the executor's step time.",
            OVERHEAD_BUCKETS,
        )

    def observe_finish(self, req, finish_reason: str, now: float) -> None:
        """Record a finished request's latencies and, on a natural stop, prediction error."""
        self.success.labels(finish_reason).inc()
        self.prefix_queries.inc(req.num_prompt_tokens)
        self.prefix_hits.inc(min(req.num_cached_tokens, req.num_prompt_tokens))
        self.e2e.observe(max(0.0, now - req.arrival_time))
        true_len = len(req.output_token_ids)
        if finish_reason == "stop" and req.predicted_len and true_len:
            error = abs(req.predicted_len - true_len)
            self.prediction_error.observe(error)
            self.prediction_relative_error.observe(error / true_len)
