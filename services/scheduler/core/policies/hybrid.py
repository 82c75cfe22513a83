"""`hybrid` (our default): Sarathi-Serve's stall-free chunked batching, ordered by ALISE's
predicted remaining time, with AccelGen's SLO urgency, budget and multi-resource selection, and
ALISE's EWT swapping.

Where the papers disagree, the choice made here:
 * Running decodes are never skipped for priority (Sarathi-Serve), unlike ALISE's
   iteration-level preemption and AccelGen's slack-delayed decodes: smooth TBT is the
   objective we refuse to trade. Priority decides admission, chunk order and eviction instead.
   The one exception is bounded by the objective itself: a decode with its own TBT objective
   may sit out one step when its next token still meets that objective (the prefill lane).
 * Token budget: Sarathi's static tau (token_budget, or from tbt_slo_s via the cost model,
   rounded to tile_size) for steps whose decodes carry no TBT objective. When they do (a
   request's own `tbt_s`, or `tbt_slo_s` for every request), the step is sized in time, not
   tokens (`slo_aware_budget`): its length is the tightest time any of its decodes has left
   before its next token misses its objective (AccelGen's S_b idea, computed from the real
   batch instead of the pivot), and a prefill chunk is charged the reads of its own context and
   the attention term the linear cost model lacks, fitted online from measured step times
   (steptime.py). A decode whose token is already late no longer bounds the step, and tau does
   not cap a step whose decodes all carry objectives: with many decodes a fixed token count
   overruns the objective, with few it leaves throughput unused.
 * Prefill lane (`prefill_lane`): a waiting prompt whose TTFT objective a step of its own can
   still meet runs whole in such a step, with only the decodes that cannot sit it out (no
   objective, or too little slack for this step and the next). A TTFT objective near the
   prompt's lone prefill time cannot be met in a step shared with decodes and other chunks.
 * Order of new work: requests whose TTFT objective is about to be missed (AccelGen urgency,
   T_r <= T_max) first, before the chunks of prompts already started, then ALISE levels (aging, demotion with doubling) ranked by predicted
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

from services.scheduler.core.policies.base import KnobError, Knobs, Policy, register_policy
from services.scheduler.core.policies.parts.budget import (
    DEFAULT_TOKEN_BUDGET,
    StepLimits,
    sarathi_budget,
)
from services.scheduler.core.policies.parts.eviction import EwtEviction
from services.scheduler.core.policies.parts.levels import LevelRule, Levels
from services.scheduler.core.policies.parts.memory import MemoryMode, MemoryRule, rebalance
from services.scheduler.core.policies.parts.multires import Veto, select_nearest
from services.scheduler.core.policies.parts.protection import Protection, ProtectRule
from services.scheduler.core.policies.parts.ranking import (
    Rank,
    RankRule,
    RemainingRank,
    arrival_prior,
)
from services.scheduler.core.policies.parts.steptime import (
    AttentionFit,
    chunk_time,
    chunk_tokens,
    efficient_batch,
    efficient_chunk,
)
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
# T_max (AccelGen): the longest of the last 32 steps (once a knob, `t_max_window`: 4 and 256
# gave the same figures as 32, bench/results/hybrid_knob_effects.json)
T_MAX_WINDOW = 32
TYPICAL_CONTEXT = 256  # tokens of context per decode row where the default job limit is sized


@dataclass(frozen=True)
class HybridKnobs(Knobs):
    """Every knob of `hybrid`, grouped by the part that reads it. Cut after
    bench/results/hybrid_knob_effects.json measured no effect: `aging_per_step` (64),
    `prefetch_per_step` (4) and `default_predicted_len` (256) keep their parts' defaults."""

    rules = (LevelRule, RankRule, ProtectRule, MemoryRule)
    # the step: budget and limits (parts/budget.py, parts/steptime.py)
    # Sarathi tau; None: from tbt_slo_s, else the smallest chunk keeping `efficiency` of the
    # prefill throughput (steptime.efficient_chunk; at most 512, Sarathi's default)
    token_budget: int | None = None
    # the share of an unbounded chunk's prefill throughput the default token budget keeps;
    # None: Sarathi's 512
    efficiency: float | None = 0.9
    tile_size: int = 128
    max_num_seqs: int = 256
    gpu_job_limit: int | None = None  # M: jobs allowed on the device; None: memory decides
    # opt-in default job limit (gpu_job_limit None): the smallest decode batch keeping this
    # share of an unbounded batch's decode throughput (steptime.efficient_batch). Off: live on
    # 2 cores it queued short answers behind the limit (docs/scheduling.md)
    job_limit_efficiency: float | None = None
    # TBT objectives: the TBT objective of every request (the operator's P99 TBT target): each
    # step is sized in time to meet it; with slo_aware_budget=False only tau is derived from it
    tbt_slo_s: float | None = None
    slo_aware_budget: bool = True  # size steps with TBT objectives in time (see above)
    prefill_lane: bool = True  # a step of its own for a prompt whose TTFT it can still meet
    # most decodes a lane may make miss their TBT objective (a long prompt's lane stalls every
    # decode with a tighter objective than its prefill time); None: no limit
    lane_max_misses: int | None = None
    # levels and aging (parts/levels.py)
    num_queues: int = 16  # normalized keys span a wider range than times
    aging_threshold_s: float | None = 5.0  # K: promote one level per K seconds waited
    # the rank (parts/ranking.py)
    rank: Rank = "normalized"  # remaining | normalized
    rank_ref_len: float = 16
    queue_base_s: float | None = None  # None: 16 decode iterations (16 * beta)
    queue_ratio: float = 2.0
    forecast_rule: str = "median"  # off | median | quantile | mean | gittins
    forecast_quantile: float = 0.7
    # admission of new work
    max_window: int = 16  # candidates compared per level window
    max_skips: int = 32  # prompts skipped for not fitting before giving up
    era: bool = True
    long_prompt_tokens: int | None = None  # None: longer than the token budget
    max_long_prompts: int = 1
    # eviction and memory (parts/eviction.py, parts/protection.py, parts/memory.py)
    preempt_level_gap: int | None = 2  # None: new requests never evict running ones
    protect_fraction: float | None = None
    protect_kv_share: float | None = None
    memory_mode: MemoryMode = "swap"  # swap | recompute | defer
    watermark: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preempt_level_gap is not None and self.preempt_level_gap < 1:
            raise KnobError("preempt_level_gap must be >= 1 or None")
        if self.lane_max_misses is not None and self.lane_max_misses < 0:
            raise KnobError("lane_max_misses must be >= 0 or None")
        for name in ("efficiency", "job_limit_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise KnobError(f"{name} must be in (0, 1) or None")


def curve_defaults(k: HybridKnobs, cost: CostModel) -> tuple[int, int | None]:
    """(token budget, job limit M) of `k` on `cost`: the knobs where set; otherwise the
    budget from `tbt_slo_s`, else the smallest chunk keeping `efficiency` of an unbounded
    chunk's throughput, and (opt-in) the smallest batch keeping `job_limit_efficiency` of an
    unbounded batch's (no limit when that batch reaches max_num_seqs)."""
    if k.token_budget or k.tbt_slo_s or k.efficiency is None:
        budget = sarathi_budget(k.token_budget, k.tbt_slo_s, k.tile_size, cost)
    else:
        budget = efficient_chunk(cost, k.efficiency, k.tile_size, DEFAULT_TOKEN_BUDGET)
    limit = k.gpu_job_limit
    if limit is None and k.job_limit_efficiency is not None:
        limit = efficient_batch(cost, k.job_limit_efficiency, TYPICAL_CONTEXT, k.max_num_seqs - 1)
    return budget, limit


@register_policy("hybrid")
class HybridPolicy(Policy):
    """Holds (policies/parts/): `levels` (level queues, virtual aging), `rank` (levels by
    predicted remaining time x length, demotion, forecasts), `protect` (limited preemption),
    `evict` (candidates by EWT), `memory` (ALISE Algorithm 2) and the step's `limits`; the
    step itself, with its SLO lanes and urgency, is this class's."""

    knobs_type = HybridKnobs
    knobs: HybridKnobs
    # set by `bind`
    limits: StepLimits  # what a step opens with (the Batch holds the step's budget)
    levels: Levels
    rank: RemainingRank
    protect: Protection
    evict: EwtEviction
    memory: MemoryRule
    tbt: dict[str, float]  # requests with their own TBT objective
    ttft_heap: list[tuple[float, str]]  # (TTFT deadline, request) of those not started
    long_inflight: set[str]  # long prompts being prefilled (ERA)
    recent: deque[float]  # durations of the last steps (T_max)
    attention: AttentionFit  # the prefill attention term, fitted from step times
    _timed: bool  # this step's budget is a time (chunks are charged their context)
    _pairs: float  # attention pairs of the step in flight
    _last_decode_step: float  # cost-model time of the last step's decodes alone
    _paused: set[str]  # running requests ranked past gpu_job_limit this step

    def __init__(self, name: str | None = None, **knobs: object) -> None:
        super().__init__(name, **knobs)
        # the length assumed at arrival (answered before `bind` too)
        self.prior = arrival_prior(RankRule.default_predicted_len)

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        tokens, job_limit = curve_defaults(k, sched.cost_model)
        self.limits = StepLimits.of(tokens, k.max_num_seqs, job_limit)
        self.levels = Levels(k.rule(LevelRule))
        self.rank = RemainingRank(
            k.rule(RankRule), sched.cost_model, k.num_queues, self.levels.boost, self.prior
        )
        self.protect = Protection(k.rule(ProtectRule), sched.block_manager, self.rank.pred)
        self.memory = k.rule(MemoryRule)
        self.long_inflight = set()
        self.evict = EwtEviction(
            self.levels,
            sched,
            self.memory.evict_mode,
            self.protect.protected,
            self.long_inflight.discard,  # an evicted long prompt is no longer being prefilled
        )
        self.tbt = {}
        self.ttft_heap = []
        self.recent = deque(maxlen=T_MAX_WINDOW)
        self.attention = AttentionFit()
        self._timed, self._pairs, self._last_decode_step = False, 0.0, 0.0
        self._paused = set()

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req: Request, now: float) -> None:
        level, rem = self.rank.arrived(req)
        self.levels.add(req, level, now, rem)
        if req.slo.tbt_s:
            self.tbt[req.request_id] = req.slo.tbt_s
        if not req.output_token_ids:  # re-admitted: TTFT is behind it
            self._push_ttft(req)

    def _push_ttft(self, req: Request) -> None:
        if req.slo.ttft_s:
            heapq.heappush(self.ttft_heap, (req.arrival_time + req.slo.ttft_s, req.request_id))

    def on_move(self, req: Request, status: RequestStatus) -> None:
        if status is RUNNING:
            self.levels.resident(req.request_id)

    def on_finish(self, req: Request, now: float) -> None:
        rid = req.request_id
        self.levels.finish(rid)
        self.rank.finish(rid)
        self.tbt.pop(rid, None)
        self.long_inflight.discard(rid)

    def initial_prediction(self, req: Request) -> int:
        return self.prior(req)

    def predicted_len(self, req: Request) -> int:
        return self.rank.predicted(req) if self._sched is not None else self.prior(req)

    def update(self, result: AppliedStep, now: float) -> None:
        cost, elapsed = self.sched.cost_model, result.outcome.elapsed_s
        self.recent.append(elapsed or cost.step_time(result.shape))
        if elapsed:
            self.attention.observe(elapsed, cost.step_time(result.shape), self._pairs)
        reqs = self.sched.requests
        for rid in result.output.num_scheduled_tokens:
            req = reqs.get(rid)
            if req is not None and not req.is_finished:
                self.levels.put(req, *self.rank.ran(req))
        for rid in list(self.long_inflight):
            if reqs[rid].num_computed_tokens >= reqs[rid].num_prompt_tokens:
                self.long_inflight.discard(rid)

    # -- step -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """One step in four phases, each adding to the Batch `b` (the only thing that changes
        the scheduler's state): the running decodes, which fix the step's budget (or a
        prefill lane, which closes the step); the urgent prompts; ranked prefill chunks;
        eviction (ALISE Algorithm 2)."""
        self.levels.age(now)
        b = self.sched.new_batch(now, self.limits.tokens)
        self.evict.begin([])
        self._paused = self._ranked_out()
        if not self._phase_decodes(b):
            self._phase_urgent(b, now)
            self._phase_prefills(b)
        if self._paused and not b.scheduled:  # nothing took their place: run them after all
            self._paused = set()
            self._schedule_decodes(b, None)
        rebalance(b, self.sched, self.levels, self.memory, self.limits, self.watermark_blocks)
        self.levels.track_waits(b, now)
        self._pairs = AttentionFit.pairs(b.scheduled, self.sched.requests)
        return b.finish()

    def _ranked_out(self) -> set[str]:
        """With a concurrency limit (`gpu_job_limit` M): the running requests ranked past M,
        at least `preempt_level_gap` levels below a request inside M that waits for a place
        (SRPT with M jobs at a time, ALISE Algorithm 2, with hysteresis against thrash),
        except the protected ones (limited preemption). They sit the step out and
        `_rebalance` offloads them; their places go to the better-ranked."""
        # only a limit set by hand pauses running requests by rank: on weak predictions a
        # running request overtaken by a forecast loses more than the one it lets in gains
        limit, gap = self.knobs.gpu_job_limit, self.knobs.preempt_level_gap
        if not limit or gap is None or len(self.sched.running) < limit:
            return set()
        out: set[str] = set()
        best = None  # the best level of a request inside M that is not running
        level = self.levels.level_of
        for rank, req in enumerate(self.levels.in_order()):
            if rank < limit:
                if best is None and req.status is not RUNNING:
                    best = level[req.request_id]
            elif best is None:
                break
            elif (
                req.status is RUNNING
                and level[req.request_id] >= best + gap  # hysteresis against thrash
                and not self.protect.protected(req)
            ):
                out.add(req.request_id)
        return out

    def _room(self, b: Batch) -> bool:
        return not b.preempted and b.tokens_left >= 1 and b.num_seqs < self.limits.seqs

    # -- phase 1: running decodes and the step's budget -------------------------------------
    def _phase_decodes(self, b: Batch) -> bool:
        """Every running decode (Sarathi: never skipped for priority), evicting by EWT when
        KV runs out; then the step's budget, computed once (`_slo_budget`). With a prefill
        lane, only the decodes that cannot sit it out, then the lane's prompt: returns True
        (step closed)."""
        lane = self._lane(b)
        context = self._schedule_decodes(b, None if lane is None else lane[1])
        if lane is None:  # the lane's estimate of the step after it, for the next step
            self._last_decode_step = self.sched.cost_model.iteration_time(
                0, len(b.scheduled), context
            )
        if lane is not None:
            req = lane[0]
            if b.schedule(req, req.num_uncomputed_tokens, self.watermark_blocks):
                b.close()
                return True
            context += self._schedule_decodes(b, None)  # no room after all: a normal step
        self._slo_budget(b, context)
        return False

    def _schedule_decodes(self, b: Batch, only: set[str] | None) -> int:
        """Schedule the running decodes (those in `only`, when given); returns their context."""
        context, seqs, scheduled = 0, self.limits.seqs, b.scheduled
        for req in list(self.sched.running.values()):
            if req.status is not RUNNING or req.num_uncomputed_tokens != 1:
                continue
            if req.request_id in scheduled or (only is not None and req.request_id not in only):
                continue
            if req.request_id in self._paused:
                continue
            if len(scheduled) >= seqs or b.tokens_left < 1:
                break
            while not b.schedule(req, 1):
                if not self.evict.evict_one(b, req):
                    break
            if req.request_id in scheduled:
                context += req.num_computed_tokens
        return context

    def _objective(self, req: Request) -> float | None:
        """The TBT objective a decode of `req` carries: its own, `tbt_slo_s`, the tighter."""
        own, default = self.tbt.get(req.request_id), self.knobs.tbt_slo_s
        if own is None or default is None:
            return own if own is not None else default
        return min(own, default)

    def decode_slack(self, req: Request, now: float) -> float | None:
        """Seconds left before `req`'s next token misses its TBT objective (negative:
        missed; None: it has none)."""
        objective = self._objective(req)
        if objective is None:
            return None
        last = req.token_times[-1] if req.token_times else now
        return last + objective - now

    def _tightest_slack(self, b: Batch) -> tuple[float | None, bool]:
        """(least time any scheduled decode has left before its next token misses its TBT
        objective, ignoring late ones; whether every one of them has an objective)."""
        tbt, default, reqs, now = self.tbt, self.knobs.tbt_slo_s, self.sched.requests, b.now
        tight, covered = None, True
        for rid in b.scheduled:  # the hot loop of a step: `decode_slack` inline
            own = tbt.get(rid)
            objective = own if default is None or (own is not None and own < default) else default
            if objective is None:
                covered = False
                continue
            times = reqs[rid].token_times
            left = (times[-1] if times else now) + objective - now
            if left > 0 and (tight is None or left < tight):
                tight = left
        return tight, covered

    def _slo_budget(self, b: Batch, context: int) -> None:
        """Size the step in time when its decodes carry TBT objectives: the tokens that fit
        the least time any of them has left (late ones no longer count), capped by tau only
        when some decode carries none; without decodes, `tbt_slo_s` when set."""
        self._timed = False
        k = self.knobs
        if not k.slo_aware_budget or not (self.tbt or k.tbt_slo_s):
            return
        tight, covered = self._tightest_slack(b)
        if tight is None and not b.scheduled:
            tight = k.tbt_slo_s
        if tight is None:
            return
        cap = 1 << 16 if covered else b.token_budget or 0
        cm = self.sched.cost_model
        n = cm.token_budget(tight, 1, b.num_tokens, context, cap)
        room = n - b.num_tokens
        if room > 0 and self.attention.coef > 0:  # a new prompt's first chunk attends itself
            u = cm.c_prefill + cm.c_context
            n = b.num_tokens + chunk_tokens(cm, self.attention.coef, room * u, 0, room)
        if n >= k.tile_size:
            n -= n % k.tile_size
        b.set_budget(n)
        self._timed = True

    def _lane(self, b: Batch) -> tuple[Request, set[str]] | None:
        """The waiting prompt with the earliest TTFT deadline (among `max_window`) that needs a
        step of its own and can meet its objective in one, and the decodes that must share it.
        It needs one when a step shared with every decode would end too late, or when it is
        longer than tau (chunks over several shared steps); longer than tau, only when every
        running decode has an objective to bound the stall (the others keep Sarathi's)."""
        self._drop_missed(b.now)
        if not self.knobs.prefill_lane or not self.ttft_heap:
            return None
        heap, reqs, now = self.ttft_heap, self.sched.requests, b.now
        seen: list[tuple[float, str]] = []
        found: tuple[Request, set[str]] | None = None
        decodes: list[Request] | None = None
        # every request has a TBT objective (the running decodes among them)
        bounded = self.knobs.tbt_slo_s is not None or len(self.tbt) >= len(self.levels.q)
        after = self._last_decode_step
        while heap and len(seen) < self.knobs.max_window and found is None:
            deadline, rid = heapq.heappop(heap)
            seen.append((deadline, rid))
            req = reqs.get(rid)
            if req is None or req.status is not WAITING:
                continue
            long = req.num_uncomputed_tokens > b.tokens_left  # (the step is still empty)
            if long and not bounded:
                continue
            if not long and self._lone_time(req) + after <= deadline - now:
                continue  # a shared step meets it
            if decodes is None:
                decodes, after = self._running_decodes()
            keep = self._lane_decodes(b, req, deadline - now, decodes, after)
            if keep is not None:
                found = (req, keep)
        for entry in seen:
            heapq.heappush(heap, entry)
        return found

    def _lone_time(self, req: Request) -> float:
        """The step time of `req`'s whole remaining prefill alone."""
        p, cached = req.num_uncomputed_tokens, req.num_computed_tokens
        cm = self.sched.cost_model
        return cm.iteration_time(p, 0, cached + p) + self.attention.coef * p * (cached + p / 2)

    def _lane_misses(
        self, b: Batch, decodes: list[Request], keep: set[str], t: float, after: float
    ) -> int:
        """Decodes whose next token a lane of `t` seconds would make miss its objective (a
        kept one at the lane's end, the others after the step `after` it)."""
        misses = 0
        for d in decodes:
            slack = self.decode_slack(d, b.now)
            if slack is not None:
                misses += 0 < slack < (t if d.request_id in keep else t + after)
        return misses

    def _running_decodes(self) -> tuple[list[Request], float]:
        """The running decodes and the time of a step of all of them."""
        decodes = [
            r
            for r in self.sched.running.values()
            if r.status is RUNNING and r.num_uncomputed_tokens == 1
        ]
        context = sum(r.num_computed_tokens for r in decodes)
        return decodes, self.sched.cost_model.iteration_time(0, len(decodes), context)

    def _lane_decodes(
        self, b: Batch, req: Request, left: float, decodes: list[Request], after: float
    ) -> set[str] | None:
        """Decodes that cannot sit out `req`'s own step (no objective, or too little slack for
        it and the step `after` it), or None when that step would miss `left` or KV lacks."""
        cm = self.sched.cost_model
        p, t = req.num_uncomputed_tokens, self._lone_time(req)
        if t > left:
            return None
        keep: set[str] = set()
        for d in decodes:
            slack = self.decode_slack(d, b.now)
            if slack is None or 0 < slack < t + after:
                keep.add(d.request_id)
                t += cm.c_decode + cm.c_context * (d.num_computed_tokens + 1)
        if t > left:
            return None
        limit = self.knobs.lane_max_misses
        if limit is not None and self._lane_misses(b, decodes, keep, t, after) > limit:
            return None
        if b.blocks_needed(req, p) + self.watermark_blocks + len(keep) > b.free_blocks:
            return None
        return keep

    # -- phase 2: urgent prompts ------------------------------------------------------------
    def _phase_urgent(self, b: Batch, now: float) -> None:
        """Requests whose TTFT objective is due go before the chunks of started prompts (one
        window of them); the ones left out keep their deadline for the next step."""
        if not self._room(b):
            return
        urgent = self._urgent(now)
        self._admit(b, urgent[: self.knobs.max_window])
        for req in urgent:
            if req.request_id not in b.scheduled and req.status is not RUNNING:
                self._push_ttft(req)

    def _drop_missed(self, now: float) -> None:
        """Forget TTFT objectives already missed: such a request no longer jumps the queue
        (EDF over missed deadlines serves the oldest first and makes every later one miss
        too, the domino effect under overload); the levels order it like any other."""
        heap = self.ttft_heap
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)

    def _urgent(self, now: float) -> list[Request]:
        """Waiting requests whose TTFT objective needs them in this iteration."""
        t_max = max(self.recent) if self.recent else 0.0
        self._drop_missed(now)
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

    # -- phase 3: ranked prefill chunks -----------------------------------------------------
    def _phase_prefills(self, b: Batch) -> None:
        """The started prompts' next chunks (by level), then new and swapped work, level by
        level, nearest in (compute, KV) first within a window."""
        self._ongoing_prefills(b)
        if self._room(b):
            self._admit(b, None)

    def _ongoing_prefills(self, b: Batch) -> None:
        level = self.levels.level_of
        ongoing = [
            r
            for r in self.sched.running.values()
            if r.num_uncomputed_tokens > 1 and r.request_id not in b.scheduled
        ]
        ongoing.sort(key=lambda r: level.get(r.request_id, 0))
        for req in ongoing:
            n = min(req.num_uncomputed_tokens, b.tokens_left)
            if self._timed:
                n = self._timed_chunk(b, req, n)
            if n < 1 or b.num_seqs >= self.limits.seqs:
                break
            while req.status is RUNNING and not b.schedule(req, n):
                if not self.evict.evict_one(b, req):
                    break

    def _timed_chunk(self, b: Batch, req: Request, n: int) -> int:
        """In a step sized in time: the chunk of `req` whose context reads and attention fit
        what is left, the budget lowered by what they cost beyond its tokens."""
        cm, coef, c = self.sched.cost_model, self.attention.coef, req.num_computed_tokens
        u = cm.c_prefill + cm.c_context
        m = chunk_tokens(cm, coef, b.tokens_left * u, c, n)
        if m >= 1:
            b.charge(int(chunk_time(cm, coef, c, m) / u + 0.999), m)
        return m

    def _admit(self, b: Batch, urgent: list[Request] | None) -> None:
        """New and swapped work by priority, one level window at a time (`urgent`: that one
        window instead)."""
        skips, reqs, seqs = 0, self.sched.requests, self.limits.seqs
        for window in [urgent] if urgent is not None else self._windows():
            if b.tokens_left < 1 or b.num_seqs >= seqs or not window:
                break
            gap = self.knobs.preempt_level_gap
            if gap is not None:
                self.evict.room_for(b, window[0], gap, self.watermark_blocks)
            before = len(b.scheduled)  # select_nearest only adds to the batch
            left = select_nearest(b, window, self.watermark_blocks, self._allowed(b), seqs)
            for rid in islice(b.scheduled, before, None):
                self._started(reqs[rid], b)
            skips += len(left)
            if skips > self.knobs.max_skips:
                break

    def _windows(self) -> Iterator[list[Request]]:
        """Requests not running, level by level, at most `max_window` at a time."""
        size = self.knobs.max_window
        for level in self.levels.q.levels:
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
