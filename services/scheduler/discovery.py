"""`Discovery`: keep one executor loop per executor that is configured or registered.

The wanted set is `ALISE_EXECUTORS` (static) plus every live entry of the executor registry in
Redis (services/common/executor_registry.py), read every `interval_s`. A new address gets a
loop (its first Step frees whatever it may hold, as on a restart); an address that left the
registry (stopped cleanly, or its registration lapsed) loses its loop and its requests are
recomputed on the others, as when an executor fails. While Redis cannot be read, nothing is
removed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.common.executor_registry import live_executors

log = logging.getLogger(__name__)


class Discovery:
    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str,
        static: Collection[str],
        current: Callable[[], Collection[str]],
        add: Callable[[str], None],
        remove: Callable[[str], Awaitable[None]],
        interval_s: float = 1.0,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.static = set(static)
        self.current = current
        self.add = add
        self.remove = remove
        self.interval_s = interval_s

    async def sync(self) -> None:
        """One pass: add loops for new executors, remove those of departed ones."""
        try:
            registered = await live_executors(self.client, self.namespace)
        except (RedisError, OSError) as exc:
            log.debug("executor registry unreadable", extra={"error": str(exc)})
            return
        wanted = self.static | set(registered)
        have = set(self.current())
        for address in sorted(wanted - have):
            log.info("executor joined", extra={"executor": address})
            self.add(address)
        for address in sorted(have - wanted):
            log.warning("executor left the registry", extra={"executor": address})
            await self.remove(address)

    async def run(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.interval_s)
