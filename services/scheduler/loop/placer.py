"""Placement across executors: the core's rule (`core/placement.py`: least predicted outstanding
work among the executors that can admit the request, or the most prefill saved by a cache among
those within the imbalance bound; ties to the first name) with each
executor's outstanding work cached for `refresh_s` and bumped by every placement in between,
so admitting or re-placing N requests costs O(N), not O(N x requests queued)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.scheduler.core.placement import pick

if TYPE_CHECKING:
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import Scheduler


class Placer:
    def __init__(self, refresh_s: float = 0.05, cache_aware: bool = True) -> None:
        self.refresh_s = refresh_s
        self.cache_aware = cache_aware
        self._work: dict[str, tuple[float, float]] = {}  # address -> (computed at, seconds)

    def choose(self, schedulers: Mapping[str, Scheduler], req: Request, now: float) -> str | None:
        """Address of the scheduler to admit `req` to, or None when none can hold it."""
        candidates = [a for a in sorted(schedulers) if schedulers[a].can_admit(req)]
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        return pick(
            [
                (
                    a,
                    self._work_of(a, schedulers[a], now),
                    schedulers[a].prefix_saving(req) if self.cache_aware else 0.0,
                )
                for a in candidates
            ]
        )

    def placed(self, address: str, sched: Scheduler, req: Request) -> None:
        """Count the work `req` adds until the next refresh."""
        if address in self._work:
            at, work = self._work[address]
            self._work[address] = (
                at,
                work + sched.cost_model.remaining_time(req, sched.predicted_len(req)),
            )

    def forget(self, address: str) -> None:
        self._work.pop(address, None)

    def _work_of(self, address: str, sched: Scheduler, now: float) -> float:
        cached = self._work.get(address)
        if cached is None or now - cached[0] > self.refresh_s:
            cached = (now, sched.outstanding_work(now))
            self._work[address] = cached
        return cached[1]
