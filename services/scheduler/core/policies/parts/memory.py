"""KV memory by ALISE Algorithm 2, a part `alise`, `fastserve` and `hybrid` hold: what an
evicted job loses (`memory_mode`) and, after each step is built, keeping at most M jobs on the
device while uploading swapped jobs that will run soon (`rebalance`).

Memory modes (ALISE section 3.2): 'swap' (EWT-ordered offload to host, the paper's design),
'recompute' (drop the KV of evicted jobs), 'defer' (never evict for a new job: a new arrival
waits while memory is full; a resident job that cannot grow evicts by recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from services.scheduler.core.policies.base import KnobError
from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.policies.base import PreemptionMode
    from services.scheduler.core.policies.parts.budget import StepLimits
    from services.scheduler.core.policies.parts.levels import Levels
    from services.scheduler.core.view import SchedulerView

RUNNING, SWAPPED = RequestStatus.RUNNING, RequestStatus.SWAPPED
MemoryMode = Literal["swap", "recompute", "defer"]
MEMORY_MODES = ("swap", "recompute", "defer")


@dataclass(frozen=True)
class MemoryRule:
    memory_mode: MemoryMode = "swap"
    prefetch_per_step: int = 4  # swapped jobs uploaded ahead of need per step

    def __post_init__(self) -> None:
        if self.memory_mode not in MEMORY_MODES:
            raise KnobError(f"memory_mode must be one of {MEMORY_MODES}, got {self.memory_mode!r}")

    @property
    def evict_mode(self) -> PreemptionMode:
        """How an evicted job loses its place on the device."""
        return "swap" if self.memory_mode == "swap" else "recompute"


def rebalance(
    b: Batch,
    sched: SchedulerView,
    levels: Levels,
    rule: MemoryRule,
    limits: StepLimits,
    reserve: int,
) -> None:
    """ALISE Algorithm 2 (swap mode): offload jobs ranked past the GPU job limit M, upload
    swapped jobs inside it while `reserve` free blocks remain."""
    m = limits.job_limit
    if rule.memory_mode != "swap" or not (sched.swapped or m):
        return
    if b.preempted and not m:
        return  # memory is short right now: no prefetch
    bm, limit = sched.block_manager, m or limits.seqs
    uploads = rule.prefetch_per_step
    for rank, req in enumerate(levels.in_order()):
        if rank >= limit:
            if m is None:
                break
            if req.status is RUNNING and req.request_id not in b.scheduled:
                b.offload(req)
        elif req.status is SWAPPED and uploads > 0:
            blocks = bm.num_host_blocks_of(req.request_id)
            if blocks + reserve <= bm.num_free_device_blocks:
                uploads -= b.swap_in(req)
