"""The budget rule: how many tokens and requests a step may hold, fixed when a policy binds.

A step's budget itself has one holder, the `Batch` (opened with `StepLimits.tokens`; a policy
may size it in time once its decodes are in). What is fixed per policy is where it starts:
whole prompts (vLLM, ALISE, FastServe: the longest prompt must fit one step) or Sarathi-Serve's
tau (a chunk size: the knob, from a TBT target through the cost model, or 512).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.view import SchedulerView

DEFAULT_TOKEN_BUDGET = 512  # Sarathi-Serve's 'strict' setting


@dataclass(frozen=True)
class StepLimits:
    """What a step opens with: `tokens` (the Batch's starting budget), `seqs` requests at
    most, and `job_limit` (ALISE's M: jobs on the device; None: memory decides)."""

    tokens: int
    seqs: int
    job_limit: int | None = None

    @classmethod
    def of(cls, tokens: int, max_num_seqs: int, job_limit: int | None = None) -> StepLimits:
        """Requests per step: at most `max_num_seqs` and `tokens`; Algorithm 2's M bounds the
        jobs on the device, so it bounds the batch as well (otherwise every chosen job is made
        resident and only unchosen residents past rank M are offloaded: M never holds)."""
        seqs = min(max_num_seqs, tokens)
        return cls(tokens, min(seqs, job_limit) if job_limit else seqs, job_limit)


def whole_prompt_budget(
    policy: str, max_num_batched_tokens: int | None, sched: SchedulerView
) -> int:
    """Token limit of a step that takes whole prompts: the knob, else max(2048, model length);
    it must hold the longest prompt."""
    budget = max_num_batched_tokens or max(2048, sched.max_model_len)
    if budget < sched.max_model_len:
        raise ValueError(
            f"{policy}: max_num_batched_tokens={budget} is below "
            f"max_model_len={sched.max_model_len}; whole prompts would not fit"
        )
    return budget


def sarathi_budget(
    token_budget: int | None, tbt_slo_s: float | None, tile_size: int, cost_model: CostModel
) -> int:
    """token_budget knob, else from the TBT target via the cost model, else 512."""
    if token_budget:
        return token_budget
    if tbt_slo_s:
        return cost_model.token_budget(tbt_slo_s, tile_size)
    return DEFAULT_TOKEN_BUDGET
