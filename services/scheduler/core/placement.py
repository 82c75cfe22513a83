"""Placement across executors: among those that can admit the request at all
(`Scheduler.can_admit`), the one with the least predicted outstanding work, minus (when
`cache_aware`) the prefill its prefix cache would save the request; ties to the name that
sorts first.

Cache-aware placement is bounded by construction: an executor is preferred over a less loaded
one only while the difference in outstanding work is below what its cache saves this one
request (at most the request's own prefill time), so a popular prefix draws requests to its
executor until that executor is one prefill busier than the others; then a request goes
elsewhere and its prefix gets cached there too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import Scheduler


def choose_executor(
    schedulers: Mapping[str, Scheduler], req: Request, now: float, cache_aware: bool = True
) -> str | None:
    """Name of the scheduler to admit `req` to, or None when no executor can hold it."""
    best, best_work = None, None
    for name in sorted(schedulers):
        sched = schedulers[name]
        if not sched.can_admit(req):
            continue
        work = sched.outstanding_work(now)
        if cache_aware and len(schedulers) > 1:
            work -= sched.prefix_saving(req)
        if best_work is None or work < best_work:
            best, best_work = name, work
    return best
