"""The gateway's shard list and placement rule (services/gateway/shards.py)."""

import pytest

from services.common.settings import GatewaySettings
from services.gateway.shards import Load, SchedulerGroup, pick, shard_addresses


def test_shard_addresses_from_settings():
    plain = GatewaySettings(scheduler_address="a:1,b:1")
    assert shard_addresses(plain) == [["a:1", "b:1"]]
    sharded = GatewaySettings(scheduler_shards="s0a:1|s0b:1, s1a:1", scheduler_address="x:1")
    assert shard_addresses(sharded) == [["s0a:1", "s0b:1"], ["s1a:1"]]
    with pytest.raises(ValueError, match="empty shard"):
        shard_addresses(GatewaySettings(scheduler_shards=["a:1", "|"]))


def test_load_score_is_work_per_executor_plus_placements():
    assert Load(work_s=8.0, executors=2, requests=4).score() == 4.0
    # two placed since the report, each at the shard's mean work per request (2 s)
    assert Load(work_s=8.0, executors=2, requests=4, placed=2).score() == 6.0
    assert Load(placed=3).score() == 3.0  # nothing reported yet: 1 s per placement


async def test_pick_spreads_by_load_and_skips_shards_without_a_leader():
    groups = [SchedulerGroup(["127.0.0.1:1"], 0), SchedulerGroup(["127.0.0.1:2"], 1)]
    try:
        groups[0].load = Load(work_s=10.0, executors=1, requests=5)
        groups[1].load = Load(work_s=1.0, executors=1, requests=1)
        # shard 1 is lighter until the requests placed there outweigh shard 0's work
        chosen = [pick(groups).index for _ in range(12)]
        assert chosen[:9] == [1] * 9
        assert chosen.count(0) >= 1
        groups[1].load = Load(up=False)
        assert {pick(groups).index for _ in range(5)} == {0}
        groups[0].load = Load(up=False)
        assert pick(groups).index == 0  # none up: still somewhere (the call then fails)
    finally:
        for g in groups:
            await g.close()
