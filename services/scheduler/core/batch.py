"""`Batch`: the one step a policy is building. Every state change a policy makes goes through it,
so the block manager, the scheduler's queues and the emitted SchedulerOutput stay consistent.

Rules it enforces (they follow from the executor's order swap_out, swap_in, free, forward):
  * a request preempted in this step is not scheduled again in this step;
  * a request swapped in during this step is not preempted in this step;
  * a request is scheduled at most once per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.common.step import NewRequestData, SchedulerOutput
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.shape import StepShape

if TYPE_CHECKING:
    from collections.abc import Iterable

    from services.scheduler.core.block_manager import BlockManager

RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED
UNLIMITED = 1 << 62


class BatchHost(Protocol):
    """What a Batch changes of the scheduler it builds a step for (`Scheduler` is one): its
    queues, only through `move`, and what the executor holds, through `mark_sent` / `forget`."""

    @property
    def block_manager(self) -> BlockManager: ...

    @property
    def requests(self) -> dict[str, Request]: ...

    def move(self, req: Request, status: RequestStatus) -> None: ...

    def mark_sent(self, request_ids: Iterable[str]) -> set[str]: ...

    def forget(self, request_id: str) -> bool: ...


class Batch:
    def __init__(self, sched: BatchHost, now: float, token_budget: int | None = None) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.now = now
        self.token_budget = token_budget
        self.num_tokens = 0
        self.scheduled: dict[str, int] = {}
        self.block_tables: dict[str, tuple[list[int], bool]] = {}
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in_map: list[tuple[int, int]] = []
        self.freed: list[str] = []
        self.preempted: list[str] = []
        self.touched: set[str] = set()  # preempted this step
        self.swapped_in: set[str] = set()
        self.shape: StepShape | None = None  # set by finish(), with the output it returned
        self.output: SchedulerOutput | None = None

    # -- KV blocks (what a policy may ask before it schedules) -------------------------------
    @property
    def free_blocks(self) -> int:
        return self.bm.num_free_device_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        """Device blocks `req` needs for its next `num_tokens`: its swap-in if it is swapped
        out, else its new blocks (with prefix caching, only the uncached ones)."""
        if req.status is SWAPPED:
            return self.bm.num_swap_in_blocks(req, num_tokens)
        return self.bm.num_new_blocks(req, num_tokens)

    def freeable_blocks(self, request_id: str) -> int:
        """Device blocks evicting `request_id` would free (those it holds alone)."""
        return self.bm.num_freeable_blocks(request_id)

    # -- budget -----------------------------------------------------------------------------
    @property
    def tokens_left(self) -> int:
        return UNLIMITED if self.token_budget is None else self.token_budget - self.num_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    def set_budget(self, tokens: int) -> None:
        """Size the step (once its decodes are in): `tokens`, never below what it holds."""
        self.token_budget = max(self.num_tokens, tokens)

    def close(self) -> None:
        """Nothing more joins this step: its budget is what it holds."""
        self.token_budget = self.num_tokens

    def cover(self) -> None:
        """A whole prompt past the budget raises it to what the step holds, so the output
        reports the budget it was really packed against (and nothing else joins)."""
        if self.token_budget is not None and self.num_tokens > self.token_budget:
            self.token_budget = self.num_tokens

    def charge(self, tokens: int, keep: int) -> None:
        """Lower the budget by `tokens` of work beyond the scheduled tokens (a chunk's context
        reads and attention), keeping room for the `keep` tokens just granted."""
        if self.token_budget is not None:
            self.token_budget = max(self.num_tokens + keep, self.token_budget - tokens)

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self, req: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        """Grant `num_new_tokens` to a resident or waiting request (admitting it); False when
        its KV does not fit (nothing changes then)."""
        rid = req.request_id
        if rid in self.scheduled:
            raise ValueError(f"request {rid} scheduled twice in one step")
        if rid in self.touched or num_new_tokens < 1:
            return False
        if req.num_pending_tokens and req.ends_with_pending:
            return True  # the step in flight finishes it: nothing more to compute
        if num_new_tokens > req.num_uncomputed_tokens:
            raise ValueError(
                f"request {rid}: {num_new_tokens} tokens granted, "
                f"{req.num_uncomputed_tokens} uncomputed"
            )
        status = req.status
        if status is SWAPPED:
            raise ValueError(f"request {rid} is swapped out; swap_in() it first")
        if status is WAITING and self.bm.cache is not None:
            num_new_tokens = self._refresh_cached(req, num_new_tokens)
        new = self.bm.allocate(req, num_new_tokens, reserve_blocks)
        if new is None:
            return False
        if status is WAITING:
            self.sched.move(req, RUNNING)
        if new:
            entry = self.block_tables.get(rid)
            if entry is None:
                self.block_tables[rid] = (list(new), False)
            else:
                entry[0].extend(new)
        self.scheduled[rid] = num_new_tokens
        self.num_tokens += num_new_tokens
        return True

    def _refresh_cached(self, req: Request, n: int) -> int:
        """Prefix caching: the cache may have changed since `req` was queued (blocks evicted,
        or a request sharing its prefix computed more), so its cached prefix is looked up
        again before it is attached. A grant of the whole uncached rest stays whole (within
        the leftover budget when the rest grew); a partial grant shrinks to what is left."""
        cached = self.bm.cached_prefix_len(req)
        if cached == req.num_computed_tokens:
            return n
        whole = n == req.num_uncomputed_tokens
        req.num_computed_tokens = req.num_cached_tokens = cached
        left = req.num_uncomputed_tokens
        if whole:
            return min(left, max(n, self.tokens_left))
        return min(n, left)

    def swap_in(self, req: Request, reserve_blocks: int = 0) -> bool:
        """Bring a swapped request's KV back (False when it does not fit). With prefix
        caching, a request whose shared blocks were evicted while it was swapped out cannot
        come back: it is preempted by recompute instead (re-attaching what is still cached)."""
        rid = req.request_id
        if rid in self.touched:
            return False
        if self.bm.swap_in_lost(rid):
            self._recompute(req)
            return False
        mapping = self.bm.swap_in(rid, reserve_blocks)
        if mapping is None:
            return False
        self.swap_in_map.extend(mapping)
        self.block_tables[rid] = (self.bm.block_table(rid), True)
        self.swapped_in.add(rid)
        self.sched.move(req, RUNNING)
        return True

    # -- preemption -------------------------------------------------------------------------
    def preempt(self, req: Request, mode: str = "recompute") -> bool:
        """Take a resident request off the device: 'swap' copies its KV to host blocks
        (falling back to recompute when the host pool is full), 'recompute' drops it."""
        rid = req.request_id
        if req.status is not RUNNING or rid in self.swapped_in:
            return False
        self._unschedule(rid)
        if mode == "swap" and req.num_computed_tokens > 0:
            mapping = self.bm.swap_out(rid, req.num_computed_tokens)
            if mapping is not None:
                self.swap_out.extend(mapping)
                self.sched.move(req, SWAPPED)
                return self._mark(req)
        elif mode not in ("swap", "recompute"):
            raise ValueError(f"preemption mode must be 'swap' or 'recompute', got {mode!r}")
        return self._recompute(req)

    def _recompute(self, req: Request) -> bool:
        rid = req.request_id
        self.bm.free(rid)
        # with prefix caching its full blocks stay cached: a later admission re-attaches
        # whatever of them is still there
        req.num_computed_tokens = req.num_cached_tokens = self.bm.cached_prefix_len(req)
        if self.sched.forget(rid):
            self.freed.append(rid)
        self.sched.move(req, WAITING)
        return self._mark(req)

    def offload(self, req: Request) -> bool:
        """Swap a resident request's KV to host only (no recompute fallback)."""
        rid = req.request_id
        if req.status is not RUNNING or rid in self.swapped_in or req.num_computed_tokens == 0:
            return False
        if self.bm.num_free_host_blocks < self.bm.num_swap_out_blocks(rid, req.num_computed_tokens):
            return False
        return self.preempt(req, "swap")

    def _mark(self, req: Request) -> bool:
        req.num_preemptions += 1
        self.preempted.append(req.request_id)
        self.touched.add(req.request_id)
        return True

    def _unschedule(self, rid: str) -> None:
        n = self.scheduled.pop(rid, None)
        if n is not None:
            self.num_tokens -= n
            self.block_tables.pop(rid, None)

    # -- result -----------------------------------------------------------------------------
    def finish(self) -> SchedulerOutput:
        """The step as sent (and `self.shape`, what the core keeps of it)."""
        sched = self.sched
        reqs = sched.requests
        new_requests: list[NewRequestData] = []
        decodes: list[str] = []
        context, now = 0, self.now
        fresh = sched.mark_sent(self.scheduled.keys())
        for rid, n in self.scheduled.items():
            req = reqs[rid]
            if rid in fresh:  # its computed tokens are the cached prefix it was attached
                if req.num_pending_tokens:  # preempted while a step samples for it
                    raise RuntimeError(f"request {rid} resent with a token still pending")
                new_requests.append(
                    NewRequestData(
                        rid,
                        req.all_token_ids,
                        req.sampling,
                        len(req.output_token_ids),
                        req.num_computed_tokens,
                        req.max_tokens,
                    )
                )
            if req.num_uncomputed_tokens == 1:
                decodes.append(rid)
            context += req.num_computed_tokens + n
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        self.shape = StepShape(
            sum(self.scheduled.values()), decodes, self.preempted, context, self.token_budget
        )
        self.output = SchedulerOutput(
            new_requests=new_requests,
            block_tables=self.block_tables,
            num_scheduled_tokens=self.scheduled,
            swap_out=self.swap_out,
            swap_in=self.swap_in_map,
            free_request_ids=self.freed,
        )
        return self.output
