"""`accelgen`: AccelGen's SLO-guaranteed dynamic chunking, iteration-level slack ordering and
multi-resource-aware batching (Algorithms 1 and 2).

Each step:
 1. Requests are ordered by remaining slack T_r (core/policies/slack.py). Urgent ones
    (T_r <= T_max: they must run in the next iteration) are forced into the batch, most urgent
    first. A resident request that cannot grow for KV preempts, as in vLLM (on which AccelGen
    is built and whose KV-overflow handling it keeps), the resident requests that arrived
    after it, latest first, or yields itself (recompute by default).
 2. The token budget S_b is the largest forward size whose profiled iteration time fits
    SLO_min (eq. 6 is its linear approximation through the pivot; `budget_rule="eq6"` uses
    eq. 6 literally). SLO_min ranges over the TBT objectives of the urgent requests, the
    queue head and the resident TG tasks; a prompt's TTFT objective, a deadline for its whole
    prefill, is served by the ordering, not by the budget (`budget_slo="all"` includes it).
 3. SelectRequests: take the window of requests with T_r within T_r^1 + gamma of the first
    non-urgent one, then pick nearest-(compute, KV) demand first (policies/multires.py).
    Further windows are taken while budget and KV remain (work conservation; the paper's
    pseudo-code stops after one window).
 4. A waiting prompt is admitted only when the KV of its whole prompt fits (section 4.4's
    D_m of a first chunk is its whole sequence, vLLM's can_allocate); its prefill is still
    chunked. Exclusive request allocation (ERA): a new long prompt, urgent or not, does not
    start while `max_long_prompts` long prompts are still being prefilled.

Without steps 1's victim order and 4's admission test, long prompts started in the last free
blocks stopped half-way and recompute made them preempt each other in turn (one long prompt
preempted 55 times, prefill work 6.5x the prompt tokens); the knobs `victim_order="slack"`
and `admit_whole=False` bring that behaviour back for comparison.

Fig. 12 ablations (AccelGen without one of its three methods):
  * `dynamic_chunking=False` ("/Chunk"): no SLO-derived budget and no chunking. Every step
    packs against one fixed budget, S_b at `default_tbt_s` (the budget of a request with the
    default objective, computed once), and prompts are taken whole: only when all of it fits
    the leftover budget, except that a step with no prompt in it yet takes the most urgent
    waiting prompt whole even when it is longer (the step then exceeds the budget: the long-
    prompt interference that chunking removes). Slack estimates count a prompt as one chunk.
    The paper's /Chunk also drops ERA, part of the same method: add `era=false`.
  * `slack_ordering=False` ("/Order"): the queue is in arrival order (FCFS, as vLLM's) instead
    of remaining slack, there is no urgent forcing (no T_r), and a SelectRequests window is
    the next `max_window` requests of the queue (gamma is a slack distance). S_b still
    follows the objective of the queue head.
  * `multires=False` ("/Batch"): inside a window requests are taken in queue order, each
    chunked to what is left (`multires.select_in_order`), instead of nearest (compute, KV)
    demand first.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import (
    KnobError,
    Knobs,
    Policy,
    PreemptionMode,
    register_policy,
)
from services.scheduler.core.policies.parts.multires import select_in_order, select_nearest
from services.scheduler.core.policies.parts.slack import SlackQueue
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.common.step import SchedulerOutput
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.request import Request
    from services.scheduler.core.view import AppliedStep, SchedulerView

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
MAX_URGENT = 64  # urgent requests taken from the queue before the budget


@dataclass(frozen=True)
class AccelGenKnobs(Knobs):
    default_tbt_s: float = 0.1875  # normal reading speed (AccelGen's default TBT SLO)
    default_ttft_s: float = 1.0  # TTFT objective of requests that give none
    gamma_s: float = 0.75  # SelectRequests window (AccelGen sets 0.75 s)
    era: bool = True  # exclusive request allocation for long prompts
    long_prompt_tokens: int | None = None  # None: longer than the step's token budget S_b
    max_long_prompts: int = 1
    min_token_budget: int = 16
    max_token_budget: int = 8192
    t_max_s: float | None = None  # T_max; None: max iteration time of recent steps
    t_max_window: int = 32
    avg_chunk_tokens: int | None = None  # L_c; None: S_b at the default TBT
    preempt_max_s: float = 0.0  # P_max and P of the JCT estimate
    preempt_prob: float = 0.0
    max_window: int = 64  # candidates examined per SelectRequests window
    max_windows: int = 4
    max_num_seqs: int = 256
    watermark: float = 0.01
    preemption_mode: PreemptionMode = "recompute"
    # KV-overflow victims: later arrivals (vLLM) | "slack"
    victim_order: Literal["arrival", "slack"] = "arrival"
    # SLO_min over TBT objectives | "all" (TTFT of prompts)
    budget_slo: Literal["tbt", "all"] = "tbt"
    # S_b: profiled iteration time <= SLO_min | "eq6"
    budget_rule: Literal["profile", "eq6"] = "profile"
    admit_whole: bool = True  # admit a prompt only when its whole KV fits (vLLM)
    dynamic_chunking: bool = True  # False: fixed budget (S_b at default_tbt_s), whole prompts
    slack_ordering: bool = True  # False: arrival order, no urgent forcing
    multires: bool = True  # False: windows taken in queue order

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in (
            ("default_tbt_s", self.default_tbt_s),
            ("default_ttft_s", self.default_ttft_s),
            ("gamma_s", self.gamma_s),
        ):
            if not value or value < 0:
                raise KnobError(f"{key} must be > 0")
        if self.min_token_budget < 1 or self.max_token_budget < self.min_token_budget:
            raise KnobError("need 1 <= min_token_budget <= max_token_budget")
        for key, choice, allowed in (
            ("budget_rule", self.budget_rule, ("profile", "eq6")),
            ("budget_slo", self.budget_slo, ("tbt", "all")),
            ("victim_order", self.victim_order, ("arrival", "slack")),
        ):
            if choice not in allowed:
                raise KnobError(f"{key} must be {allowed[0]!r} or {allowed[1]!r}, got {choice!r}")
        for key, flag in (
            ("dynamic_chunking", self.dynamic_chunking),
            ("slack_ordering", self.slack_ordering),
            ("multires", self.multires),
            ("era", self.era),
            ("admit_whole", self.admit_whole),
        ):
            if not isinstance(flag, bool):
                raise KnobError(f"{key} must be true or false, got {flag!r}")


@register_policy("accelgen")
class AccelGenPolicy(Policy):
    knobs_type = AccelGenKnobs
    knobs: AccelGenKnobs
    # set by `bind`
    cost: CostModel
    sq: SlackQueue  # the queue ordered by remaining slack T_r
    recent: deque[float]  # durations of the last steps (T_max)
    long_inflight: set[str]  # long prompts being prefilled (ERA)
    fixed_budget: int  # S_b at default_tbt_s (dynamic_chunking=False)
    _default_chunk: int  # L_c
    _t_max_guess: float  # T_max before any step ran

    def bind(self, sched: SchedulerView) -> None:
        super().bind(sched)
        k = self.knobs
        self.cost = sched.cost_model
        self.sq = SlackQueue(self)
        self.recent = deque(maxlen=k.t_max_window)
        self.long_inflight = set()
        self.fixed_budget = self.budget_for(k.default_tbt_s)
        self._default_chunk = k.avg_chunk_tokens or self.fixed_budget
        self._t_max_guess = self.cost.iteration_time(self._default_chunk, 0, self._default_chunk)

    # -- model ------------------------------------------------------------------------------
    def budget_for(self, slo_min: float) -> int:
        """S_b for SLO_min.

        `budget_rule="profile"` (default): the largest forward size whose profiled iteration
        time fits SLO_min (the test of section 3's Fig. 7 experiment, "iteration time
        estimated from profiled data"). Eq. 6 is its linear approximation through the pivot
        (S_pf, T_pf): exact when T_pf is nearly all compute, as at the paper's measured
        saturation pivot (768 tokens for OPT-13B), but with a pivot at the compute/bandwidth
        knee of a cost model with a fixed per-iteration term (115 tokens, 0.020 s on the
        A100/Llama-2-7B roofline, half of it that fixed term) eq. 6 fills only about half of
        SLO_min: at a 0.1875 s objective S_b = 1,101 tokens run 0.091 s.
        `budget_rule="eq6"`: S_b = S_pf * SLO_min / T_pf with the profile's pivot."""
        if slo_min <= 0:  # a JCT request past its allowance
            return self.knobs.min_token_budget
        if self.knobs.budget_rule == "eq6":
            s_b = self.cost.accelgen_budget(slo_min)
        else:
            s_b = self.cost.token_budget(slo_min, max_tokens=self.knobs.max_token_budget)
        return min(self.knobs.max_token_budget, max(self.knobs.min_token_budget, s_b))

    def budget_slo_of(self, req: Request) -> float:
        """The objective `req` puts on this iteration's length, for SLO_min (eq. 6).

        `budget_slo="tbt"` (default): a TG task's (or JCT request's) per-iteration objective,
        and for a prompt its TBT objective, not its TTFT (the resident TG tasks' TBT
        objectives are added by `_resident_tbts`). The TTFT objective is a deadline for
        the whole prefill, N_ck chunks (section 4.3's T_e = N_ck * T_max), which the slack
        ordering and urgency serve; a budget cut to a short prompt's TTFT (as low as half its
        lone prefill time under AccelGen's SLO scales) cannot meet it, since a smaller S_b
        only splits the prompt over more iterations that each pay the fixed per-iteration
        cost, and it starves every other request of that step. The prompt's TBT bounds the
        iterations it will share with its own later tokens.
        `budget_slo="all"`: the objective of the request's next token, TTFT for a prompt."""
        if (
            self.knobs.budget_slo == "all"
            or req.output_token_ids
            or req.request_id in self.sq.jct_base
        ):
            return self.sq.slo(req)
        return req.slo.tbt_s or self.knobs.default_tbt_s

    def _resident_tbts(self) -> list[float]:
        """TBT objectives of the resident TG tasks: each one either runs in this iteration or
        waits for it, so its next token comes after the iteration ends either way (vLLM and
        Sarathi-Serve batch every running decode each step, so these are the requests "in
        the batch" whose minimum SLO eq. 6 must satisfy)."""
        default = self.knobs.default_tbt_s
        return [
            r.slo.tbt_s or default
            for r in self.sched.running.values()
            if r.output_token_ids and r.slo.deadline_s is None
        ]

    def t_max(self) -> float:
        if self.knobs.t_max_s:
            return self.knobs.t_max_s
        return max(self.recent) if self.recent else self._t_max_guess

    def avg_chunk(self) -> int:
        """L_c; without chunking every prompt is a single chunk."""
        return self._default_chunk if self.knobs.dynamic_chunking else self.sched.max_model_len

    def is_long(self, req: Request, budget: int | None) -> bool:
        """Whether `req` is a long prompt for ERA, with `budget` the step's token budget."""
        limit = self.knobs.long_prompt_tokens or budget
        return limit is not None and req.num_uncached_prompt_tokens > limit

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req: Request, now: float) -> None:
        self.sq.add(req, now)

    def on_finish(self, req: Request, now: float) -> None:
        self.sq.remove(req.request_id)
        self.long_inflight.discard(req.request_id)

    def update(self, result: AppliedStep, now: float) -> None:
        out = result.output
        self.recent.append(result.outcome.elapsed_s or self.cost.step_time(result.shape))
        reqs = self.sched.requests
        got_token = {u.request_id for u in result.updates}
        for rid in out.num_scheduled_tokens:
            req = reqs[rid]
            if req.is_finished:
                continue
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.long_inflight.discard(rid)
            if rid in got_token:
                self.sq.reenter(req, now)  # returned TG task: its wait restarts
            else:
                self.sq.push(req)  # prompt chunk: same clock, fewer chunks left

    # -- step -------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        t_max, full = self.t_max(), self._admission_closed()
        urgent: list[Request] = []
        while len(urgent) < MAX_URGENT and self._urgent_next(now, t_max, full):
            urgent.append(self._pop(full))
        b = self.sched.new_batch(now, self._step_budget(urgent, full))
        back = self._force_urgent(b, urgent, t_max, full)
        back += self._select(b)
        if not self.knobs.dynamic_chunking:
            self._whole_prompt_past_budget(b, back)
        if not b.scheduled:
            # nothing fitted without preemption: never idle while work waits, so treat the
            # least-slack request as urgent (otherwise KV held by stalled prompts deadlocks)
            back.sort(key=lambda r: self.sq.due.get(r.request_id, 0.0))
            for j, req in enumerate(back):
                if self._force(b, req):
                    back.pop(j)
                    break
        self._requeue(b, back)
        return b.finish()

    def _pop(self, residents_only: bool) -> Request:
        """Take the most urgent request off the queue (there is one)."""
        top = self.sq.pop(residents_only)
        assert top is not None
        return self.sched.requests[top[1]]

    def _step_budget(self, urgent: list[Request], full: bool) -> int:
        """S_b: the budget for SLO_min over the urgent requests, the queue head and (with
        `budget_slo="tbt"`) the resident TG tasks; fixed without dynamic chunking."""
        slos = [self.budget_slo_of(r) for r in urgent]
        head = self.sq.peek(full)
        if head is not None:
            slos.append(self.budget_slo_of(self.sched.requests[head[2]]))
        if self.knobs.budget_slo == "tbt":
            slos.extend(self._resident_tbts())
        if not self.knobs.dynamic_chunking:
            return self.fixed_budget
        return self.budget_for(min(slos)) if slos else self.knobs.max_token_budget

    def _force_urgent(
        self, b: Batch, urgent: list[Request], t_max: float, full: bool
    ) -> list[Request]:
        """Force the urgent requests in, most urgent first, then those that became urgent
        meanwhile, while budget and batch size remain; returns the ones left out."""
        back, i = [], 0
        while b.tokens_left >= 1 and b.num_seqs < self.knobs.max_num_seqs:
            full = full or self._admission_closed()
            if i < len(urgent):
                req, i = urgent[i], i + 1
            elif self._urgent_next(b.now, t_max, full):
                req = self._pop(full)
            else:
                break
            if not self._force(b, req):
                back.append(req)
        return back + urgent[i:]

    def _requeue(self, b: Batch, back: list[Request]) -> None:
        """Requests popped but left out go back with their slack; scheduled JCT requests
        book their wait."""
        sq, reqs = self.sq, self.sched.requests
        for req in back:
            if not req.is_finished and req.request_id not in sq.ver:
                sq.push(req, sq.due[req.request_id])
        for rid in b.scheduled:
            sq.ran(reqs[rid], b.now)

    def _urgent_next(self, now: float, t_max: float, residents_only: bool) -> bool:
        if not self.knobs.slack_ordering:
            return False  # no remaining time, so nothing is urgent
        due = self.sq.peek_due(residents_only)
        return due is not None and due - now <= t_max

    def _admission_closed(self) -> bool:
        """No new sequence can become resident now (vLLM's max_num_seqs or a full pool)."""
        s = self.sched
        return (
            len(s.running) >= self.knobs.max_num_seqs
            or s.block_manager.num_free_device_blocks <= self.watermark_blocks
        )

    def on_move(self, req: Request, status: RequestStatus) -> None:
        self.sq.moved(req)

    def _force(self, b: Batch, req: Request) -> bool:
        """Put an urgent request in. A waiting request must pass ERA and vLLM's limit on
        resident sequences, and is dropped from this iteration when its KV does not fit
        (Algorithm 1 drops the max-T_r members of B; the urgent list is processed in
        ascending T_r, so the ones dropped are the largest). A resident request that cannot
        grow preempts victims from `_victims` (vLLM's KV-overflow preemption, which AccelGen
        inherits); when none is left it yields itself, as vLLM preempts the request that
        cannot grow when nothing of lower priority remains."""
        if req.status not in (RUNNING, WAITING, SWAPPED) or b.num_seqs >= self.knobs.max_num_seqs:
            return False
        if req.status is not RUNNING and not self._allowed(b, req):
            return False  # resident-sequence limit, or ERA for a long prompt
        n = self._grant(req, b)
        if n < 1:
            return False
        victims: list[Request] | None = None
        while True:
            if req.status is SWAPPED:
                ok = b.swap_in(req) and b.schedule(req, n)
            else:
                ok = b.schedule(req, n)
            if ok:
                self._started(req, b)
                return True
            if req.status is not RUNNING:
                return False
            if victims is None:
                victims = self._victims(b, req)
            if not victims:
                if self.knobs.victim_order == "arrival":
                    self._preempt(b, req)
                return False
            self._preempt(b, victims.pop())

    def _preempt(self, b: Batch, victim: Request) -> bool:
        """Preempt `victim` and queue it again. A request swapped in during this very step
        cannot be preempted; it stays resident and out of the queue (re-queueing it while it
        is still resident made the urgent loop pop and retry it forever)."""
        if not b.preempt(victim, self.knobs.preemption_mode):
            return False
        self.long_inflight.discard(victim.request_id)
        self.sq.reenter(victim, b.now)
        return True

    def _grant(self, req: Request, b: Batch) -> int:
        """Tokens `req` may take within the leftover budget: a chunk, or without dynamic
        chunking its whole remaining work or nothing."""
        need, left = req.num_uncomputed_tokens, b.tokens_left
        if self.knobs.dynamic_chunking or need <= left:
            return min(need, left)
        return 0

    def _whole_prompt_past_budget(self, b: Batch, back: list[Request]) -> None:
        """dynamic_chunking=False: a step without a prompt takes the most urgent (first in
        queue order) prompt left out whole although it is longer than the leftover budget,
        and the step's budget grows to hold it; otherwise such a prompt could never run."""
        if any(n > 1 for n in b.scheduled.values()) or b.num_seqs >= self.knobs.max_num_seqs:
            return
        due = self.sq.due
        order = sorted(range(len(back)), key=lambda j: due.get(back[j].request_id, 0.0))
        for j in order:
            req = back[j]
            if (
                req.status not in (RUNNING, WAITING)
                or req.num_uncomputed_tokens <= 1
                or not self._allowed(b, req)
            ):
                continue
            reserve = 0 if req.status is RUNNING else self.watermark_blocks
            if b.schedule(req, req.num_uncomputed_tokens, reserve):
                self._started(req, b)
                b.cover()
                back.pop(j)
                return

    def _allowed(self, b: Batch, req: Request) -> bool:
        """vLLM's limit on resident sequences, its admission test, and ERA for a new long
        prompt."""
        s, k = self.sched, self.knobs
        if req.status is not RUNNING and len(s.running) >= k.max_num_seqs:
            return False
        if req.status is WAITING and k.admit_whole and not self._fits_whole(req):
            return False
        begun = req.num_computed_tokens > req.num_cached_tokens
        if not k.era or begun or not self.is_long(req, b.token_budget):
            return True
        if len(self.long_inflight) >= k.max_long_prompts:
            return False
        # long prompts started in this very step (SelectRequests records them only after the
        # window is done): without this, one window could start several at once
        reqs, budget = s.requests, b.token_budget
        started = {
            rid
            for rid in b.scheduled
            if reqs[rid].num_computed_tokens == reqs[rid].num_cached_tokens
            and self.is_long(reqs[rid], budget)
        }
        return len(self.long_inflight | started) < k.max_long_prompts

    def _fits_whole(self, req: Request) -> bool:
        """vLLM's admission test (can_allocate): a waiting request becomes resident only when
        the KV of its whole prompt (for a recompute, prompt and outputs so far) fits in the
        free blocks above the watermark, although its prefill then runs in chunks. Without
        it a long prompt started in the last free blocks stops half-way, and under
        recompute its chunks are thrown away when it or another request is preempted for
        KV. A prompt longer than the whole pool can only run in pieces, so it is exempt."""
        bm = self.sched.block_manager
        whole = bm.blocks_for_tokens(req.num_tokens) + self.watermark_blocks
        if whole > bm.num_device_blocks:
            return True
        # with prefix caching, cached blocks other requests hold take nothing from the pool
        need = bm.num_new_blocks(req, req.num_uncomputed_tokens) + self.watermark_blocks
        return need <= bm.num_free_device_blocks

    def _victims(self, b: Batch, req: Request) -> list[Request]:
        """Resident requests `req` may preempt, the next victim last.

        `victim_order="arrival"` (default): vLLM's KV-overflow rule, which AccelGen inherits
        (section 5, "we directly use vLLM to handle KVC overflow and preemptions"): victims
        are the resident requests that arrived after `req`, latest first, in the batch being
        formed or not. The order is fixed, so the oldest request always makes progress and a
        preempted long prompt keeps its rank: recompute cannot thrash between two requests.
        `victim_order="slack"`: the resident request outside the batch with the largest
        remaining time T_r goes first (Algorithm 1 read literally); T_r is recomputed on every
        re-entry, so two long requests can preempt each other in turn."""
        running = self.sched.running
        if self.knobs.victim_order == "arrival":
            t = req.arrival_time
            cands = [
                r
                for rid, r in running.items()
                if r is not req
                and rid not in b.swapped_in
                and (r.arrival_time, rid) > (t, req.request_id)
            ]
            cands.sort(key=lambda r: (r.arrival_time, r.request_id))
            return cands  # pop() yields the latest arrival
        due = self.sq.due
        cands = [
            r
            for rid, r in running.items()
            if rid not in b.scheduled and r is not req and rid not in b.swapped_in
        ]
        cands.sort(key=lambda r: due.get(r.request_id, 0.0))
        return cands  # pop() yields the largest remaining time

    def _started(self, req: Request, b: Batch) -> None:
        if req.num_computed_tokens < req.num_prompt_tokens and self.is_long(req, b.token_budget):
            self.long_inflight.add(req.request_id)

    def _select(self, b: Batch) -> list[Request]:
        """SelectRequests over successive gamma windows; returns the requests not taken."""
        k, reqs = self.knobs, self.sched.requests
        back: list[Request] = []
        select = select_nearest if k.multires else select_in_order
        whole = not k.dynamic_chunking

        def allowed(req: Request) -> bool:
            return self._allowed(b, req)

        for _ in range(k.max_windows):
            if b.tokens_left < 1 or b.num_seqs >= k.max_num_seqs:
                break
            full = self._admission_closed()
            first = self.sq.pop(full)
            if first is None:
                break
            limit = first[0] + k.gamma_s if k.slack_ordering else math.inf
            rids = self.sq.pop_through(limit, full, k.max_window - 1)
            window = [reqs[first[1]]] + [reqs[rid] for rid in rids]
            before = len(b.scheduled)  # selection only adds to the batch
            back += select(b, window, self.watermark_blocks, allowed, k.max_num_seqs, whole)
            for rid in islice(b.scheduled, before, None):
                self._started(reqs[rid], b)
        return back
