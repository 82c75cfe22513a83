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
from itertools import islice

from services.scheduler.core.policies.base import Policy, register_policy
from services.scheduler.core.policies.multires import select_in_order, select_nearest
from services.scheduler.core.policies.slack import SlackQueue
from services.scheduler.core.request import RequestStatus

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


@register_policy("accelgen")
class AccelGenPolicy(Policy):
    KNOBS = {
        "default_tbt_s": 0.1875,       # normal reading speed (AccelGen's default TBT SLO)
        "default_ttft_s": 1.0,         # TTFT objective of requests that give none
        "gamma_s": 0.75,               # SelectRequests window (AccelGen sets 0.75 s)
        "era": True,                   # exclusive request allocation for long prompts
        "long_prompt_tokens": None,    # None: longer than the step's token budget S_b
        "max_long_prompts": 1,
        "min_token_budget": 16,
        "max_token_budget": 8192,
        "t_max_s": None,               # T_max; None: max iteration time of recent steps
        "t_max_window": 32,
        "avg_chunk_tokens": None,      # L_c; None: S_b at the default TBT
        "preempt_max_s": 0.0,          # P_max and P of the JCT estimate
        "preempt_prob": 0.0,
        "max_window": 64,              # candidates examined per SelectRequests window
        "max_windows": 4,
        "max_num_seqs": 256,
        "watermark": 0.01,
        "preemption_mode": "recompute",
        "victim_order": "arrival",     # KV-overflow victims: later arrivals (vLLM) | "slack"
        "budget_slo": "tbt",           # SLO_min over TBT objectives | "all" (TTFT of prompts)
        "budget_rule": "profile",      # S_b: profiled iteration time <= SLO_min | "eq6"
        "admit_whole": True,           # admit a prompt only when its whole KV fits (vLLM)
        "dynamic_chunking": True,      # False: fixed budget (S_b at default_tbt_s), whole prompts
        "slack_ordering": True,        # False: arrival order, no urgent forcing
        "multires": True,              # False: windows taken in queue order
    }

    def validate(self) -> None:
        super().validate()
        for key in ("default_tbt_s", "default_ttft_s", "gamma_s"):
            if not self.knobs[key] or self.knobs[key] < 0:
                raise ValueError(f"accelgen: {key} must be > 0")
        if self.min_token_budget < 1 or self.max_token_budget < self.min_token_budget:
            raise ValueError("accelgen: need 1 <= min_token_budget <= max_token_budget")
        if self.knobs["budget_rule"] not in ("profile", "eq6"):
            raise ValueError("accelgen: budget_rule must be 'profile' or 'eq6', "
                             f"got {self.knobs['budget_rule']!r}")
        if self.knobs["budget_slo"] not in ("tbt", "all"):
            raise ValueError("accelgen: budget_slo must be 'tbt' or 'all', "
                             f"got {self.knobs['budget_slo']!r}")
        if self.knobs["victim_order"] not in ("arrival", "slack"):
            raise ValueError("accelgen: victim_order must be 'arrival' or 'slack', "
                             f"got {self.knobs['victim_order']!r}")
        for key in ("dynamic_chunking", "slack_ordering", "multires", "era", "admit_whole"):
            if not isinstance(self.knobs[key], bool):
                raise ValueError(f"accelgen: {key} must be true or false, got {self.knobs[key]!r}")

    def bind(self, sched) -> None:
        super().bind(sched)
        self.cost = sched.cost_model
        self.sq = SlackQueue(self)
        self.recent = deque(maxlen=self.t_max_window)
        self.long_inflight: set[str] = set()
        self.fixed_budget = self.budget_for(self.default_tbt_s)   # dynamic_chunking=False
        self._default_chunk = self.avg_chunk_tokens or self.fixed_budget
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
        if slo_min <= 0:                 # a JCT request past its allowance
            return self.min_token_budget
        if self.budget_rule == "eq6":
            s_b = self.cost.accelgen_budget(slo_min)
        else:
            s_b = self.cost.token_budget(slo_min, max_tokens=self.max_token_budget)
        return min(self.max_token_budget, max(self.min_token_budget, s_b))

    def budget_slo_of(self, req) -> float:
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
        if self.budget_slo == "all" or req.output_token_ids or req.request_id in self.sq.jct_base:
            return self.sq.slo(req)
        return req.slo.tbt_s or self.default_tbt_s

    def _resident_tbts(self, s) -> list[float]:
        """TBT objectives of the resident TG tasks: each one either runs in this iteration or
        waits for it, so its next token comes after the iteration ends either way (vLLM and
        Sarathi-Serve batch every running decode each step, so these are the requests "in
        the batch" whose minimum SLO eq. 6 must satisfy)."""
        default = self.default_tbt_s
        return [r.slo.tbt_s or default for r in s.running.values()
                if r.output_token_ids and r.slo.deadline_s is None]

    def t_max(self) -> float:
        if self.t_max_s:
            return self.t_max_s
        return max(self.recent) if self.recent else self._t_max_guess

    def avg_chunk(self) -> int:
        """L_c; without chunking every prompt is a single chunk."""
        return self._default_chunk if self.dynamic_chunking else self.sched.max_model_len

    def is_long(self, req, budget: int) -> bool:
        return req.num_prompt_tokens > (self.long_prompt_tokens or budget)

    # -- lifecycle --------------------------------------------------------------------------
    def on_add(self, req, now: float) -> None:
        self.sq.add(req, now)

    def on_finish(self, req, now: float) -> None:
        self.sq.remove(req.request_id)
        self.long_inflight.discard(req.request_id)

    def update(self, result, now: float) -> None:
        out = result.output
        self.recent.append(result.outcome.elapsed_s or self.cost.output_time(out))
        reqs = self.sched.requests
        got_token = {u.request_id for u in result.updates}
        for rid in out.num_scheduled_tokens:
            req = reqs[rid]
            if req.is_finished:
                continue
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.long_inflight.discard(rid)
            if rid in got_token:
                self.sq.reenter(req, now)        # returned TG task: its wait restarts
            else:
                self.sq.push(req)                # prompt chunk: same clock, fewer chunks left

    # -- step -------------------------------------------------------------------------------
    def schedule(self, s, now: float):
        t_max, sq = self.t_max(), self.sq
        urgent, back = [], []
        full = self._admission_closed(s)
        while len(urgent) < 64 and self._urgent_next(now, t_max, full):
            urgent.append(s.requests[sq.pop(full)[1]])
        slos = [self.budget_slo_of(r) for r in urgent]
        head = sq.peek(full)
        if head is not None:
            slos.append(self.budget_slo_of(s.requests[head[2]]))
        if self.budget_slo == "tbt":
            slos.extend(self._resident_tbts(s))
        if not self.dynamic_chunking:
            budget = self.fixed_budget
        else:
            budget = self.budget_for(min(slos)) if slos else self.max_token_budget
        b = s.new_batch(now, budget)
        i = 0
        while b.tokens_left >= 1 and b.num_seqs < self.max_num_seqs:
            full = full or self._admission_closed(s)
            if i < len(urgent):
                req, i = urgent[i], i + 1
            elif self._urgent_next(now, t_max, full):
                req = s.requests[sq.pop(full)[1]]
            else:
                break
            if not self._force(s, b, req):
                back.append(req)
        back += urgent[i:]
        back += self._select(s, b, now)
        if not self.dynamic_chunking:
            self._whole_prompt_past_budget(s, b, back)
        if not b.scheduled:
            # nothing fitted without preemption: never idle while work waits, so treat the
            # least-slack request as urgent (otherwise KV held by stalled prompts deadlocks)
            back.sort(key=lambda r: sq.due.get(r.request_id, 0.0))
            for j, req in enumerate(back):
                if self._force(s, b, req):
                    back.pop(j)
                    break
        for req in back:
            if not req.is_finished and req.request_id not in sq.ver:
                sq.push(req, sq.due[req.request_id])
        for rid in b.scheduled:
            sq.ran(s.requests[rid], now)
        return b.finish()

    def _urgent_next(self, now: float, t_max: float, residents_only: bool) -> bool:
        if not self.slack_ordering:
            return False                 # no remaining time, so nothing is urgent
        due = self.sq.peek_due(residents_only)
        return due is not None and due - now <= t_max

    def _admission_closed(self, s) -> bool:
        """No new sequence can become resident now (vLLM's max_num_seqs or a full pool)."""
        return (len(s.running) >= self.max_num_seqs
                or s.block_manager.num_free_device_blocks <= self.watermark_blocks)

    def on_move(self, req, status) -> None:
        self.sq.moved(req)

    def _force(self, s, b, req) -> bool:
        """Put an urgent request in. A waiting request must pass ERA and vLLM's limit on
        resident sequences, and is dropped from this iteration when its KV does not fit
        (Algorithm 1 drops the max-T_r members of B; the urgent list is processed in
        ascending T_r, so the ones dropped are the largest). A resident request that cannot
        grow preempts victims from `_victims` (vLLM's KV-overflow preemption, which AccelGen
        inherits); when none is left it yields itself, as vLLM preempts the request that
        cannot grow when nothing of lower priority remains."""
        if req.status not in (RUNNING, WAITING, SWAPPED) or b.num_seqs >= self.max_num_seqs:
            return False
        if req.status is not RUNNING and not self._allowed(s, b, req):
            return False                 # resident-sequence limit, or ERA for a long prompt
        n = self._grant(req, b)
        if n < 1:
            return False
        victims = None
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
                victims = self._victims(s, b, req)
            if not victims:
                if self.victim_order == "arrival":
                    self._preempt(b, req)
                return False
            self._preempt(b, victims.pop())

    def _preempt(self, b, victim) -> bool:
        """Preempt `victim` and queue it again. A request swapped in during this very step
        cannot be preempted; it stays resident and out of the queue (re-queueing it while it
        is still resident made the urgent loop pop and retry it forever)."""
        if not b.preempt(victim, self.preemption_mode):
            return False
        self.long_inflight.discard(victim.request_id)
        self.sq.reenter(victim, b.now)
        return True

    def _grant(self, req, b) -> int:
        """Tokens `req` may take within the leftover budget: a chunk, or without dynamic
        chunking its whole remaining work or nothing."""
        need, left = req.num_uncomputed_tokens, b.tokens_left
        if self.dynamic_chunking or need <= left:
            return min(need, left)
        return 0

    def _whole_prompt_past_budget(self, s, b, back: list) -> None:
        """dynamic_chunking=False: a step without a prompt takes the most urgent (first in
        queue order) prompt left out whole although it is longer than the leftover budget,
        and the step's budget grows to hold it; otherwise such a prompt could never run."""
        if any(n > 1 for n in b.scheduled.values()) or b.num_seqs >= self.max_num_seqs:
            return
        due = self.sq.due
        order = sorted(range(len(back)), key=lambda j: due.get(back[j].request_id, 0.0))
        for j in order:
            req = back[j]
            if (req.status not in (RUNNING, WAITING) or req.num_uncomputed_tokens <= 1
                    or not self._allowed(s, b, req)):
                continue
            reserve = 0 if req.status is RUNNING else self.watermark_blocks
            if b.schedule(req, req.num_uncomputed_tokens, reserve):
                self._started(req, b)
                b.token_budget = max(b.token_budget, b.num_tokens)
                back.pop(j)
                return

    def _allowed(self, s, b, req) -> bool:
        """vLLM's limit on resident sequences, its admission test, and ERA for a new long
        prompt."""
        if req.status is not RUNNING and len(s.running) >= self.max_num_seqs:
            return False
        if req.status is WAITING and self.admit_whole and not self._fits_whole(s, req):
            return False
        if not self.era or req.num_computed_tokens > 0 or not self.is_long(req, b.token_budget):
            return True
        if len(self.long_inflight) >= self.max_long_prompts:
            return False
        # long prompts started in this very step (SelectRequests records them only after the
        # window is done): without this, one window could start several at once
        reqs, budget = s.requests, b.token_budget
        started = {rid for rid in b.scheduled
                   if reqs[rid].num_computed_tokens == 0 and self.is_long(reqs[rid], budget)}
        return len(self.long_inflight | started) < self.max_long_prompts

    def _fits_whole(self, s, req) -> bool:
        """vLLM's admission test (can_allocate): a waiting request becomes resident only when
        the KV of its whole prompt (for a recompute, prompt and outputs so far) fits in the
        free blocks above the watermark, although its prefill then runs in chunks. Without
        it a long prompt started in the last free blocks stops half-way, and under
        recompute its chunks are thrown away when it or another request is preempted for
        KV. A prompt longer than the whole pool can only run in pieces, so it is exempt."""
        bm = s.block_manager
        need = bm.blocks_for_tokens(req.num_tokens) + self.watermark_blocks
        return need <= bm.num_free_device_blocks or need > bm.num_device_blocks

    def _victims(self, s, b, req) -> list:
        """Resident requests `req` may preempt, the next victim last.

        `victim_order="arrival"` (default): vLLM's KV-overflow rule, which AccelGen inherits
        (section 5, "we directly use vLLM to handle KVC overflow and preemptions"): victims
        are the resident requests that arrived after `req`, latest first, in the batch being
        formed or not. The order is fixed, so the oldest request always makes progress and a
        preempted long prompt keeps its rank: recompute cannot thrash between two requests.
        `victim_order="slack"`: the resident request outside the batch with the largest
        remaining time T_r goes first (Algorithm 1 read literally); T_r is recomputed on every
        re-entry, so two long requests can preempt each other in turn."""
        if self.victim_order == "arrival":
            t = req.arrival_time
            cands = [r for rid, r in s.running.items()
                     if r is not req and rid not in b.swapped_in
                     and (r.arrival_time, rid) > (t, req.request_id)]
            cands.sort(key=lambda r: (r.arrival_time, r.request_id))
            return cands                 # pop() yields the latest arrival
        due = self.sq.due
        cands = [r for rid, r in s.running.items()
                 if rid not in b.scheduled and r is not req and rid not in b.swapped_in]
        cands.sort(key=lambda r: due.get(r.request_id, 0.0))
        return cands                     # pop() yields the largest remaining time

    def _started(self, req, b) -> None:
        if req.num_computed_tokens < req.num_prompt_tokens and self.is_long(req, b.token_budget):
            self.long_inflight.add(req.request_id)

    def _select(self, s, b, now: float) -> list:
        """SelectRequests over successive gamma windows; returns the requests not taken."""
        back = []
        select = select_nearest if self.multires else select_in_order
        whole = not self.dynamic_chunking

        def allowed(req) -> bool:
            return self._allowed(s, b, req)

        for _ in range(self.max_windows):
            if b.tokens_left < 1 or b.num_seqs >= self.max_num_seqs:
                break
            full = self._admission_closed(s)
            first = self.sq.pop(full)
            if first is None:
                break
            reqs = s.requests
            limit = first[0] + self.gamma_s if self.slack_ordering else math.inf
            rids = self.sq.pop_through(limit, full, self.max_window - 1)
            window = [reqs[first[1]]] + [reqs[rid] for rid in rids]
            before = len(b.scheduled)       # selection only adds to the batch
            back += select(b, window, self.watermark_blocks, allowed, self.max_num_seqs, whole)
            for rid in islice(b.scheduled, before, None):
                self._started(reqs[rid], b)
        return back
