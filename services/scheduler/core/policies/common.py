"""Small building blocks shared by several policies."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.scheduler.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.policies.base import PreemptionMode
    from services.scheduler.core.view import SchedulerView

RUNNING, SWAPPED = RequestStatus.RUNNING, RequestStatus.SWAPPED
Queue = OrderedDict[str, Request]


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


def schedule_or_preempt(
    b: Batch, req: Request, n: int, victims: Iterator[Request], mode: PreemptionMode
) -> bool:
    """Give `req` n tokens; while its KV does not fit, preempt the next victim from the
    iterator `victims` (lowest priority first; meeting `req` itself means nothing of lower
    priority is left). Returns False when `req` had to yield (preempted if resident)."""
    while not b.schedule(req, n):
        victim = next(victims, None)
        while (
            victim is not None
            and victim is not req
            and (victim.status is not RUNNING or victim.request_id in b.swapped_in)
        ):
            victim = next(victims, None)
        if victim is None or victim is req:
            if req.status is RUNNING:
                b.preempt(req, mode)
            return False
        b.preempt(victim, mode)
    return True


def by_priority(queue: Queue) -> list[Request]:
    """vLLM's priority order: lower `priority` first, then earlier arrival."""
    return sorted(queue.values(), key=lambda r: (r.priority, r.arrival_time))


def newest_first(running: Queue) -> Iterator[Request]:
    """Running requests, most recently admitted first (vLLM's preemption order)."""
    return iter(list(reversed(running.values())))


def admit_fcfs(
    b: Batch,
    sched: SchedulerView,
    max_seqs: int,
    reserve_blocks: int,
    order: list[Request] | None = None,
) -> int:
    """Admit waiting requests in `order` (default: arrival order) with their whole prompt
    while they fit (head-of-line blocking: stop at the first that does not)."""
    admitted = 0
    for req in list(sched.waiting.values()) if order is None else order:
        if len(sched.running) >= max_seqs or b.num_seqs >= max_seqs:
            break
        n = req.num_uncomputed_tokens
        if n < 1 or n > b.tokens_left:
            break
        if not b.schedule(req, n, reserve_blocks):
            break
        admitted += 1
    return admitted
