"""`Leadership`: run a `SchedulerService` while this process holds the leader lease.

A leader renews the lease every `lease_renew_s`; it steps down when a renewal finds another
holder or Redis refuses a commit of its epoch (`Fenced`). Stepping down stops its executor
loops and ends every open stream with UNAVAILABLE, so gateways re-attach to the new leader,
which has rebuilt every unfinished request from Redis. While Redis cannot be reached the leader
goes on leading (it cannot learn otherwise, and a standby cannot take over either); fencing
keeps a leader cut off from Redis from writing once a standby has taken over. A standby tries
to acquire the lease every `lease_renew_s / 2`. See lease.py for the lease itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from services.common.redis_runner import async_client
from services.common.settings import SchedulerSettings
from services.common.tasks import cancel_and_wait
from services.scheduler.leadership.lease import Lease, LeaseTiming
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import SchedulerService

log = logging.getLogger(__name__)

LEASE_REDIS_TIMEOUT_S = 2.0  # well under the lease TTL


def holder_address(port: int) -> str:
    """This process's identity in the lease: unique while it runs (the port is exclusive)."""
    return f"{socket.gethostname()}:{port}"


class Leadership:
    def __init__(
        self,
        settings: SchedulerSettings,
        metrics: SchedulerMetrics,
        address: str,
        on_change: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.client = async_client(settings.redis_url, LEASE_REDIS_TIMEOUT_S)
        timing = LeaseTiming(settings.lease_ttl_s, settings.lease_renew_s)
        self.lease = Lease(self.client, settings.state_namespace, address, timing)
        self.service: SchedulerService | None = None
        self.terms = 0  # times this process became leader
        self.redis_ok = True  # the last lease call reached Redis
        self._on_change = on_change
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def timing(self) -> LeaseTiming:
        return self.lease.timing

    async def start(self) -> None:
        """Lead at once when the lease is free; stand by (in the background) otherwise."""
        if await self._acquire():
            await self._lead()
        self._task = asyncio.create_task(self._run(), name="scheduler-leadership")

    async def stop(self) -> None:
        """Stop leading (clean shutdown: the lease is released for a standby)."""
        await cancel_and_wait(self._task)
        self._task = None
        service, self.service = self.service, None
        if service is not None:
            await service.stop()
            try:
                await self.lease.release()
            except (RedisError, OSError) as exc:
                log.warning("could not release the leader lease", extra={"error": str(exc)})
        await self.client.aclose()

    async def _run(self) -> None:
        while True:
            if self.service is None:
                await asyncio.sleep(self.timing.renew_s / 2)
                if await self._acquire():
                    await self._lead()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self.timing.renew_s)
            if self._lost.is_set() or not await self._renew():
                await self._step_down()

    async def _acquire(self) -> bool:
        try:
            acquired = await self.lease.try_acquire()
        except (RedisError, OSError) as exc:
            self.redis_ok = False
            log.debug("leader lease: redis unreachable", extra={"error": str(exc)})
            return False
        self.redis_ok = True
        return acquired

    async def _renew(self) -> bool:
        """False only when another holder has the lease; an unreachable Redis keeps us."""
        try:
            renewed = await self.lease.renew()
        except (RedisError, OSError) as exc:
            self.redis_ok = False
            log.warning("leader lease not renewed: redis unreachable", extra={"error": str(exc)})
            return True
        self.redis_ok = True
        return renewed

    def readiness(self) -> tuple[bool, bool]:
        """(reaches Redis, some executor is up), as this process sees them now: Redis through
        the last lease call and the store writer's last commit."""
        service = self.service
        if service is None:
            return self.redis_ok, False
        redis_ok = self.redis_ok and service.writer.healthy
        return redis_ok, any(loop.up for loop in service.loops.values())

    async def _lead(self) -> None:
        service = SchedulerService(self.settings, self.metrics)
        service.store.epoch = self.lease.epoch
        service.writer.on_fenced = self._lost.set
        self._lost.clear()
        try:
            await service.start()
        except (RedisError, OSError) as exc:
            log.error("could not start leading: redis failed", extra={"error": str(exc)})
            await service.stop()
            return
        self.service = service
        self.terms += 1
        log.info("leading", extra={"epoch": self.lease.epoch, "holder": self.lease.holder})
        await self._on_change(True)

    async def _step_down(self) -> None:
        service, self.service = self.service, None
        log.warning("no longer the leader: standing by", extra={"holder": self.lease.holder})
        await self._on_change(False)
        if service is not None:
            await service.abandon()
        self.lease.epoch = 0
        self._lost.clear()
