"""First come, first served, vLLM's way (fcfs, priority, sarathi): whole-prompt admission with
head-of-line blocking, preemption of the last in order, swapped requests back in order; the
queue `Order` a policy holds (arrival, or vLLM's priority order)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.policies.base import PreemptionMode
    from services.scheduler.core.view import SchedulerView

RUNNING, SWAPPED = RequestStatus.RUNNING, RequestStatus.SWAPPED
Queue = OrderedDict[str, Request]


def schedule_or_preempt(
    b: Batch, req: Request, n: int, victims: Iterator[Request], mode: PreemptionMode
) -> bool:
    """Give `req` n tokens; while its KV does not fit, preempt the next victim from the
    iterator `victims` (lowest priority first; meeting `req` itself means nothing of lower
    priority is left). Returns False when `req` had to yield (preempted if resident)."""
    while not b.schedule(req, n):
        victim = next(victims, None)
        while (
            victim is not None
            and victim is not req
            and (victim.status is not RUNNING or victim.request_id in b.swapped_in)
        ):
            victim = next(victims, None)
        if victim is None or victim is req:
            if req.status is RUNNING:
                b.preempt(req, mode)
            return False
        b.preempt(victim, mode)
    return True


def by_priority(queue: Queue) -> list[Request]:
    """vLLM's priority order: lower `priority` first, then earlier arrival."""
    return sorted(queue.values(), key=lambda r: (r.priority, r.arrival_time))


def newest_first(running: Queue) -> Iterator[Request]:
    """Running requests, most recently admitted first (vLLM's preemption order)."""
    return iter(list(reversed(running.values())))


def admit_fcfs(
    b: Batch,
    sched: SchedulerView,
    max_seqs: int,
    reserve_blocks: int,
    order: list[Request] | None = None,
) -> int:
    """Admit waiting requests in `order` (default: arrival order) with their whole prompt
    while they fit (head-of-line blocking: stop at the first that does not)."""
    admitted = 0
    for req in list(sched.waiting.values()) if order is None else order:
        if len(sched.running) >= max_seqs or b.num_seqs >= max_seqs:
            break
        n = req.num_uncomputed_tokens
        if n < 1 or n > b.tokens_left:
            break
        if not b.schedule(req, n, reserve_blocks):
            break
        admitted += 1
    return admitted


def in_arrival_order(queue: Queue) -> list[Request] | None:
    return None  # as the queue holds it


def last_by_priority(running: Queue) -> Iterator[Request]:
    return iter(list(reversed(by_priority(running))))


@dataclass(frozen=True)
class Order:
    """The order queues are served in (`serve`: None keeps the queue's own, arrival, order)
    and running requests yield their KV in (`victims`)."""

    serve: Callable[[Queue], list[Request] | None]
    victims: Callable[[Queue], Iterator[Request]]
    by_priority: bool = False  # orders by `Request.priority`


ARRIVAL = Order(in_arrival_order, newest_first)
PRIORITY = Order(by_priority, last_by_priority, by_priority=True)


def decode_in_order(
    b: Batch, sched: SchedulerView, seqs: int, order: Order, mode: PreemptionMode
) -> None:
    """Every running request's next tokens, in `order`, preempting by `order.victims` when
    KV runs out."""
    running = sched.running
    victims = order.victims(running)
    for req in order.serve(running) or list(running.values()):
        if req.status is not RUNNING or req.request_id in b.scheduled:
            continue
        if b.num_seqs >= seqs or b.tokens_left < 1:
            break
        n = min(req.num_uncomputed_tokens, b.tokens_left)
        schedule_or_preempt(b, req, n, victims, mode)


def swap_back(b: Batch, sched: SchedulerView, seqs: int, order: Order) -> None:
    """Swapped requests back onto the device in `order` while they fit (one decode each)."""
    for req in order.serve(sched.swapped) or list(sched.swapped.values()):
        if len(sched.running) >= seqs or b.tokens_left < 1:
            break
        bm = sched.block_manager
        need = max(bm.num_host_blocks_of(req.request_id) + 1, bm.num_swap_in_blocks(req, 1))
        if need > bm.num_free_device_blocks:
            break
        if b.swap_in(req):
            b.schedule(req, min(req.num_uncomputed_tokens, b.tokens_left))
        elif req.status is SWAPPED:
            break  # (a request whose shared blocks were evicted is recomputed instead)
