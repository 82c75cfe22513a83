"""TRAIL-style limited preemption, a part `alise` and `hybrid` hold: a resident request past
`protect_fraction` of its predicted length, or holding more than `protect_kv_share` of the
device's KV, is not evicted in favour of another request (evicting it late wastes the most)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.core.policies.base import KnobError

if TYPE_CHECKING:
    from services.scheduler.core.block_manager import BlockManager
    from services.scheduler.core.request import Request


@dataclass(frozen=True)
class ProtectRule:
    protect_fraction: float | None = None  # share of the predicted length (None: off)
    protect_kv_share: float | None = None  # share of the device's KV blocks (None: off)

    def __post_init__(self) -> None:
        for name in ("protect_fraction", "protect_kv_share"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise KnobError(f"{name} must be in (0, 1] or None")


class Protection:
    """`protected(req)`: not to be evicted for another request."""

    def __init__(self, rule: ProtectRule, bm: BlockManager, pred: dict[str, int]) -> None:
        self.rule, self.bm = rule, bm
        self.pred = pred  # current predicted lengths (the ranking part's)
        self.kv_guard = 0  # protect_kv_share in blocks (0: off)
        if rule.protect_kv_share is not None:
            self.kv_guard = max(1, int(rule.protect_kv_share * bm.num_device_blocks))

    def protected(self, req: Request) -> bool:
        fraction = self.rule.protect_fraction
        if fraction is not None:
            pred = self.pred.get(req.request_id)
            if pred and req.num_output_tokens >= fraction * pred:
                return True
        if self.kv_guard:
            return self.bm.num_freeable_blocks(req.request_id) >= self.kv_guard
        return False
