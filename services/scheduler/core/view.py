"""What a policy sees of the Scheduler it is bound to (`SchedulerView`; `Scheduler` is one) and
what `Policy.update` receives after a step (`AppliedStep`). Policies type against these, so the
core's imports all point down: scheduler -> policies -> view -> batch."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.common.step import RequestUpdate, SchedulerOutput, StepOutcome
from services.scheduler.core.batch import BatchHost
from services.scheduler.core.shape import StepShape

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.request import Request


@dataclass
class AppliedStep:
    """What `Policy.update` receives after a step's result was applied."""

    output: SchedulerOutput
    shape: StepShape  # what the core knew of the step besides what it sent
    outcome: StepOutcome
    updates: list[RequestUpdate]


class SchedulerView(BatchHost, Protocol):
    """The scheduler's queues, its cost model and KV, and a new `Batch` for the next step."""

    @property
    def cost_model(self) -> CostModel: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def waiting(self) -> OrderedDict[str, Request]: ...

    @property
    def running(self) -> OrderedDict[str, Request]: ...

    @property
    def swapped(self) -> OrderedDict[str, Request]: ...

    def new_batch(self, now: float, token_budget: int | None = None) -> Batch: ...
