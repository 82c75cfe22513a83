"""The leader lease and epoch fencing, on a real Redis: one holder at a time, takeover after the
TTL, a deposed leader's iteration commit and request creation refused by the Lua scripts."""

import asyncio

import pytest
import redis.asyncio as aioredis

from services.scheduler.leadership.lease import Lease, LeaseTiming
from services.scheduler.store.iteration_write import IterationWrite
from services.scheduler.store.redis_store import Fenced, Store

FAST = LeaseTiming(ttl_s=0.3, renew_s=0.1)


def write_for(rid: str, token: int) -> IterationWrite:
    w = IterationWrite()
    w.set(rid, n_out=1)
    w.add_token(rid, 0, token, -0.5, 1.0)
    return w


async def test_one_holder_then_takeover_then_fencing(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    a = Lease(client, "t", "host-a:1", FAST)
    b = Lease(client, "t", "host-b:1", FAST)
    store = Store(redis_server.url, "t")
    try:
        assert await a.try_acquire()
        assert not await b.try_acquire()  # held by a
        assert await a.renew()
        first = a.epoch
        store.epoch = first
        await store.commit([write_for("r1", 7)])  # the leader writes
        await asyncio.sleep(FAST.ttl_s + 0.1)  # a stops renewing: its lease lapses
        assert await b.try_acquire()
        assert b.epoch == first + 1
        assert not await a.renew()  # a learns it was deposed
        assert a.epoch == 0
        with pytest.raises(Fenced):  # a's late commit is refused, and wrote nothing
            await store.commit([write_for("r1", 9)])
        assert (await store.load("r1"))[1][0][0] == 7
        with pytest.raises(Fenced):
            await store.create("r2", {"status": "waiting"}, 1.0)
        assert await store.load("r2") is None
        store.epoch = b.epoch  # the new leader's writes go through
        await store.commit([write_for("r1", 11)])
        assert (await store.load("r1"))[1][0][0] == 11
    finally:
        await store.close()
        await client.aclose()


async def test_lapsed_lease_nobody_took_is_reclaimed_with_the_same_epoch(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        a = Lease(client, "t", "host-a:1", FAST)
        assert await a.try_acquire()
        epoch = a.epoch
        await asyncio.sleep(FAST.ttl_s + 0.1)  # e.g. Redis was unreachable for a while
        assert await a.renew()
        assert a.epoch == epoch  # queued writes of this term stay valid
    finally:
        await client.aclose()


async def test_a_restart_on_the_same_address_takes_over_at_once(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        old = Lease(client, "t", "host-a:1", LeaseTiming(ttl_s=60, renew_s=20))
        assert await old.try_acquire()
        other = Lease(client, "t", "host-b:1", LeaseTiming(ttl_s=60, renew_s=20))
        assert not await other.try_acquire()  # another address waits for the TTL
        new = Lease(client, "t", "host-a:1", LeaseTiming(ttl_s=60, renew_s=20))
        assert await new.try_acquire()  # same address: the old process is gone
        assert new.epoch == old.epoch + 1
        assert not await old.renew()
        await new.release()
        assert await other.try_acquire()  # a released lease is free at once
    finally:
        await client.aclose()
