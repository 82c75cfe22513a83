"""`hybrid` (our default): Sarathi-Serve's stall-free chunked batching, ordered by ALISE's
predicted remaining time, with AccelGen's SLO urgency, budget and multi-resource selection, and
ALISE's EWT swapping.

Where the papers disagree, the choice made here:
 * Running decodes are never skipped for priority (Sarathi-Serve), unlike ALISE's
   iteration-level preemption and AccelGen's slack-delayed decodes: smooth TBT is the
   objective we refuse to trade. Priority decides admission, chunk order and eviction instead.
 * Token budget: Sarathi's static tau (token_budget, or from tbt_slo_s via the cost model,
   rounded to tile_size); when running requests carry tighter TBT objectives, the step's budget
   shrinks to what the cost model says fits the tightest one with the decodes actually
   scheduled (AccelGen's S_b idea, computed from the real batch instead of the pivot).
 * Order of new work: requests whose TTFT objective is about to be missed (AccelGen urgency,
   T_r <= T_max) first, then ALISE levels (aging, demotion with doubling) ranked by predicted
   remaining time x predicted length (`rank="normalized"`, Smith's rule for mean normalized
   latency: under load a short answer no longer waits behind a long one whose prompt happens
   to be shorter). Inside one level (like AccelGen's gamma window) the request nearest in
   (compute, KV) demand to what is free is taken first.
 * Long prompts: exclusive request allocation (AccelGen ERA) on top of Sarathi chunking.
 * Memory: KV shortage evicts the resident requests with the highest EWT to host (ALISE
   Algorithm 2), never the request being served; a new request may evict only jobs at least
   `preempt_level_gap` levels below it (ALISE's preemption, with hysteresis against thrash).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from services.scheduler.core.policies.alise import Rank, SrtfKnobs, SrtfPolicy
from services.scheduler.core.policies.base import KnobError, register_policy
from services.scheduler.core.policies.multires import Veto, select_nearest
from services.scheduler.core.policies.sarathi import sarathi_budget
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.output import SchedulerOutput
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import AppliedStep, Scheduler

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


@dataclass(frozen=True)
class HybridKnobs(SrtfKnobs):
    """ALISE's level knobs (no `max_num_batched_tokens`: the budget is Sarathi's tau), with
    other defaults, and the Sarathi-Serve / AccelGen knobs."""

    rank: Rank = "normalized"
    num_queues: int = 16  # normalized keys span a wider range than times
    token_budget: int | None = None  # Sarathi tau; None: from tbt_slo_s, else 512
    tbt_slo_s: float | None = None
    tile_size: int = 128
    slo_aware_budget: bool = True  # shrink the step budget to the tightest TBT objective
    era: bool = True
    long_prompt_tokens: int | None = None  # None: longer than the token budget
    max_long_prompts: int = 1
    max_window: int = 16  # candidates compared per level window
    preempt_level_gap: int | None = 2  # None: new requests never evict running ones
    t_max_window: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preempt_level_gap is not None and self.preempt_level_gap < 1:
            raise KnobError("preempt_level_gap must be >= 1 or None")


@register_policy("hybrid")
class HybridPolicy(SrtfPolicy):
    """From SrtfPolicy (alise.py): the level queues `q` by predicted remaining time x length
    (`on_add`/`update` keep them, with demotion and the per-level sums `level_rem`). From
    PreemptivePolicy (preemptive.py): `budget` and `seqs`, virtual aging (`_age`,
    `_track_waits`), eviction candidates by EWT (`_victims_by_ewt`, cached per step in
    `_victims`) and ALISE Algorithm 2 (`_rebalance`). The step itself is this class's."""

    knobs_type = HybridKnobs
    knobs: HybridKnobs
    # set by `bind`
    tbt: dict[str, float]  # requests with their own TBT objective
    ttft_heap: list[tuple[float, str]]  # (TTFT deadline, request) of those not started
    long_inflight: set[str]  # long prompts being prefilled (ERA)
    recent: deque[float]  # durations of the last steps (T_max)

    def step_budget(self, sched: Scheduler) -> int:
        k = self.knobs
        return sarathi_budget(k.token_budget, k.tbt_slo_s, k.tile_size, sched.cost_model)

    def bind(self, sched: Scheduler) -> None:
        super().bind(sched)
        self.tbt = {}
        self.ttft_heap = []
        self.long_inflight = set()
        self.recent = deque(maxlen=self.knobs.t_max_window)

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req: Request, now: float) -> None:
        super().on_add(req, now)
        if req.slo.tbt_s:
            self.tbt[req.request_id] = req.slo.tbt_s
        if not req.output_token_ids:  # re-admitted: TTFT is behind it
            self._push_ttft(req)

    def _push_ttft(self, req: Request) -> None:
        if req.slo.ttft_s:
            heapq.heappush(self.ttft_heap, (req.arrival_time + req.slo.ttft_s, req.request_id))

    def on_finish(self, req: Request, now: float) -> None:
        super().on_finish(req, now)
        self.tbt.pop(req.request_id, None)
        self.long_inflight.discard(req.request_id)

    def update(self, result: AppliedStep, now: float) -> None:
        cost = self.sched.cost_model
        self.recent.append(result.outcome.elapsed_s or cost.output_time(result.output))
        super().update(result, now)
        reqs = self.sched.requests
        for rid in list(self.long_inflight):
            if reqs[rid].num_computed_tokens >= reqs[rid].num_prompt_tokens:
                self.long_inflight.discard(rid)

    # -- step -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self._age(now)
        b = self.sched.new_batch(now, self.budget)
        self._chosen, self._victims = [], None
        self._decodes(b)
        self._ongoing_prefills(b)
        if not b.preempted and b.tokens_left >= 1 and b.num_seqs < self.seqs:
            urgent = self._urgent(now)
            self._admit(b, urgent[: self.knobs.max_window])
            for req in urgent:
                if req.request_id not in b.scheduled and req.status is not RUNNING:
                    self._push_ttft(req)
            self._admit(b, None)
        self._rebalance(b)
        self._track_waits(b, now)
        return b.finish()

    def _decodes(self, b: Batch) -> None:
        """Every running decode (Sarathi: never skipped for priority), evicting by EWT when
        KV runs out; then the step's budget shrinks to the tightest TBT objective."""
        context, seqs, budget, scheduled = 0, self.seqs, self.budget, b.scheduled
        for req in list(self.sched.running.values()):
            if req.status is not RUNNING or req.num_uncomputed_tokens != 1:
                continue
            if len(scheduled) >= seqs or b.num_tokens >= budget:
                break
            while not b.schedule(req, 1):
                if not self._evict_one(b, req):
                    break
            context += req.num_computed_tokens
        if self.knobs.slo_aware_budget and self.tbt:
            tight = self.sched.cost_model.token_budget(
                min(self.tbt.values()), self.knobs.tile_size, b.num_tokens, context, self.budget
            )
            b.token_budget = max(b.num_tokens, min(self.budget, tight))

    def _ongoing_prefills(self, b: Batch) -> None:
        level = self.q.level_of
        ongoing = [
            r
            for r in self.sched.running.values()
            if r.num_uncomputed_tokens > 1 and r.request_id not in b.scheduled
        ]
        ongoing.sort(key=lambda r: level.get(r.request_id, 0))
        for req in ongoing:
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            if n < 1 or b.num_seqs >= self.seqs:
                break
            while req.status is RUNNING and not b.schedule(req, n):
                if not self._evict_one(b, req):
                    break

    def _evict_one(self, b: Batch, req: Request) -> bool:
        """Swap out the resident, unscheduled request with the highest EWT (maybe `req`)."""
        if self._victims is None:
            self._victims = self._victims_by_ewt(b)
        for _, victim in self._victims:
            if victim.status is RUNNING and (victim is req or victim.request_id not in b.scheduled):
                self._evict(b, victim)
                return victim is not req
        if req.status is RUNNING:
            self._evict(b, req)
        return False

    def _evict(self, b: Batch, req: Request) -> None:
        self.long_inflight.discard(req.request_id)
        b.preempt(req, self.knobs.evict_mode)

    def _urgent(self, now: float) -> list[Request]:
        """Waiting requests whose TTFT objective needs them in this iteration."""
        t_max = max(self.recent) if self.recent else 0.0
        heap, reqs = self.ttft_heap, self.sched.requests
        out: list[Request] = []
        while (
            heap
            and len(out) < self.knobs.max_window
            and heap[0][0] - now <= t_max + self._prefill_estimate(heap[0][1])
        ):
            _, rid = heapq.heappop(heap)
            req = reqs.get(rid)
            if req is not None and not req.is_finished and req.status is not RUNNING:
                out.append(req)
        return out

    def _prefill_estimate(self, rid: str) -> float:
        req = self.sched.requests.get(rid)
        if req is None:
            return 0.0
        return self.sched.cost_model.prefill_time(req.num_uncomputed_tokens)

    def _admit(self, b: Batch, urgent: list[Request] | None) -> None:
        """New and swapped work by priority, one level window at a time (`urgent`: that one
        window instead)."""
        skips, reqs = 0, self.sched.requests
        for window in [urgent] if urgent is not None else self._windows():
            if b.tokens_left < 1 or b.num_seqs >= self.seqs or not window:
                break
            self._room_for(b, window[0])
            before = len(b.scheduled)  # select_nearest only adds to the batch
            left = select_nearest(b, window, self.watermark_blocks, self._allowed(b), self.seqs)
            for rid in islice(b.scheduled, before, None):
                self._started(reqs[rid], b)
            skips += len(left)
            if skips > self.knobs.max_skips:
                break

    def _windows(self) -> Iterator[list[Request]]:
        """Requests not running, level by level, at most `max_window` at a time."""
        size = self.knobs.max_window
        for level in self.q.levels:
            window: list[Request] = []
            for req in list(level.values()):
                if req.status is not RUNNING:
                    window.append(req)
                    if len(window) >= size:
                        yield window
                        window = []
            if window:
                yield window

    def _allowed(self, b: Batch) -> Veto:
        """ERA: a new long prompt waits while `max_long_prompts` are being prefilled."""

        def allowed(req: Request) -> bool:
            started = req.num_computed_tokens > req.num_cached_tokens
            if not self.knobs.era or started or not self._is_long(req, b):
                return True
            return len(self.long_inflight) < self.knobs.max_long_prompts

        return allowed

    def _is_long(self, req: Request, b: Batch) -> bool:
        limit = self.knobs.long_prompt_tokens or b.token_budget
        return limit is not None and req.num_uncached_prompt_tokens > limit

    def _started(self, req: Request, b: Batch) -> None:
        if req.num_computed_tokens < req.num_prompt_tokens and self._is_long(req, b):
            self.long_inflight.add(req.request_id)

    def _room_for(self, b: Batch, req: Request) -> None:
        """ALISE preemption: evict jobs `preempt_level_gap` levels below `req` (highest EWT
        first) until `req`'s next chunk fits; evicts nothing if that would not be enough."""
        gap = self.knobs.preempt_level_gap
        if gap is None:
            return
        bm, level = self.sched.block_manager, self.q.level_of
        n = min(req.num_uncomputed_tokens, b.tokens_left)
        if req.status is SWAPPED:
            need = bm.num_swap_in_blocks(req, n) + self.watermark_blocks
        else:  # a new request: with prefix caching, only its uncached blocks
            need = bm.num_new_blocks(req, n) + self.watermark_blocks
        if need <= bm.num_free_device_blocks:
            return
        floor = level.get(req.request_id, 0) + gap
        victims = [
            r
            for _, r in self._victims_by_ewt(b)
            if level.get(r.request_id, 0) >= floor and r.request_id not in b.swapped_in
        ]
        held = sum(bm.num_freeable_blocks(v.request_id) for v in victims)
        if bm.num_free_device_blocks + held < need:
            return
        for victim in victims:
            if bm.num_free_device_blocks >= need:
                break
            self._evict(b, victim)
