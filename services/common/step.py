"""The step contract: what the scheduling core asks of an executor in one step and what comes
back. One definition that the core (which builds it), the executor (which runs it, over gRPC or
in process) and the simulator share; it maps 1:1 onto proto StepRequest / StepResult (the live
scheduler and the executor's servicer convert). It imports nothing of either side."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling import SamplingParams


@dataclass
class NewRequestData:
    """Sent once when a request first reaches an executor (or again after a recompute)."""

    request_id: str
    token_ids: list[int]  # every known token: prompt + output so far
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0  # how many of token_ids are output (seeded sampling offset)
    # leading tokens whose KV is already in the first blocks of the request's table (prefix
    # cache hit): prefill starts at this position; always < len(token_ids), whole blocks
    num_cached_tokens: int = 0
    max_tokens: int = 0  # the request's output cap (the remaining-length probe's; 0 = unknown)


@dataclass
class SchedulerOutput:
    """What crosses to the executor, field for field proto StepRequest's (the epoch aside).
    What the core knows of the step besides (its decodes, preemptions, context and token
    budget) stays in the core: `StepShape`, services/scheduler/core/shape.py."""

    step_id: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    # request_id -> (device block ids, replace): replace=False appends, True sets the table
    block_tables: dict[str, tuple[list[int], bool]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    free_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_scheduled_tokens or self.swap_out or self.swap_in or self.free_request_ids
        )


@dataclass(frozen=True)
class RemainingForecast:
    """The served model's own estimate of how many more output tokens a running request will
    produce, made by the executor's probe after the request had `generated` output tokens.
    Quantiles are in tokens, counted from `generated`; `p_cap` is the probability that the
    request runs until its `max_tokens` rather than ending on EOS or a stop."""

    generated: int
    q10: float
    q50: float
    q90: float
    p_cap: float


@dataclass
class StepOutcome:
    step_id: int
    sampled: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (token, logprob)
    elapsed_s: float = 0.0
    # request_id -> the probe's new forecast (only requests at a checkpoint this step)
    forecasts: dict[str, RemainingForecast] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """One per request that got a token or finished in `Scheduler.update`."""

    request_id: str
    token: tuple[int, float, int] | None  # (token_id, logprob, index in output) or None
    finished: bool = False
    finish_reason: str | None = None
