"""AccelGen's iteration-level slack (section 4.3), kept incrementally in a heap.

A request's remaining time is T_r = SLO - T_w - T_e, with T_w the time since it entered the
queue (arrival, preemption, or return from its previous iteration) and T_e = N_ck * T_max the
execution still needed before its next token (N_ck = ceil(remaining prompt / L_c); 1 for a
decode). Since T_w grows at the same rate for everyone, T_r = due - now with a fixed
`due = t_enter + SLO - T_e`, so a heap on `due` orders the queue without re-sorting.

With the policy knob `slack_ordering=False` (AccelGen's "/Order" ablation) the heap key is the
request's arrival time instead, so the queue is FCFS (a preempted or returning request keeps
its place, as in vLLM); `due` then holds that key.

The SLO is the TTFT objective before the first token and the TBT objective after it.
JCT (deadline) requests get a per-iteration allowed wait instead:
    T_e,total = N_ck * T_max + S_g * (T_max + P_max * P)
    base = (SLO_JCT - T_e,total) / (N_ck + S_g)
and each iteration's over- or under-use of its allowed wait is carried to the next one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Protocol

from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.request import Request

RUNNING = RequestStatus.RUNNING
Entry = tuple[float, int, str]  # (due, version, request id)


class SlackKnobs(Protocol):
    @property
    def slack_ordering(self) -> bool: ...
    @property
    def default_tbt_s(self) -> float: ...
    @property
    def default_ttft_s(self) -> float: ...
    @property
    def preempt_max_s(self) -> float: ...
    @property
    def preempt_prob(self) -> float: ...


class SlackPolicy(Protocol):
    """What the queue reads of its policy (`AccelGenPolicy` is one): knobs, T_max, L_c and
    predicted lengths."""

    @property
    def knobs(self) -> SlackKnobs: ...

    def t_max(self) -> float: ...

    def avg_chunk(self) -> int: ...

    def predicted_len(self, req: Request) -> int: ...


class SlackQueue:
    def __init__(self, policy: SlackPolicy) -> None:
        self.p = policy
        self.by_arrival = not policy.knobs.slack_ordering
        # read on every slack computation: kept here rather than two lookups away
        self.default_tbt_s = policy.knobs.default_tbt_s
        self.default_ttft_s = policy.knobs.default_ttft_s
        self.heap: list[Entry] = []  # waiting and swapped requests
        self.resident: list[Entry] = []  # requests with KV on the device
        self.ver: dict[str, int] = {}
        self.due: dict[str, float] = {}
        self.enter: dict[str, float] = {}
        self.jct_base: dict[str, float] = {}
        self.carry: dict[str, float] = {}
        self._seq = itertools.count()

    # -- objectives -------------------------------------------------------------------------
    def slo(self, req: Request) -> float:
        """The per-iteration objective that applies to the request's next token."""
        if req.request_id in self.jct_base:
            return self.jct_base[req.request_id] + self.p.t_max()
        if req.output_token_ids:
            return req.slo.tbt_s or self.default_tbt_s
        return req.slo.ttft_s or self.default_ttft_s

    def _exec(self, req: Request) -> float:
        n = req.num_uncomputed_tokens
        chunks = 1 if n <= 1 else math.ceil(n / self.p.avg_chunk())
        return chunks * self.p.t_max()

    def _init_jct(self, req: Request) -> None:
        if req.slo.deadline_s is None:
            return
        t_max = self.p.t_max()
        n_ck = math.ceil(req.num_uncached_prompt_tokens / self.p.avg_chunk())
        s_g = self.p.predicted_len(req)
        k = self.p.knobs
        total = n_ck * t_max + s_g * (t_max + k.preempt_max_s * k.preempt_prob)
        self.jct_base[req.request_id] = (req.slo.deadline_s - total) / (n_ck + s_g)
        self.carry[req.request_id] = 0.0

    # -- queue ------------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        self._init_jct(req)
        self.enter[req.request_id] = now
        self.push(req)

    def push(self, req: Request, due: float | None = None) -> None:
        rid = req.request_id
        if due is None and self.by_arrival:
            due = req.arrival_time
        elif due is None:
            t = self.enter[rid]
            if rid in self.jct_base:
                due = t + self.jct_base[rid] + self.carry[rid]
            else:
                due = t + self.slo(req) - self._exec(req)
        seq = next(self._seq)
        self.ver[rid], self.due[rid] = seq, due
        heap = self.resident if req.status is RUNNING else self.heap
        heapq.heappush(heap, (due, seq, rid))

    def moved(self, req: Request) -> None:
        """Keep a queued request in the heap matching its residency."""
        rid = req.request_id
        if rid in self.ver:
            self.push(req, self.due[rid])

    def reenter(self, req: Request, now: float) -> None:
        """The request (re)joins the queue at `now`: returned from an iteration or preempted."""
        self.enter[req.request_id] = now
        self.push(req)

    def ran(self, req: Request, now: float) -> None:
        """Book the wait of a scheduled JCT request against its allowance (carry-over)."""
        rid = req.request_id
        if rid in self.jct_base:
            waited = now - self.enter[rid]
            self.carry[rid] = self.jct_base[rid] + self.carry[rid] - waited

    def _top(self, heap: list[Entry]) -> Entry | None:
        ver = self.ver
        while heap and ver.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, residents_only: bool = False) -> Entry | None:
        """(due, seq, rid) of the most urgent valid entry, or None."""
        top_r = self._top(self.resident)
        if residents_only:
            return top_r
        top_w = self._top(self.heap)
        if top_r is None or (top_w is not None and top_w < top_r):
            return top_w
        return top_r

    def peek_due(self, residents_only: bool = False) -> float | None:
        top = self.peek(residents_only)
        return None if top is None else top[0]

    def pop(self, residents_only: bool = False) -> tuple[float, str] | None:
        """(due, rid) of the most urgent valid entry (optionally resident ones only), or None."""
        top = self.peek(residents_only)
        if top is None:
            return None
        heapq.heappop(self.resident if self.resident and top is self.resident[0] else self.heap)
        del self.ver[top[2]]
        return top[0], top[2]

    def pop_through(self, limit: float, residents_only: bool, max_n: int) -> list[str]:
        """Pop, most urgent first, up to `max_n` valid entries whose due is <= `limit`."""
        out: list[str] = []
        while len(out) < max_n:
            top = self.peek(residents_only)
            if top is None or top[0] > limit:
                break
            heapq.heappop(self.resident if self.resident and top is self.resident[0] else self.heap)
            del self.ver[top[2]]
            out.append(top[2])
        return out

    def remove(self, rid: str) -> None:
        for table in (self.ver, self.due, self.enter, self.jct_base, self.carry):
            table.pop(rid, None)

    def __len__(self) -> int:
        return len(self.ver)
