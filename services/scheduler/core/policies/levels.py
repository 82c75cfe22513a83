"""Incremental structures for priority policies: level queues and an aging clock.

Both avoid re-sorting every request every step: a request changes level only when its own
state changes (it ran, it was demoted, it aged), and aging pops only due entries from a heap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from itertools import chain
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.request import Request


class LevelQueues:
    """Levels 0 (highest priority) .. n-1; FIFO inside a level (dict insertion order)."""

    def __init__(self, num_levels: int) -> None:
        if num_levels < 1:
            raise ValueError(f"number of queues must be >= 1, got {num_levels}")
        self.levels: list[dict[str, Request]] = [{} for _ in range(num_levels)]
        self.level_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.level_of)

    def __contains__(self, rid: str) -> bool:
        return rid in self.level_of

    def put(self, req: Request, level: int) -> None:
        """Insert, or move when the level changed (moving sends it to the back of the level)."""
        rid = req.request_id
        level = min(max(level, 0), len(self.levels) - 1)
        old = self.level_of.get(rid)
        if old == level:
            return
        if old is not None:
            del self.levels[old][rid]
        self.levels[level][rid] = req
        self.level_of[rid] = level

    def move(self, rid: str, level: int) -> Request:
        """Move a queued request to another valid level (to its back); returns the request."""
        req = self.levels[self.level_of[rid]].pop(rid)
        self.levels[level][rid] = req
        self.level_of[rid] = level
        return req

    def remove(self, rid: str) -> None:
        old = self.level_of.pop(rid, None)
        if old is not None:
            del self.levels[old][rid]

    def in_order(self) -> Iterator[Request]:
        """Requests from the highest priority level down (safe to mutate while iterating:
        each level is copied when the walk reaches it)."""
        return chain.from_iterable(list(level.values()) for level in self.levels if level)

    def lowest_first(self) -> Iterator[Request]:
        return chain.from_iterable(
            reversed(list(level.values())) for level in reversed(self.levels) if level
        )


def bucket(value: float, base: float, ratio: float, num_levels: int) -> int:
    """Level for a positive quantity: [0, base) -> 0, [base*r^(i-1), base*r^i) -> i."""
    if value < base:
        return 0
    return min(num_levels - 1, 1 + int(math.log(value / base) / math.log(ratio)))


class AgingClock:
    """Counts the full `threshold`s a request keeps waiting (not scheduled)."""

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.since: dict[str, float] = {}
        self._heap: list[tuple[float, int, str, float]] = []  # (due, seq, request, start)
        self._seq = 0

    def start(self, rid: str, now: float) -> None:
        if rid in self.since:
            return
        self.since[rid] = now
        if self.threshold:
            self._seq += 1
            heapq.heappush(self._heap, (now + self.threshold, self._seq, rid, now))

    def stop(self, rid: str) -> None:
        self.since.pop(rid, None)

    def waited(self, rid: str, now: float) -> float:
        t = self.since.get(rid)
        return 0.0 if t is None else now - t

    def due(self, now: float, limit: int | None = None) -> dict[str, int]:
        """{request: full thresholds it waited since it last fired} for the requests that
        waited another full threshold by `now`. Each heap entry is popped and re-pushed once,
        however long the gap (a request that arrived long ago catches up in one call).
        With `limit`, at most that many requests fire (the earliest due); the rest stay due
        and fire in a later call with every period counted."""
        fired: dict[str, int] = {}
        heap, since = self._heap, self.since
        k = self.threshold
        if k is None:  # never due: nothing is pushed without a threshold
            return fired
        if limit is None:
            limit = len(heap)
        while heap and heap[0][0] <= now and len(fired) < limit:
            t, seq, rid, stamp = heap[0]
            if since.get(rid) == stamp:
                periods = int((now - t) // k) + 1
                fired[rid] = fired.get(rid, 0) + periods
                heapq.heapreplace(heap, (t + periods * k, seq, rid, stamp))
            else:
                heapq.heappop(heap)  # it ran or finished since: stale
        return fired
