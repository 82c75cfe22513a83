"""`Admission`: backpressure on the requests not yet scheduled (the backlog), the requests
waiting for an executor (pending), and their placement on the executors that are up.

Placement is the core's rule (`core/placement.py`) through the `Placer`'s cached outstanding
work; a request no executor takes within the grace period is failed by the service's sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc

from services.common.grpc_server import ServiceError
from services.scheduler.loop.placer import Placer

if TYPE_CHECKING:
    from services.common.pb.executor_pb2 import ExecutorInfo
    from services.common.settings import SchedulerSettings
    from services.scheduler.core.request import Request
    from services.scheduler.core.scheduler import Scheduler
    from services.scheduler.entry import Entry
    from services.scheduler.metrics import SchedulerMetrics

# the executors that can take work now: address -> (its core scheduler, its info)
UpExecutors = Callable[[], Mapping[str, tuple["Scheduler", "ExecutorInfo"]]]


def fit_to_executor(req: Request, info: ExecutorInfo) -> None:
    """Limits learned from the executor, for requests admitted before any executor answered."""
    if req.max_model_len is None or req.max_model_len > info.max_model_len:
        req.max_model_len = info.max_model_len
    if not req.eos_token_ids:
        req.eos_token_ids = tuple(info.eos_token_ids)


class Admission:
    def __init__(
        self,
        settings: SchedulerSettings,
        metrics: SchedulerMetrics,
        up_executors: UpExecutors,
        on_placed: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.up_executors = up_executors
        self.on_placed = on_placed  # wakes the loop of the executor chosen
        self.placer = Placer(cache_aware=settings.cache_aware_placement)
        self.pending: dict[str, Entry] = {}  # waiting for an executor
        self.backlog: dict[str, int] = {}  # admitted, never scheduled: rid -> prompt tokens
        self.backlog_tokens = 0

    # -- backpressure ------------------------------------------------------------------------
    def check_backpressure(self, prompt_tokens: int) -> None:
        """RESOURCE_EXHAUSTED when one more request of `prompt_tokens` exceeds a limit."""
        s = self.settings
        if len(self.backlog) + 1 > s.max_waiting_requests:
            self.metrics.rejected.labels("waiting_requests").inc()
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.backlog)} requests waiting (max {s.max_waiting_requests}); retry later",
            )
        if self.backlog_tokens + prompt_tokens > s.max_waiting_tokens:
            self.metrics.rejected.labels("waiting_tokens").inc()
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.backlog_tokens} prompt tokens waiting (max "
                f"{s.max_waiting_tokens}); retry later",
            )

    def backlog_add(self, rid: str, tokens: int) -> None:
        if rid not in self.backlog:
            self.backlog[rid] = tokens
            self.backlog_tokens += tokens

    def backlog_pop(self, rid: str) -> None:
        self.backlog_tokens -= self.backlog.pop(rid, 0)

    def forget(self, rid: str) -> None:
        """The request finished: it waits for nothing any more."""
        self.pending.pop(rid, None)
        self.backlog_pop(rid)

    # -- placement ---------------------------------------------------------------------------
    def place(self, entry: Entry, now: float) -> bool:
        """Admit `entry` to the up executor with least predicted outstanding work that can
        hold it; otherwise leave it pending."""
        up = self.up_executors()
        addr = self.placer.choose({a: sched for a, (sched, _) in up.items()}, entry.req, now)
        if addr is None:
            self.to_pending(entry, now)
            return False
        sched, info = up[addr]
        fit_to_executor(entry.req, info)
        self.pending.pop(entry.req.request_id, None)
        entry.executor, entry.pending_since = addr, None
        sched.admit(entry.req)  # also a re-admitted request, with its output
        self.placer.placed(addr, sched, entry.req)
        self.on_placed(addr)
        return True

    def to_pending(self, entry: Entry, now: float) -> None:
        entry.executor = None
        if entry.pending_since is None:
            entry.pending_since = now
        self.pending[entry.req.request_id] = entry

    def place_pending(self, now: float) -> None:
        for entry in sorted(self.pending.values(), key=lambda e: e.req.arrival_time):
            if not entry.final:
                self.place(entry, now)

    def expired(self, now: float) -> list[Entry]:
        """Pending requests that no executor took within `executor_grace_s`."""
        grace = self.settings.executor_grace_s
        return [
            e
            for e in self.pending.values()
            if not e.final and e.pending_since is not None and now - e.pending_since > grace
        ]
