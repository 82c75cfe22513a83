"""Placement across executors: the one with the least predicted outstanding work that can
admit the request at all (`Scheduler.can_admit`), ties to the name that sorts first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import Scheduler


def choose_executor(schedulers: Mapping[str, Scheduler], req: Request, now: float) -> str | None:
    """Name of the scheduler to admit `req` to, or None when no executor can hold it."""
    best, best_work = None, None
    for name in sorted(schedulers):
        sched = schedulers[name]
        if not sched.can_admit(req):
            continue
        work = sched.outstanding_work(now)
        if best_work is None or work < best_work:
            best, best_work = name, work
    return best
