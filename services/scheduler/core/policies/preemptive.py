"""Base for iteration-level preemptive priority policies (ALISE, FastServe, oracle, hybrid).

Each step:  age -> select (walk the level queues from the top, whole prefills, within the batch
size and token budget) -> place (give each chosen request its KV: allocate, or swap in; make room
by evicting the resident, unchosen requests with the highest estimated wait time, EWT) ->
rebalance (ALISE Algorithm 2: keep at most M jobs on the device, prefetch swapped jobs that will
run soon) -> remember who waited (virtual aging).

Memory modes (ALISE section 3.2): 'swap' (EWT-ordered offload to host, the paper's design),
'recompute' (drop the KV of evicted jobs), 'defer' (never evict for a new job: a new arrival
waits while memory is full; a resident job that cannot grow evicts by recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import KnobError, Knobs, Policy, PreemptionMode
from services.scheduler.core.policies.levels import AgingClock, LevelQueues
from services.scheduler.core.policies.victims import Victims, smallest_first
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
MemoryMode = Literal["swap", "recompute", "defer"]
MEMORY_MODES = ("swap", "recompute", "defer")
INF = float("inf")


@dataclass(frozen=True)
class PreemptiveKnobs(Knobs):
    max_num_seqs: int = 256
    watermark: float = 0.01
    num_queues: int = 8
    aging_threshold_s: float | None = None  # K: promote one level per K seconds waited
    aging_per_step: int | None = 64  # most requests promoted per step (bounds a burst
    # of due promotions; the rest follow); None: all
    memory_mode: MemoryMode = "swap"  # swap | recompute | defer
    gpu_job_limit: int | None = None  # M: jobs allowed on the device; None: memory decides
    prefetch_per_step: int = 4  # swapped jobs uploaded ahead of need per step
    max_skips: int = 32  # prompts skipped for not fitting before giving up

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_mode not in MEMORY_MODES:
            raise KnobError(f"memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}")
        if self.num_queues < 1:
            raise KnobError("num_queues must be >= 1")
        if self.aging_threshold_s is not None and self.aging_threshold_s <= 0:
            raise KnobError("aging_threshold_s must be > 0 or None")
        if self.aging_per_step is not None and self.aging_per_step < 1:
            raise KnobError("aging_per_step must be >= 1 or None")
        if self.gpu_job_limit is not None and self.gpu_job_limit < 1:
            raise KnobError("gpu_job_limit must be >= 1 or None")

    def watermark_fraction(self) -> float:
        return self.watermark or 0.0

    @property
    def evict_mode(self) -> PreemptionMode:
        """How an evicted job loses its place on the device."""
        return "swap" if self.memory_mode == "swap" else "recompute"


class PreemptivePolicy(Policy):
    knobs_type = PreemptiveKnobs
    knobs: PreemptiveKnobs
    # set by `bind`
    budget: int  # tokens per step
    job_limit: int | None  # M: jobs on the device (gpu_job_limit, else the policy's default)
    seqs: int  # requests per step
    q: LevelQueues  # every unfinished request, by priority level
    aging: AgingClock  # how long each request has been waiting
    boost: dict[str, int]  # levels gained by aging (kept until it finishes)
    rem: dict[str, float]  # predicted remaining seconds per request
    level_rem: list[float]  # their sum per level (for EWT, eq. 6)
    prev: dict[str, None]  # requests scheduled in the previous step, in batch order
    _booked: dict[str, tuple[int, float]]  # (level, rem) counted in level_rem
    _res_seq: dict[str, int]  # order of becoming resident (= sched.running)
    _res_count: int
    # per step: the chosen (request, tokens) and the eviction candidates, made on first need
    _chosen: list[tuple[Request, int]]
    _victims: Victims | None

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        self.budget = self.step_budget(sched)
        self.job_limit = k.gpu_job_limit or self.default_job_limit(sched)
        self.seqs = self._batch_cap()
        self.q = LevelQueues(k.num_queues)
        self.aging = AgingClock(k.aging_threshold_s)
        self.boost = {}
        self.rem = {}
        self.level_rem = [0.0] * k.num_queues
        self._booked = {}
        self._res_seq = {}
        self._res_count = 0
        self.prev = {}

    # -- per-policy hooks -------------------------------------------------------------------
    def step_budget(self, sched: SchedulerView) -> int:
        """Token budget of every step."""
        raise NotImplementedError

    def default_job_limit(self, sched: SchedulerView) -> int | None:
        """M when `gpu_job_limit` is unset (None: memory decides)."""
        return None

    def entry_level(self, req: Request, now: float) -> int:
        raise NotImplementedError

    def after_run(self, req: Request, result: AppliedStep, now: float) -> None:
        """Called for every request that ran in a step and is still unfinished."""

    def protected(self, req: Request) -> bool:
        """Not to be evicted for another request (limited preemption; SrtfPolicy's knobs)."""
        return False

    def level_of(self, req: Request) -> int:
        return self.q.level_of.get(req.request_id, 0)

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req: Request, now: float) -> None:
        self._put(req, self.entry_level(req, now))
        self.aging.start(req.request_id, now)

    def _put(self, req: Request, level: int) -> None:
        """Place `req` in a level and keep the per-level sums of remaining time current."""
        rid = req.request_id
        old = self._booked.get(rid)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.put(req, level)
        level, rem = self.q.level_of[rid], self.rem.get(rid, 0.0)
        self.level_rem[level] += rem
        self._booked[rid] = (level, rem)

    def on_move(self, req: Request, status: RequestStatus) -> None:
        if status is RUNNING:
            self._res_count += 1
            self._res_seq[req.request_id] = self._res_count

    def on_finish(self, req: Request, now: float) -> None:
        rid = req.request_id
        self._res_seq.pop(rid, None)
        old = self._booked.pop(rid, None)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.remove(rid)
        self.aging.stop(rid)
        self.boost.pop(rid, None)
        self.rem.pop(rid, None)
        self.prev.pop(rid, None)

    def update(self, result: AppliedStep, now: float) -> None:
        reqs = self.sched.requests
        for rid in result.output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is not None and not req.is_finished:
                self.after_run(req, result, now)

    # -- step -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._age(now)
        b = self.sched.new_batch(now, self.budget)
        chosen = self._select()
        self._place(b, chosen)
        self._rebalance(b)
        self._track_waits(b, now)
        return b.finish()

    def _age(self, now: float) -> None:
        """Virtual aging: one level up per threshold waited (at most `aging_per_step`
        requests per step), booked in the per-level sums without recomputing anything."""
        fired = self.aging.due(now, self.knobs.aging_per_step)
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

    def _select(self) -> list[tuple[Request, int]]:
        chosen: list[tuple[Request, int]] = []
        tokens, skips, budget, seqs = 0, 0, self.budget, self.seqs
        for req in self.q.in_order():
            n = req.num_uncomputed_tokens
            if tokens + n > budget:
                skips += 1
                if skips > self.knobs.max_skips or tokens >= budget:
                    break
                continue
            chosen.append((req, n))
            tokens += n
            if len(chosen) >= seqs:
                break
        return chosen

    def _place(self, b: Batch, chosen: list[tuple[Request, int]]) -> None:
        bm = self.sched.block_manager
        self._chosen = chosen
        self._victims = None
        for i, (req, n) in enumerate(chosen):
            status = req.status
            if req.request_id in b.touched:
                continue  # evicted earlier in this step for a higher job
            if status is RUNNING and b.schedule(req, n):
                continue  # fits as it is (most decodes)
            if status is SWAPPED:
                need = bm.num_swap_in_blocks(req, n)
            else:
                reserve = self.watermark_blocks if status is WAITING else 0
                need = bm.num_new_blocks(req, n) + reserve
            if need > bm.num_free_device_blocks:
                if status is WAITING and self.knobs.memory_mode == "defer":
                    continue
                if not self._make_room(b, need, i):
                    continue
            if status is SWAPPED and not b.swap_in(req):
                continue
            b.schedule(req, n)

    def _make_room(self, b: Batch, need: int, rank: int) -> bool:
        """Free `need` device blocks for the chosen job at `rank` by evicting jobs of lower
        priority only: unchosen residents by EWT, then chosen ones from the lowest rank up.
        Evicts nothing when even all of them would not make enough room."""
        bm = self.sched.block_manager
        if self._victims is None:
            self._victims = self._victims_by_ewt(b)
        victims, popped = self._victims, []
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
            b.preempt(victim, self.knobs.evict_mode)
        return bm.num_free_device_blocks >= need

    def _victims_by_ewt(self, b: Batch) -> Victims:
        """(rank, request) eviction candidates, lazily: resident unchosen requests, highest
        estimated wait time first (ALISE eq. 7: EWT = min(predicted work in the higher-priority
        queues, time until aging promotes it to the top); ties: lower level first), then the
        resident chosen ones from the lowest priority up. Residency is as of this call."""
        chosen = {r.request_id for r, _ in self._chosen}
        lowest = len(self._chosen)
        tail = [
            (i, r) for i, (r, _) in reversed(list(enumerate(self._chosen))) if r.status is RUNNING
        ]
        running = self.sched.running
        k = self.knobs.aging_threshold_s
        if not k:  # EWT is then monotone in queue order: no sort needed
            resident = set(running) - chosen
            walk = ((lowest, r) for r in self.q.lowest_first() if r.request_id in resident)
            return Victims(walk, tail)
        now = b.now
        above, total = [], 0.0  # work queued in the levels above each level
        for level_sum in self.level_rem:
            above.append(total)
            total += level_sum
        # EWT of a resident that is not waiting (it ran last step): min(above, level * k)
        cap = [a if a < level * k else level * k for level, a in enumerate(above)]
        level_of, since, order = self.q.level_of, self.aging.since, self._res_seq
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

    def _batch_cap(self) -> int:
        """Requests per step: Algorithm 2's M bounds the jobs on the device, so it bounds the
        batch as well (otherwise every chosen job is made resident and only unchosen
        residents past rank M are offloaded, and M is never enforced)."""
        cap = min(self.knobs.max_num_seqs, self.budget)
        limit = self.job_limit
        return min(cap, limit) if limit else cap

    def _rebalance(self, b: Batch) -> None:
        """ALISE Algorithm 2 (swap mode): offload jobs past the GPU job limit M, upload
        swapped jobs inside it while free blocks stay above the watermark."""
        s, k, m = self.sched, self.knobs, self.job_limit
        if k.memory_mode != "swap" or not (s.swapped or m):
            return
        if b.preempted and not m:
            return  # memory is short right now: no prefetch
        bm, limit = s.block_manager, m or self.seqs
        uploads = k.prefetch_per_step
        for rank, req in enumerate(self.q.in_order()):
            if rank >= limit:
                if m is None:
                    break
                if req.status is RUNNING and req.request_id not in b.scheduled:
                    b.offload(req)
            elif req.status is SWAPPED and uploads > 0:
                blocks = bm.num_host_blocks_of(req.request_id)
                if blocks + self.watermark_blocks <= bm.num_free_device_blocks:
                    uploads -= b.swap_in(req)

    def _track_waits(self, b: Batch, now: float) -> None:
        cur, prev = b.scheduled, self.prev
        aging = self.aging
        for rid in prev:  # in batch order, not set order: aging ties break by start order
            if rid not in cur and rid in self.q:
                aging.start(rid, now)
        for rid in cur:
            if rid not in prev:  # the others stopped when they ran last step
                aging.stop(rid)
        self.prev = dict.fromkeys(cur)
