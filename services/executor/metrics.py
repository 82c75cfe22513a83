"""The executor's Prometheus metrics: step and forward time, swap waits, tokens per pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.metrics import TOKEN_BUCKETS, Metrics

if TYPE_CHECKING:
    from services.executor.messages import StepOutput


class ExecutorMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        self.step_time = self.histogram("executor_step_seconds", "Step handler time.")
        self.forward_time = self.histogram("executor_forward_seconds", "Forward pass time.")
        self.swap_wait = self.histogram(
            "executor_swap_wait_seconds", "Time steps waited for swap copies."
        )
        self.batch_tokens = self.histogram(
            "executor_batch_tokens", "Tokens per forward pass.", buckets=TOKEN_BUCKETS
        )
        self.prefill_tokens = self.counter("executor_prefill_tokens", "Prompt tokens computed.")
        self.decode_tokens = self.counter("executor_decode_tokens", "Decode tokens computed.")

    def observe(self, out: StepOutput) -> None:
        self.step_time.observe(out.timings.total_s)
        self.forward_time.observe(out.timings.forward_s)
        self.swap_wait.observe(out.timings.swap_wait_s)
        self.batch_tokens.observe(out.num_prefill_tokens + out.num_decode_tokens)
        self.prefill_tokens.inc(out.num_prefill_tokens)
        self.decode_tokens.inc(out.num_decode_tokens)
