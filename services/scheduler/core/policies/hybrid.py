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
from itertools import islice

from services.scheduler.core.policies.alise import AlisePolicy
from services.scheduler.core.policies.base import register_policy
from services.scheduler.core.policies.multires import select_nearest
from services.scheduler.core.policies.sarathi import sarathi_budget
from services.scheduler.core.request import RequestStatus

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
_ALISE = {k: v for k, v in AlisePolicy.KNOBS.items() if k != "max_num_batched_tokens"}


@register_policy("hybrid")
class HybridPolicy(AlisePolicy):
    KNOBS = {
        **_ALISE,
        "rank": "normalized",
        "num_queues": 16,              # normalized keys span a wider range than times
        "token_budget": None,          # Sarathi tau; None: from tbt_slo_s, else 512
        "tbt_slo_s": None,
        "tile_size": 128,
        "slo_aware_budget": True,      # shrink the step budget to the tightest TBT objective
        "era": True,
        "long_prompt_tokens": None,    # None: longer than the token budget
        "max_long_prompts": 1,
        "max_window": 16,              # candidates compared per level window
        "preempt_level_gap": 2,        # None: new requests never evict running ones
        "t_max_window": 32,
    }

    def validate(self) -> None:
        super().validate()
        if self.preempt_level_gap is not None and self.preempt_level_gap < 1:
            raise ValueError("hybrid: preempt_level_gap must be >= 1 or None")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.budget = sarathi_budget(self, sched)
        self.seqs = self._batch_cap()
        self.tbt: dict[str, float] = {}          # requests with their own TBT objective
        self.ttft_heap: list[tuple[float, str]] = []
        self.long_inflight: set[str] = set()
        self.recent = deque(maxlen=self.t_max_window)

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req, now: float) -> None:
        super().on_add(req, now)
        if req.slo.tbt_s:
            self.tbt[req.request_id] = req.slo.tbt_s
        if req.slo.ttft_s and not req.output_token_ids:   # re-admitted: TTFT is behind it
            heapq.heappush(self.ttft_heap, (req.arrival_time + req.slo.ttft_s, req.request_id))

    def on_finish(self, req, now: float) -> None:
        super().on_finish(req, now)
        self.tbt.pop(req.request_id, None)
        self.long_inflight.discard(req.request_id)

    def update(self, result, now: float) -> None:
        self.recent.append(result.outcome.elapsed_s or self.sched.cost_model.output_time(result.output))
        super().update(result, now)
        reqs = self.sched.requests
        for rid in list(self.long_inflight):
            if reqs[rid].num_computed_tokens >= reqs[rid].num_prompt_tokens:
                self.long_inflight.discard(rid)

    # -- step -------------------------------------------------------------------------------
    def schedule(self, s, now: float):
        self._age(s, now)
        b = s.new_batch(now, self.budget)
        self._chosen, self._victims = [], None
        self._decodes(s, b)
        self._ongoing_prefills(s, b)
        if not b.preempted and b.tokens_left >= 1 and b.num_seqs < self.seqs:
            urgent = self._urgent(s, now)
            self._admit(s, b, urgent[:self.max_window])
            for req in urgent:
                if req.request_id not in b.scheduled and req.status is not RUNNING:
                    heapq.heappush(self.ttft_heap, (req.arrival_time + req.slo.ttft_s,
                                                    req.request_id))
            self._admit(s, b, None)
        self._rebalance(s, b)
        self._track_waits(b, now)
        return b.finish()

    def _decodes(self, s, b) -> None:
        context, seqs, budget, scheduled = 0, self.seqs, b.token_budget, b.scheduled
        for req in list(s.running.values()):
            if req.status is not RUNNING or req.num_uncomputed_tokens != 1:
                continue
            if len(scheduled) >= seqs or b.num_tokens >= budget:
                break
            while not b.schedule(req, 1):
                if not self._evict_one(s, b, req):
                    break
            context += req.num_computed_tokens
        if self.slo_aware_budget and self.tbt:
            tight = self.sched.cost_model.token_budget(
                min(self.tbt.values()), self.tile_size, b.num_tokens, context, self.budget)
            b.token_budget = max(b.num_tokens, min(self.budget, tight))

    def _ongoing_prefills(self, s, b) -> None:
        level = self.q.level_of
        ongoing = [r for r in s.running.values()
                   if r.num_uncomputed_tokens > 1 and r.request_id not in b.scheduled]
        ongoing.sort(key=lambda r: level.get(r.request_id, 0))
        for req in ongoing:
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            if n < 1 or b.num_seqs >= self.seqs:
                break
            while req.status is RUNNING and not b.schedule(req, n):
                if not self._evict_one(s, b, req):
                    break

    def _evict_one(self, s, b, req) -> bool:
        """Swap out the resident, unscheduled request with the highest EWT (maybe `req`)."""
        if self._victims is None:
            self._victims = self._victims_by_ewt(s, b)
        for _, victim in self._victims:
            if victim.status is RUNNING and (victim is req or victim.request_id not in b.scheduled):
                self._preempted(victim)
                b.preempt(victim, "swap" if self.memory_mode == "swap" else "recompute")
                return victim is not req
        if req.status is RUNNING:
            self._preempted(req)
            b.preempt(req, "swap" if self.memory_mode == "swap" else "recompute")
        return False

    def _preempted(self, req) -> None:
        self.long_inflight.discard(req.request_id)

    def _urgent(self, s, now: float) -> list:
        """Waiting requests whose TTFT objective needs them in this iteration."""
        t_max = max(self.recent) if self.recent else 0.0
        heap, out = self.ttft_heap, []
        while (heap and len(out) < self.max_window
               and heap[0][0] - now <= t_max + self._prefill_estimate(s, heap[0][1])):
            _, rid = heapq.heappop(heap)
            req = s.requests.get(rid)
            if req is not None and not req.is_finished and req.status is not RUNNING:
                out.append(req)
        return out

    def _prefill_estimate(self, s, rid: str) -> float:
        req = s.requests.get(rid)
        return 0.0 if req is None else self.sched.cost_model.prefill_time(req.num_uncomputed_tokens)

    def _admit(self, s, b, urgent) -> None:
        """New and swapped work by priority, one level window at a time."""
        skips = 0
        for window in ([urgent] if urgent is not None else self._windows()):
            if b.tokens_left < 1 or b.num_seqs >= self.seqs or not window:
                break
            self._room_for(s, b, window[0])
            before = len(b.scheduled)       # select_nearest only adds to the batch
            left = select_nearest(b, window, self.watermark_blocks, self._allowed(b), self.seqs)
            for rid in islice(b.scheduled, before, None):
                self._started(s.requests[rid], b)
            skips += len(left)
            if skips > self.max_skips:
                break

    def _windows(self):
        for level in self.q.levels:
            window = []
            for req in list(level.values()):
                if req.status is not RUNNING:
                    window.append(req)
                    if len(window) >= self.max_window:
                        yield window
                        window = []
            if window:
                yield window

    def _allowed(self, b):
        def allowed(req) -> bool:
            if not self.era or req.num_computed_tokens > 0 or not self._is_long(req, b):
                return True
            return len(self.long_inflight) < self.max_long_prompts
        return allowed

    def _is_long(self, req, b) -> bool:
        return req.num_prompt_tokens > (self.long_prompt_tokens or b.token_budget)

    def _started(self, req, b) -> None:
        if req.num_computed_tokens < req.num_prompt_tokens and self._is_long(req, b):
            self.long_inflight.add(req.request_id)

    def _room_for(self, s, b, req) -> None:
        """ALISE preemption: evict jobs `preempt_level_gap` levels below `req` (highest EWT
        first) until `req`'s next chunk fits; evicts nothing if that would not be enough."""
        gap = self.preempt_level_gap
        if gap is None:
            return
        bm, level = s.block_manager, self.q.level_of
        n = min(req.num_uncomputed_tokens, b.tokens_left)
        need = bm.blocks_for_tokens(req.num_computed_tokens + n) + self.watermark_blocks
        if req.status is SWAPPED:
            need = max(need, bm.num_host_blocks_of(req.request_id) + self.watermark_blocks)
        if need <= bm.num_free_device_blocks:
            return
        floor = level.get(req.request_id, 0) + gap
        victims = [r for _, r in self._victims_by_ewt(s, b)
                   if level.get(r.request_id, 0) >= floor and r.request_id not in b.swapped_in]
        if bm.num_free_device_blocks + sum(bm.num_device_blocks_of(v.request_id) for v in victims) < need:
            return
        for victim in victims:
            if bm.num_free_device_blocks >= need:
                break
            self._preempted(victim)
            b.preempt(victim, "swap" if self.memory_mode == "swap" else "recompute")
