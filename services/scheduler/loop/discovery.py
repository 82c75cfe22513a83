"""`Discovery`: keep one executor loop per executor that is configured or registered.

The wanted set is `ALISE_EXECUTORS` (static) plus every live entry of the executor registry in
Redis (services/common/executor_registry.py), read every `interval_s`. A new address gets a
loop (its first Step frees whatever it may hold, as on a restart); an address that left the
registry (stopped cleanly, or its registration lapsed) loses its loop and its requests are
recomputed on the others, as when an executor fails. While Redis cannot be read, nothing is
removed.

With several scheduler shards (`num_shards` > 1), each shard keeps loops only for the
registered executors the shard assignment in Redis gives it (services/scheduler/leadership/shards.py);
each loop is told the assignment's generation, which fences its Steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.executor_registry import live_executors
from services.scheduler.leadership.shards import assign

log = logging.getLogger(__name__)


class Discovery:
    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str,
        static: Collection[str],
        current: Callable[[], Collection[str]],
        add: Callable[[str, int], None],
        remove: Callable[[str], Awaitable[None]],
        interval_s: float = 1.0,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.static = set(static)
        self.current = current
        self.add = add
        self.remove = remove
        self.interval_s = interval_s
        self.shard = shard
        self.num_shards = num_shards

    async def sync(self) -> None:
        """One pass: add loops for new executors, remove those of departed ones."""
        try:
            registered = await self._registered()
        except (RedisError, OSError) as exc:
            log.debug("executor registry unreadable", extra={"error": str(exc)})
            return
        wanted = dict.fromkeys(self.static, 0) | registered
        have = set(self.current())
        for address in sorted(wanted.keys() - have):
            log.info("executor joined", extra={"executor": address, "shard": self.shard})
            self.add(address, wanted[address])
        for address in sorted(have - wanted.keys()):
            log.warning("executor left the registry", extra={"executor": address})
            await self.remove(address)

    async def _registered(self) -> dict[str, int]:
        """Registered executors this shard serves: address -> assignment generation."""
        live = await live_executors(self.client, self.namespace)
        if self.num_shards == 1:
            return dict.fromkeys(live, 0)
        owners = await assign(self.client, self.namespace, live, self.num_shards)
        return {a: gen for a, (shard, gen) in owners.items() if shard == self.shard}

    async def run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.interval_s)
