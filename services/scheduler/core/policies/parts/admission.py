"""Admission by level with whole prompts (ALISE, FastServe): each step re-walks the level
queues from the top (iteration-level preemption), takes whole prefills and decodes within the
step's tokens and requests (`select`), gives each chosen job its KV (`place`), evicting
lower-ranked jobs by EWT when it runs short, then keeps memory by ALISE Algorithm 2
(`memory.rebalance`): `by_level` is that step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.core.policies.parts.memory import rebalance
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.policies.parts.budget import StepLimits
    from services.scheduler.core.policies.parts.eviction import EwtEviction
    from services.scheduler.core.policies.parts.levels import Levels
    from services.scheduler.core.policies.parts.memory import MemoryRule
    from services.scheduler.core.request import Request

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


def select(b: Batch, levels: Levels, seqs: int, max_skips: int) -> list[tuple[Request, int]]:
    """(request, tokens) from the top level down while they fit the Batch's budget and `seqs`
    requests; a request that does not fit is skipped, `max_skips` times at most."""
    chosen: list[tuple[Request, int]] = []
    tokens, skips, budget = 0, 0, b.tokens_left
    for req in levels.in_order():
        n = req.num_uncomputed_tokens
        if tokens + n > budget:
            skips += 1
            if skips > max_skips or tokens >= budget:
                break
            continue
        chosen.append((req, n))
        tokens += n
        if len(chosen) >= seqs:
            break
    return chosen


def place(
    b: Batch, chosen: list[tuple[Request, int]], evict: EwtEviction, reserve: int, defer: bool
) -> None:
    """Schedule the chosen jobs in rank order: allocate, or swap in; make room by evicting
    lower-ranked jobs (`defer`: never for a new job). A new job keeps `reserve` blocks free."""
    bm = evict.sched.block_manager
    evict.begin(chosen)
    for i, (req, n) in enumerate(chosen):
        status = req.status
        if req.request_id in b.touched:
            continue  # evicted earlier in this step for a higher job
        if status is RUNNING and b.schedule(req, n):
            continue  # fits as it is (most decodes)
        if status is SWAPPED:
            need = bm.num_swap_in_blocks(req, n)
        else:
            need = bm.num_new_blocks(req, n) + (reserve if status is WAITING else 0)
        if need > bm.num_free_device_blocks:
            if status is WAITING and defer:
                continue
            if not evict.make_room(b, need, i):
                continue
        if status is SWAPPED and not b.swap_in(req):
            continue
        b.schedule(req, n)


def by_level(
    b: Batch,
    levels: Levels,
    evict: EwtEviction,
    memory: MemoryRule,
    limits: StepLimits,
    max_skips: int,
    reserve: int,
) -> None:
    """One step: select by level, place (a new job keeps `reserve` blocks free; memory mode
    `defer`: never evict for one), rebalance (Algorithm 2)."""
    chosen = select(b, levels, limits.seqs, max_skips)
    place(b, chosen, evict, reserve, memory.memory_mode == "defer")
    rebalance(b, evict.sched, levels, memory, limits, reserve)
