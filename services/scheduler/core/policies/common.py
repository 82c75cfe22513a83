"""Small building blocks shared by several policies."""
from __future__ import annotations

from services.scheduler.core.request import RequestStatus

RUNNING = RequestStatus.RUNNING


def schedule_or_preempt(b, req, n: int, victims, mode: str) -> bool:
    """Give `req` n tokens; while its KV does not fit, preempt the next victim from the
    iterator `victims` (lowest priority first; meeting `req` itself means nothing of lower
    priority is left). Returns False when `req` had to yield (preempted if resident)."""
    while not b.schedule(req, n):
        victim = next(victims, None)
        while victim is not None and victim is not req and (
                victim.status is not RUNNING or victim.request_id in b.swapped_in):
            victim = next(victims, None)
        if victim is None or victim is req:
            if req.status is RUNNING:
                b.preempt(req, mode)
            return False
        b.preempt(victim, mode)
    return True


def newest_first(running) -> "iter":
    """Running requests, most recently admitted first (vLLM's preemption order)."""
    return iter(list(reversed(running.values())))


def admit_fcfs(b, waiting, max_seqs: int, reserve_blocks: int, whole: bool = True,
               max_chunk: int | None = None) -> int:
    """Admit waiting requests in order while they fit (head-of-line blocking: stop at the
    first that does not). Whole prompts unless `whole` is False (then chunk to the budget)."""
    admitted = 0
    for req in list(waiting.values()):
        if len(b.sched.running) >= max_seqs or b.num_seqs >= max_seqs:
            break
        need = req.num_uncomputed_tokens
        left = b.tokens_left
        n = need if whole else min(need, left, max_chunk or need)
        if n < 1 or n > left:
            break
        if not b.schedule(req, n, reserve_blocks):
            break
        admitted += 1
    return admitted
