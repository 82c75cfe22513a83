"""The executor's own typed records: a step's result (mirroring proto StepResult) and what it
remembers about a request between steps. A step's input is the scheduler's `SchedulerOutput`
(services/common/step.py), whether it came over gRPC or from an in-process driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.sampling import SamplingParams
from services.common.step import RemainingForecast, StepOutcome


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
    # request_id -> the remaining-length probe's forecast (requests at a checkpoint this step)
    forecasts: dict[str, RemainingForecast] = field(default_factory=dict)
    # in process only (calibration): request_id -> (generated, the probe's feature vector)
    probe_features: dict[str, tuple[int, Any]] = field(default_factory=dict)

    def outcome(self) -> StepOutcome:
        """What the scheduling core applies of this result (in process: the gRPC path's
        StepResult carries the same fields, services/scheduler/convert.py)."""
        return StepOutcome(self.step_id, self.sampled, self.timings.total_s, self.forecasts)


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
    max_tokens: int = 0  # output cap (NewRequestData.max_tokens; 0 = unknown)
    matcher: Any = None  # structured output: the guide's matcher (services/common/guided.py)
