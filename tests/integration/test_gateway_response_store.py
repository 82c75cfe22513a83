"""The gateway's store of Responses: in a real (embedded) Redis and in memory, records come back
as stored, expire after the TTL and are deleted; an unreachable Redis is a 503."""

from __future__ import annotations

import asyncio

import pytest

from services.common.redis_runner import EmbeddedRedis, free_port
from services.gateway.errors import APIError
from services.gateway.responses_api.store import KEY_PREFIX, ResponseStore

RECORD = {"response": {"id": "resp_1", "output": [{"type": "message"}]}, "items": ["é"]}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("store-redis")) as redis:
        yield redis.url


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_put_get_expire_delete(backend, redis_url):
    store = ResponseStore(redis_url if backend == "redis" else None, ttl_s=0.3)
    assert store.shared == (backend == "redis")
    try:
        await store.put("resp_1", RECORD)
        await store.put("resp_2", RECORD)
        assert await store.get("resp_1") == RECORD
        assert await store.delete("resp_1") is True
        assert await store.get("resp_1") is None
        assert await store.delete("resp_1") is False
        await asyncio.sleep(0.6)  # past the TTL
        assert await store.get("resp_2") is None
    finally:
        await store.close()


async def test_records_carry_the_ttl_in_redis(redis_url):
    from services.common.redis_runner import async_client

    store = ResponseStore(redis_url, ttl_s=3600)
    client = async_client(redis_url)
    try:
        await store.put("resp_ttl", RECORD)
        ttl_ms = await client.pttl(KEY_PREFIX + "resp_ttl")
        assert 3_500_000 < ttl_ms <= 3_600_000
    finally:
        await client.aclose()
        await store.close()


async def test_an_unreachable_redis_is_a_503():
    store = ResponseStore(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60)
    try:
        with pytest.raises(APIError) as info:
            await store.get("resp_1")
        assert info.value.status == 503 and info.value.code == "store_unavailable"
    finally:
        await store.close()
