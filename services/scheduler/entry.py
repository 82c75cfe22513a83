"""`Entry`: a live (not yet finished) request as the scheduler service tracks it: the core
request, its token stream, and what was written to Redis about it."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.store.streams import RequestStream


@dataclass(eq=False)
class Entry:
    req: Request
    stream: RequestStream
    executor: str | None = None  # the loop holding it; None = pending placement
    pending_since: float | None = None
    written_status: RequestStatus = RequestStatus.WAITING
    first_sched_written: bool = False
    final: bool = False
    failures: int = 0  # executor failures it went through
    n_out: int = 0  # output tokens recorded (written to Redis)


Entries = dict[str, Entry]
