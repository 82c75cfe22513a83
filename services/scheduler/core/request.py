"""Request state: the only per-request record the scheduling core keeps.

Progress is two numbers (docs/scheduling.md): `num_computed_tokens` (tokens whose KV exists,
or will once the steps already sent have run) and `num_tokens` (prompt + output so far, plus
`num_pending_tokens`: tokens that steps in flight sample, ids not known yet). A request is a
prefill while more than one token is uncomputed and a decode when exactly one is; there is no
phase flag. With pipelined steps (`Scheduler.pipeline_depth` 2) the next step is planned while
one runs: a request in the running step counts its sampled token as pending, so the plan
computes it (docs/scheduler.md, "Pipelined steps").

With prefix caching, `num_cached_tokens` is the part of the known tokens found in the block
manager's prefix cache; the scheduler counts it as computed from admission on, so every cost
estimate and token budget sees only the uncached rest. The cached blocks are attached when the
request is first scheduled (`Batch.schedule` re-checks the cache then).

Status meaning inside the core:
  WAITING  no KV of its own anywhere (new, or preempted by recompute); `num_computed_tokens`
           is 0, or its cached prefix (`num_cached_tokens`) with prefix caching;
  RUNNING  resident: its KV lives in device blocks (it may still be skipped in a step,
           e.g. when a priority policy preempts it in place);
  SWAPPED  its KV lives in host blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.sampling import SamplingParams

if TYPE_CHECKING:
    from services.common.step import RemainingForecast


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

FINISH_REASON_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


@dataclass
class Slo:
    """Per-request latency objectives in seconds; None means 'not given'.

    deadline_s is a job-completion (JCT) objective measured from arrival.
    """

    ttft_s: float | None = None
    tbt_s: float | None = None
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s", "deadline_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Slo.{name} must be > 0 seconds, got {value!r}")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    slo: Slo = field(default_factory=Slo)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    predicted_len: int | None = None
    prediction_source: str = "none"
    # true output length when known (simulator / benchmarks only): read by the `oracle` policy
    true_len: int | None = None
    # the served model's latest forecast of its remaining output (a Step outcome's
    # `forecasts`, taken by `Scheduler.update`); None until the first one
    forecast: RemainingForecast | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens the steps in flight will sample for it (their ids arrive with the steps' results)
    num_pending_tokens: int = 0
    # leading tokens taken from the prefix cache at this admission (0 without caching)
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"request {self.request_id}: need 0 <= min_tokens <= max_tokens")
        if self.predicted_len is not None and self.predicted_len < 1:
            raise ValueError(f"request {self.request_id}: predicted_len must be >= 1")
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self._num_prompt = len(self.prompt_token_ids)

    # -- progress ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self._num_prompt + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: prompt + output (`num_tokens` minus the pending)."""
        return self._num_prompt + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return (
            self._num_prompt
            + len(self.output_token_ids)
            + self.num_pending_tokens
            - self.num_computed_tokens
        )

    @property
    def ends_with_pending(self) -> bool:
        """Its pending tokens will certainly finish it by length (max_tokens or the length
        limit), whatever they are: a pipelined plan gives it nothing more to compute."""
        if not self.num_pending_tokens:
            return False
        n_out = len(self.output_token_ids) + self.num_pending_tokens
        limit = self.max_model_len
        return n_out >= self.max_tokens or (limit is not None and self._num_prompt + n_out >= limit)

    @property
    def num_uncached_prompt_tokens(self) -> int:
        """Prompt tokens not covered by the cached prefix: the prompt's own prefill work."""
        n = self._num_prompt - self.num_cached_tokens
        return n if n > 0 else 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def reads_prompt_logits(self) -> bool:
        """It asks for its prompt's log-probabilities and has not had them yet (no output):
        every prompt token must be computed, none taken from the prefix cache."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def is_prefill(self) -> bool:
        """More than one token to compute (a prompt, a chunk, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    def max_total_tokens(self) -> int:
        """Upper bound on prompt + output for this request (KV it may ever need)."""
        total = self._num_prompt + self.max_tokens
        if self.max_model_len is not None:
            total = min(total, self.max_model_len)
        return total

    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None
