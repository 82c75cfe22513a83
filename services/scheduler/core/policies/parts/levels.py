"""Level queues and aging (the part ALISE, FastServe and hybrid hold): `Levels`.

Nothing is re-sorted every step: a request changes level only when its own state changes (it
ran, it was demoted, it aged), and aging pops only due entries from a heap. `Levels` also keeps
what estimated wait times (EWT, eviction.py) read: the predicted remaining seconds per level
and the order requests became resident.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import KnobError

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
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


@dataclass(frozen=True)
class LevelRule:
    """The knobs of `Levels`: how many queues, and virtual aging (promote one level per
    `aging_threshold_s` waited, at most `aging_per_step` requests per step; None: off / all)."""

    num_queues: int = 8
    aging_threshold_s: float | None = None
    aging_per_step: int | None = 64

    def __post_init__(self) -> None:
        if self.num_queues < 1:
            raise KnobError("num_queues must be >= 1")
        if self.aging_threshold_s is not None and self.aging_threshold_s <= 0:
            raise KnobError("aging_threshold_s must be > 0 or None")
        if self.aging_per_step is not None and self.aging_per_step < 1:
            raise KnobError("aging_per_step must be >= 1 or None")


class Levels:
    """Every unfinished request in a priority level, with virtual aging and the per-level sums
    of predicted remaining time. The policy says where a request goes (`add`, `put`); this
    part keeps the books and promotes waiters (`age`, `track_waits`)."""

    def __init__(self, rule: LevelRule) -> None:
        self.rule = rule
        self.q = LevelQueues(rule.num_queues)
        self.aging = AgingClock(rule.aging_threshold_s)
        self.boost: dict[str, int] = {}  # levels gained by aging (kept until it finishes)
        self.rem: dict[str, float] = {}  # predicted remaining seconds per request
        self.level_rem = [0.0] * rule.num_queues  # their sum per level (EWT, ALISE eq. 6)
        self.prev: dict[str, None] = {}  # scheduled in the previous step, in batch order
        self._booked: dict[str, tuple[int, float]] = {}  # (level, rem) counted in level_rem
        self.res_seq: dict[str, int] = {}  # order of becoming resident (= sched.running)
        self._res_count = 0

    @property
    def level_of(self) -> dict[str, int]:
        return self.q.level_of

    def __contains__(self, rid: str) -> bool:
        return rid in self.q

    def in_order(self) -> Iterator[Request]:
        return self.q.in_order()

    def add(self, req: Request, level: int, now: float, rem: float | None = None) -> None:
        """A new (or re-admitted) request: into `level`, waiting from `now`."""
        self.put(req, level, rem)
        self.aging.start(req.request_id, now)

    def put(self, req: Request, level: int, rem: float | None = None) -> None:
        """Place `req` in a level (with its predicted remaining seconds, when given) and keep
        the per-level sums current."""
        rid = req.request_id
        if rem is not None:
            self.rem[rid] = rem
        old = self._booked.get(rid)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.put(req, level)
        level, rem = self.q.level_of[rid], self.rem.get(rid, 0.0)
        self.level_rem[level] += rem
        self._booked[rid] = (level, rem)

    def resident(self, rid: str) -> None:
        """`rid` moved onto the device (eviction ties break by this order)."""
        self._res_count += 1
        self.res_seq[rid] = self._res_count

    def finish(self, rid: str) -> None:
        self.res_seq.pop(rid, None)
        old = self._booked.pop(rid, None)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.remove(rid)
        self.aging.stop(rid)
        self.boost.pop(rid, None)
        self.rem.pop(rid, None)
        self.prev.pop(rid, None)

    def age(self, now: float) -> None:
        """Virtual aging: one level up per threshold waited (at most `aging_per_step`
        requests per step), booked in the per-level sums without recomputing anything."""
        fired = self.aging.due(now, self.rule.aging_per_step)
        if not fired:
            return
        level_of, booked, sums, boost = self.q.level_of, self._booked, self.level_rem, self.boost
        for rid, periods in fired.items():
            level = level_of.get(rid)
            if level:
                up = periods if periods < level else level
                boost[rid] = boost.get(rid, 0) + up
                self.q.move(rid, level - up)
                rem = booked[rid][1]
                sums[level] -= rem
                sums[level - up] += rem
                booked[rid] = (level - up, rem)

    def track_waits(self, b: Batch, now: float) -> None:
        """After a step is built: who stopped running starts waiting (aging), who runs stops."""
        cur, prev = b.scheduled, self.prev
        aging = self.aging
        for rid in prev:  # in batch order, not set order: aging ties break by start order
            if rid not in cur and rid in self.q:
                aging.start(rid, now)
        for rid in cur:
            if rid not in prev:  # the others stopped when they ran last step
                aging.stop(rid)
        self.prev = dict.fromkeys(cur)
