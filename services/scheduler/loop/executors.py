"""A core `Scheduler` for an executor as it describes itself (its KV pool, limits, profile)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.policies import make_policy
from services.scheduler.core.scheduler import Scheduler

if TYPE_CHECKING:
    from services.common.pb.executor_pb2 import ExecutorInfo

log = logging.getLogger(__name__)

# Used when an executor reports no profile: a small CPU model's rough per-iteration costs.
DEFAULT_COSTS = {"c0": 0.005, "c_prefill": 5e-5, "c_decode": 2e-4, "c_context": 1e-7}


def cost_model_for(info: ExecutorInfo) -> CostModel:
    if info.profile_json:
        try:
            profile = json.loads(info.profile_json)
            # the pool this executor has now, not the one it had when it was profiled
            pool = {
                "block_size": info.block_size,
                "num_device_blocks": info.num_device_blocks,
                "num_host_blocks": info.num_host_blocks,
            }
            profile.update({k: v for k, v in pool.items() if v})
            return CostModel.from_profile(profile)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("executor profile unusable, using defaults", extra={"error": str(exc)})
    return CostModel(
        **DEFAULT_COSTS, block_size=info.block_size, num_device_blocks=info.num_device_blocks
    )


def make_scheduler(
    policy: str, knobs: dict[str, Any], info: ExecutorInfo, prefix_caching: bool = False
) -> Scheduler:
    """With `prefix_caching`, full blocks are shared between requests whose tokens start
    alike; the cache is salted with what changes the KV of equal tokens (model, dtypes)."""
    bm = BlockManager(
        info.num_device_blocks,
        info.num_host_blocks,
        info.block_size,
        enable_prefix_caching=prefix_caching,
        cache_salt=f"{info.model}|{info.dtype}|{info.kv_dtype}",
    )
    return Scheduler(make_policy(policy, **knobs), bm, cost_model_for(info), info.max_model_len)
