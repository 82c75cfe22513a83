"""Executors that join and leave at run time: a registry of live executors in Redis.

    {ns}:executors   zset   member = the address schedulers reach an executor at,
                            score = when its registration lapses (unix ms)

An executor started with `ALISE_REGISTRY_URL` adds itself and renews its entry every
`interval_s` (`Registration`); a clean stop removes it, a crashed or hung executor's entry
lapses after `ttl_s`. Schedulers read the live members (`live_executors`) and add or drop
executor loops to match (services/scheduler/loop/discovery.py), so scaling executors needs no
scheduler restart. A static `ALISE_EXECUTORS` list works beside it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.redis_runner import async_client
from services.common.tasks import cancel_and_wait

log = logging.getLogger(__name__)

REGISTRY_REDIS_TIMEOUT_S = 2.0  # under the registration's lapse time


def registry_key(namespace: str) -> str:
    return f"{namespace}:executors"


async def live_executors(client: aioredis.Redis, namespace: str) -> list[str]:
    """Addresses whose registration has not lapsed, sorted (lapsed ones are removed)."""
    key = registry_key(namespace)
    now_ms = int(time.time() * 1000)
    async with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, "-inf", now_ms)
        pipe.zrangebyscore(key, now_ms, "+inf")
        _, members = await pipe.execute()
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)


class Registration:
    """Keep `address` registered while this executor serves."""

    def __init__(
        self, url: str, namespace: str, address: str, ttl_s: float = 3.0, interval_s: float = 1.0
    ) -> None:
        self.client = async_client(url, REGISTRY_REDIS_TIMEOUT_S)
        self.key = registry_key(namespace)
        self.address = address
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._renew()
        self._task = asyncio.create_task(self._run(), name="executor-registration")

    async def stop(self) -> None:
        """Leave the registry at once (schedulers drop this executor within a poll)."""
        await cancel_and_wait(self._task)
        self._task = None
        try:
            await self.client.zrem(self.key, self.address)
        except (RedisError, OSError) as exc:
            log.warning("could not deregister the executor", extra={"error": str(exc)})
        await self.client.aclose()

    async def _renew(self) -> None:
        expires_ms = int((time.time() + self.ttl_s) * 1000)
        await self.client.zadd(self.key, {self.address: expires_ms})

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._renew()
            except (RedisError, OSError) as exc:
                log.warning("executor registration not renewed", extra={"error": str(exc)})
