"""Plain typed messages of the executor, mirroring proto StepRequest / StepResult.

`Engine.step` also accepts the scheduler core's `SchedulerOutput` (same field names), so the
in-process driver, the gRPC servicer and tests share one path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.sampling import SamplingParams


@dataclass
class NewRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prefix cache hit: prefill starts here (whole blocks)


@dataclass
class StepInput:
    step_id: int = 0
    new_requests: list[NewRequest] = field(default_factory=list)
    block_tables: dict[str, tuple[list[int], bool]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> host
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host -> device
    free_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepTimings:
    forward_s: float = 0.0
    sample_s: float = 0.0
    swap_wait_s: float = 0.0
    total_s: float = 0.0


@dataclass
class StepOutput:
    step_id: int
    sampled: dict[str, tuple[int, float]]  # request_id -> (token id, logprob)
    timings: StepTimings
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    logits: dict | None = None  # request_id -> [n, V] fp32 (all_logits only)
    top: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # top_logprobs rows
    # request_id -> (first prompt position, [(token, logprob, alternatives)]): prompt_logprobs
    prompt: dict[str, tuple[int, list]] = field(default_factory=dict)


@dataclass
class RequestState:
    """What the executor remembers about one request between steps."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    num_output_tokens: int
    num_computed: int = 0
    block_table: list[int] | None = field(default_factory=list)  # None: swapped out
    staging_slot: int = -1
    matcher: Any = None  # structured output: the guide's matcher (services/common/guided.py)
