"""Placement across executors: among those that can admit the request at all
(`Scheduler.can_admit`), the one with the least predicted outstanding work, ties to the name
that sorts first; with `cache_aware`, the one whose prefix cache saves the request the most
prefill among those not too busy.

Outstanding work sums each request's remaining time as if it ran alone, so it is a relative
measure of load, in which one request's saved prefill is small; the cache therefore chooses
among the executors whose work is within `CACHE_IMBALANCE` (25%) of the least loaded one's, plus
the saving itself (`pick`). That bound keeps a popular prefix from flooding its executor: once
that executor is a quarter busier than the others, requests go elsewhere and their prefixes get
cached there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import Scheduler


CACHE_IMBALANCE = 0.25


def pick(candidates: list[tuple[str, float, float]]) -> str | None:
    """(name, outstanding work, prefill saved) -> the name: the most saved among those within
    the imbalance bound of the least work; else (or on ties) the least work, then the name."""
    if not candidates:
        return None
    least = min(work for _, work, _ in candidates)
    fair = [c for c in candidates if c[1] <= least * (1 + CACHE_IMBALANCE) + c[2]]
    return min(fair, key=lambda c: (-c[2], c[1], c[0]))[0]


def choose_executor(
    schedulers: Mapping[str, Scheduler], req: Request, now: float, cache_aware: bool = True
) -> str | None:
    """Name of the scheduler to admit `req` to, or None when no executor can hold it."""
    aware = cache_aware and len(schedulers) > 1
    return pick(
        [
            (name, sched.outstanding_work(now), sched.prefix_saving(req) if aware else 0.0)
            for name, sched in sorted(schedulers.items())
            if sched.can_admit(req)
        ]
    )
