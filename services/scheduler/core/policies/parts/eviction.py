"""Eviction by estimated wait time (ALISE section 3.2, eq. 7), the part `alise`, `fastserve`
and `hybrid` hold: when KV runs short, the resident request that will wait longest before it
runs again loses its place (swapped to host, or recomputed later).

EWT = min(predicted work queued in the higher-priority levels, time until aging promotes it to
the top); ties: lower level first, then residency order. Candidates come lazily (most steps
evict a handful) and are cached for the rest of a step (`begin` starts a step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.core.policies.parts.victims import Victims, smallest_first
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.policies.base import PreemptionMode
    from services.scheduler.core.policies.parts.levels import Levels
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import SchedulerView

RUNNING = RequestStatus.RUNNING


def never(req: Request) -> bool:
    return False


class EwtEviction:
    """Chooses whom to evict and evicts (in `mode`), never a `protected` request for another;
    `on_evict` hears of each eviction (a policy's own bookkeeping)."""

    def __init__(
        self,
        levels: Levels,
        sched: SchedulerView,
        mode: PreemptionMode,
        protected: Callable[[Request], bool] = never,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self.levels, self.sched, self.mode = levels, sched, mode
        self.protected, self.on_evict = protected, on_evict
        self._chosen: list[tuple[Request, int]] = []
        self._victims: Victims | None = None

    def begin(self, chosen: list[tuple[Request, int]]) -> None:
        """A new step, whose chosen jobs (request, tokens) rank above every unchosen one."""
        self._chosen, self._victims = chosen, None

    def evict(self, b: Batch, req: Request) -> None:
        if self.on_evict is not None:
            self.on_evict(req.request_id)
        b.preempt(req, self.mode)

    def candidates(self, b: Batch) -> Victims:
        """(rank, request) eviction candidates, lazily: resident unchosen requests, highest
        EWT first, then the resident chosen ones from the lowest priority up. Residency is as
        of this call."""
        chosen = {r.request_id for r, _ in self._chosen}
        lowest = len(self._chosen)
        tail = [
            (i, r) for i, (r, _) in reversed(list(enumerate(self._chosen))) if r.status is RUNNING
        ]
        running, levels = self.sched.running, self.levels
        k = levels.aging.threshold
        if not k:  # EWT is then monotone in queue order: no sort needed
            resident = set(running) - chosen
            walk = ((lowest, r) for r in levels.q.lowest_first() if r.request_id in resident)
            return Victims(walk, tail)
        now = b.now
        above, total = [], 0.0  # work queued in the levels above each level
        for level_sum in levels.level_rem:
            above.append(total)
            total += level_sum
        # EWT of a resident that is not waiting (it ran last step): min(above, level * k)
        cap = [a if a < level * k else level * k for level, a in enumerate(above)]
        level_of, since, order = levels.level_of, levels.aging.since, levels.res_seq
        ewt: list[tuple[float, int, int, Request]] = []
        for rid in running.keys() - chosen:
            level = level_of.get(rid)
            if level is None:
                continue
            e, t = cap[level], since.get(rid)
            if t is not None:  # waiting: promotion comes sooner than the cap
                promote = level * k - (now - t)
                if promote < e:
                    e = promote if promote > 0.0 else 0.0
            ewt.append((-e, -level, order[rid], running[rid]))  # ties: residency order
        return Victims(((lowest, e[3]) for e in smallest_first(ewt)), tail)

    def _cached(self, b: Batch) -> Victims:
        if self._victims is None:
            self._victims = self.candidates(b)
        return self._victims

    def make_room(self, b: Batch, need: int, rank: int) -> bool:
        """Free `need` device blocks for the chosen job at `rank` by evicting jobs of lower
        priority only: unchosen residents by EWT, then chosen ones from the lowest rank up.
        Evicts nothing when even all of them would not make enough room."""
        bm = self.sched.block_manager
        victims, popped = self._cached(b), []
        take, free = [], bm.num_free_device_blocks
        while free < need:
            head = victims.peek()
            if head is None or head[0] <= rank:
                break
            popped.append(head)
            victims.pop()
            victim = head[1]
            if (
                victim.status is RUNNING
                and victim.request_id not in b.swapped_in
                and not self.protected(victim)
            ):
                take.append(victim)
                free += bm.num_freeable_blocks(victim.request_id)
        if free < need:
            victims.give_back(popped)  # still candidates for lower-ranked jobs
            return False
        for victim in take:
            self.evict(b, victim)
        return bm.num_free_device_blocks >= need

    def evict_one(self, b: Batch, req: Request) -> bool:
        """Evict the resident, unscheduled request with the highest EWT (maybe `req` itself);
        True when it was another one (`req` may try again)."""
        for _, victim in self._cached(b):
            if victim.status is RUNNING and (victim is req or victim.request_id not in b.scheduled):
                self.evict(b, victim)
                return victim is not req
        if req.status is RUNNING:
            self.evict(b, req)
        return False

    def room_for(self, b: Batch, req: Request, gap: int, reserve: int) -> None:
        """ALISE preemption with hysteresis: evict jobs at least `gap` levels below `req`
        (highest EWT first) until `req`'s next chunk fits with `reserve` blocks to spare;
        evicts nothing if that would not be enough."""
        level = self.levels.level_of
        n = min(req.num_uncomputed_tokens, b.tokens_left)
        need = b.blocks_needed(req, n) + reserve
        if need <= b.free_blocks:
            return
        floor = level.get(req.request_id, 0) + gap
        victims = [
            r
            for _, r in self.candidates(b)
            if level.get(r.request_id, 0) >= floor
            and r.request_id not in b.swapped_in
            and not self.protected(r)
        ]
        held = sum(b.freeable_blocks(v.request_id) for v in victims)
        if b.free_blocks + held < need:
            return
        for victim in victims:
            if b.free_blocks >= need:
                break
            self.evict(b, victim)
