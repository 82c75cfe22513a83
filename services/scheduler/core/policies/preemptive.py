"""Base for iteration-level preemptive priority policies (ALISE, FastServe, oracle).

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

from services.scheduler.core.policies.base import Policy
from services.scheduler.core.policies.levels import AgingClock, LevelQueues
from services.scheduler.core.policies.victims import Victims, smallest_first
from services.scheduler.core.request import RequestStatus

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
MEMORY_MODES = ("swap", "recompute", "defer")
INF = float("inf")


class PreemptivePolicy(Policy):
    KNOBS = {
        "max_num_seqs": 256,
        "max_num_batched_tokens": None,   # None: max(2048, max_model_len)
        "watermark": 0.01,
        "num_queues": 8,
        "aging_threshold_s": None,        # K: promote one level per K seconds waited; None: off
        "aging_per_step": 64,             # most requests promoted per step (bounds a burst of
                                          # due promotions; the rest follow next steps); None: all
        "memory_mode": "swap",            # swap | recompute | defer
        "gpu_job_limit": None,            # M: jobs allowed on the device; None: memory decides
        "prefetch_per_step": 4,           # swapped jobs uploaded ahead of need per step
        "max_skips": 32,                  # prompts skipped for not fitting before giving up
    }

    def validate(self) -> None:
        super().validate()
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"{self.name}: memory_mode must be one of {MEMORY_MODES}, "
                             f"got {self.memory_mode!r}")
        if self.num_queues < 1:
            raise ValueError(f"{self.name}: num_queues must be >= 1")
        if self.aging_threshold_s is not None and self.aging_threshold_s <= 0:
            raise ValueError(f"{self.name}: aging_threshold_s must be > 0 or None")
        if self.aging_per_step is not None and self.aging_per_step < 1:
            raise ValueError(f"{self.name}: aging_per_step must be >= 1 or None")
        if self.gpu_job_limit is not None and self.gpu_job_limit < 1:
            raise ValueError(f"{self.name}: gpu_job_limit must be >= 1 or None")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = getattr(self, "max_num_batched_tokens", None) or max(2048, sched.max_model_len)
        if self.budget < sched.max_model_len:
            raise ValueError(f"{self.name}: max_num_batched_tokens={self.budget} is below "
                             f"max_model_len={sched.max_model_len}; whole prompts would not fit")
        self.seqs = self._batch_cap()
        self.q = LevelQueues(self.num_queues)
        self.aging = AgingClock(self.aging_threshold_s)
        self.boost: dict[str, int] = {}
        self.rem: dict[str, float] = {}          # predicted remaining seconds per request
        self.level_rem = [0.0] * self.num_queues  # their sum per level (for EWT, eq. 6)
        self._booked: dict[str, tuple[int, float]] = {}
        self._res_seq: dict[str, int] = {}       # order of becoming resident (= sched.running)
        self._res_count = 0
        self.prev: set[str] = set()

    # -- per-policy hooks -------------------------------------------------------------------
    def entry_level(self, req, now: float) -> int:
        raise NotImplementedError

    def after_run(self, req, result, now: float) -> None:
        """Called for every request that ran in a step and is still unfinished."""

    def level_of(self, req) -> int:
        return self.q.level_of.get(req.request_id, 0)

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req, now: float) -> None:
        self._put(req, self.entry_level(req, now))
        self.aging.start(req.request_id, now)

    def _put(self, req, level: int) -> None:
        """Place `req` in a level and keep the per-level sums of remaining time current."""
        rid = req.request_id
        old = self._booked.get(rid)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.put(req, level)
        level, rem = self.q.level_of[rid], self.rem.get(rid, 0.0)
        self.level_rem[level] += rem
        self._booked[rid] = (level, rem)

    def on_move(self, req, status) -> None:
        if status is RUNNING:
            self._res_count += 1
            self._res_seq[req.request_id] = self._res_count

    def on_finish(self, req, now: float) -> None:
        rid = req.request_id
        self._res_seq.pop(rid, None)
        old = self._booked.pop(rid, None)
        if old is not None:
            self.level_rem[old[0]] -= old[1]
        self.q.remove(rid)
        self.aging.stop(rid)
        self.boost.pop(rid, None)
        self.rem.pop(rid, None)
        self.prev.discard(rid)

    def update(self, result, now: float) -> None:
        reqs = self.sched.requests
        for rid in result.output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is not None and not req.is_finished:
                self.after_run(req, result, now)

    # -- step -------------------------------------------------------------------------------
    def schedule(self, s, now: float):
        self._age(s, now)
        b = s.new_batch(now, self.budget)
        chosen = self._select(b)
        self._place(s, b, chosen)
        self._rebalance(s, b)
        self._track_waits(b, now)
        return b.finish()

    def _age(self, s, now: float) -> None:
        """Virtual aging: one level up per threshold waited (at most `aging_per_step`
        requests per step), booked in the per-level sums without recomputing anything."""
        fired = self.aging.due(now, self.aging_per_step)
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

    def _select(self, b) -> list:
        chosen, tokens, skips, budget, seqs = [], 0, 0, self.budget, self.seqs
        for req in self.q.in_order():
            n = req.num_uncomputed_tokens
            if tokens + n > budget:
                skips += 1
                if skips > self.max_skips or tokens >= budget:
                    break
                continue
            chosen.append((req, n))
            tokens += n
            if len(chosen) >= seqs:
                break
        return chosen

    def _place(self, s, b, chosen) -> None:
        bm = s.block_manager
        self._chosen = chosen
        self._victims = None
        for i, (req, n) in enumerate(chosen):
            status = req.status
            if req.request_id in b.touched:
                continue                    # evicted earlier in this step for a higher job
            if status is RUNNING and b.schedule(req, n):
                continue                    # fits as it is (most decodes)
            if status is SWAPPED:
                need = max(bm.num_host_blocks_of(req.request_id),
                           bm.blocks_for_tokens(req.num_computed_tokens + n))
            else:
                need = bm.num_new_blocks(req, n) + (self.watermark_blocks if status is WAITING else 0)
            if need > bm.num_free_device_blocks:
                if status is WAITING and self.memory_mode == "defer":
                    continue
                if not self._make_room(s, b, need, i):
                    continue
            if status is SWAPPED and not b.swap_in(req):
                continue
            b.schedule(req, n)

    def _make_room(self, s, b, need: int, rank: int) -> bool:
        """Free `need` device blocks for the chosen job at `rank` by evicting jobs of lower
        priority only: unchosen residents by EWT, then chosen ones from the lowest rank up.
        Evicts nothing when even all of them would not make enough room."""
        bm = s.block_manager
        if self._victims is None:
            self._victims = self._victims_by_ewt(s, b)
        victims, popped = self._victims, []
        take, free = [], bm.num_free_device_blocks
        while free < need:
            head = victims.peek()
            if head is None or head[0] <= rank:
                break
            popped.append(victims.pop())
            victim = head[1]
            if victim.status is RUNNING and victim.request_id not in b.swapped_in:
                take.append(victim)
                free += bm.num_device_blocks_of(victim.request_id)
        if free < need:
            victims.give_back(popped)       # still candidates for lower-ranked jobs
            return False
        mode = "swap" if self.memory_mode == "swap" else "recompute"
        for victim in take:
            b.preempt(victim, mode)
        return bm.num_free_device_blocks >= need

    def _victims_by_ewt(self, s, b) -> Victims:
        """(rank, request) eviction candidates, lazily: resident unchosen requests, highest
        estimated wait time first (ALISE eq. 7: EWT = min(predicted work in the higher-priority
        queues, time until aging promotes it to the top); ties: lower level first), then the
        resident chosen ones from the lowest priority up. Residency is as of this call."""
        chosen = {r.request_id for r, _ in self._chosen}
        lowest = len(self._chosen)
        tail = [(i, r) for i, (r, _) in reversed(list(enumerate(self._chosen)))
                if r.status is RUNNING]
        if not self.aging_threshold_s:   # EWT is then monotone in queue order: no sort needed
            resident = set(s.running) - chosen
            walk = ((lowest, r) for r in self.q.lowest_first() if r.request_id in resident)
            return Victims(walk, tail)
        k, now = self.aging_threshold_s, b.now
        above, total = [], 0.0          # work queued in the levels above each level
        for level_sum in self.level_rem:
            above.append(total)
            total += level_sum
        # EWT of a resident that is not waiting (it ran last step): min(above, level * k)
        cap = [a if a < level * k else level * k for level, a in enumerate(above)]
        level_of, since, order, running = self.q.level_of, self.aging.since, self._res_seq, s.running
        ewt = []
        for rid in running.keys() - chosen:
            level = level_of.get(rid)
            if level is None:
                continue
            e, t = cap[level], since.get(rid)
            if t is not None:           # waiting: promotion comes sooner than the cap
                promote = level * k - (now - t)
                if promote < e:
                    e = promote if promote > 0.0 else 0.0
            ewt.append((-e, -level, order[rid], running[rid]))   # ties: residency order
        return Victims(((lowest, e[3]) for e in smallest_first(ewt)), tail)

    def _batch_cap(self) -> int:
        """Requests per step: Algorithm 2's M bounds the jobs on the device, so it bounds the
        batch as well (otherwise every chosen job is made resident and only unchosen
        residents past rank M are offloaded, and M is never enforced)."""
        cap = min(self.max_num_seqs, self.budget)
        return min(cap, self.gpu_job_limit) if self.gpu_job_limit else cap

    def _rebalance(self, s, b) -> None:
        """ALISE Algorithm 2 (swap mode): offload jobs past the GPU job limit M, upload
        swapped jobs inside it while free blocks stay above the watermark."""
        if self.memory_mode != "swap" or not (s.swapped or self.gpu_job_limit):
            return
        if b.preempted and not self.gpu_job_limit:
            return                          # memory is short right now: no prefetch
        bm, limit = s.block_manager, self.gpu_job_limit or self.seqs
        uploads = self.prefetch_per_step
        for rank, req in enumerate(self.q.in_order()):
            if rank >= limit:
                if self.gpu_job_limit is None:
                    break
                if req.status is RUNNING and req.request_id not in b.scheduled:
                    b.offload(req)
            elif req.status is SWAPPED and uploads > 0:
                blocks = bm.num_host_blocks_of(req.request_id)
                if blocks + self.watermark_blocks <= bm.num_free_device_blocks:
                    uploads -= b.swap_in(req)

    def _track_waits(self, b, now: float) -> None:
        cur, prev = b.scheduled.keys(), self.prev
        aging = self.aging
        for rid in prev - cur:
            if rid in self.q:
                aging.start(rid, now)
        for rid in cur - prev:              # the others stopped when they ran last step
            aging.stop(rid)
        self.prev = set(cur)
