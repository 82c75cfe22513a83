"""`priority`: vLLM's priority scheduling (`--scheduling-policy priority`) on the `fcfs` steps.

Every queue is served by (`priority`, arrival time): a lower `priority` value is served
earlier, equal priorities first come, first served. When KV runs out, the running request
with the largest (priority, arrival) is preempted first. Other policies do not order by
priority, so the scheduler refuses a request with a non-zero `priority` under them, as vLLM
refuses it unless priority scheduling is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import register_policy
from services.scheduler.core.policies.common import Queue, by_priority
from services.scheduler.core.policies.fcfs import FcfsPolicy

if TYPE_CHECKING:
    from collections.abc import Iterator

    from services.scheduler.core.request import Request


@register_policy("priority")
class PriorityPolicy(FcfsPolicy):
    orders_by_priority = True

    def order(self, queue: Queue) -> list[Request] | None:
        return by_priority(queue)

    def victims(self, running: Queue) -> Iterator[Request]:
        return iter(list(reversed(by_priority(running))))
