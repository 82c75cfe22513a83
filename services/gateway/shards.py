"""Scheduler shards as the gateway sees them, and where a new request goes.

A `SchedulerGroup` is one shard: a leader and its standbys, tried in order; the gateway keeps
the index of the one it believes leads and moves to the next on UNAVAILABLE (`failover`).
Without `scheduler_shards` there is one group, `scheduler_address`.

`pick` places a request on the shard with the least predicted outstanding work per executor
up, as the shards last reported in Stats (a shard whose last Stats found no leader is skipped) (refreshed in the background every `REFRESH_S`),
plus the requests this gateway placed there since (each counted at the shard's mean work per
request), so a burst between two refreshes spreads instead of landing on one shard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from services.common.grpc_client import (
    SCHEDULER_EXECUTORS,
    SCHEDULER_REDIS,
    SCHEDULER_SERVICE,
    aio_channel,
    check_health,
)
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.events import EventMux

if TYPE_CHECKING:
    from services.common.settings import GatewaySettings

log = logging.getLogger(__name__)

REFRESH_S = 0.25  # how old a shard's reported load may be before it is asked again
STATS_TIMEOUT_S = 2.0
DEFAULT_REQUEST_WORK_S = 1.0  # a placed request's weight before a shard reported any work


def shard_addresses(settings: GatewaySettings) -> list[list[str]]:
    """Each shard's scheduler addresses (leader and standbys, in order)."""
    if not settings.scheduler_shards:
        return [list(settings.scheduler_address)]
    shards = [[a.strip() for a in s.split("|") if a.strip()] for s in settings.scheduler_shards]
    if not all(shards):
        raise ValueError(f"scheduler_shards has an empty shard: {settings.scheduler_shards}")
    return shards


@dataclass
class Load:
    work_s: float = 0.0  # reported predicted outstanding work
    executors: int = 0  # executors up
    requests: int = 0  # running + waiting
    placed: int = 0  # requests this gateway placed since the report
    reported_at: float = float("-inf")  # monotonic
    up: bool = True  # False: the last Stats found no leader

    def score(self) -> float:
        per_request = self.work_s / self.requests if self.requests else DEFAULT_REQUEST_WORK_S
        return (self.work_s + self.placed * per_request) / max(1, self.executors)


class SchedulerGroup:
    def __init__(self, addresses: Sequence[str], index: int = 0) -> None:
        self.index = index
        self.addresses = list(addresses)
        self.channels = [
            aio_channel(address, idempotent_services=["grpc.health.v1.Health"])
            for address in self.addresses
        ]
        self.stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in self.channels]
        self.muxes = [EventMux(stub) for stub in self.stubs]  # batched events, per scheduler
        self.leader = 0  # index of the scheduler believed to lead
        self.load = Load()

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self.stubs[self.leader]

    @property
    def mux(self) -> EventMux:
        return self.muxes[self.leader]

    def failover(self, failed: int) -> None:
        """The scheduler at index `failed` is down or stands by: try the next one."""
        if self.leader == failed:
            self.leader = (failed + 1) % len(self.stubs)

    async def close(self) -> None:
        for mux in self.muxes:
            await mux.close()
        for channel in self.channels:
            await channel.close()

    async def up(self) -> bool:
        """A scheduler of this shard leads: the current one, or another (then current)."""
        for _ in self.stubs:
            if await check_health(self.channels[self.leader], SCHEDULER_SERVICE, 1.0):
                return True
            self.failover(self.leader)
        return False

    async def not_ready(self) -> str:
        """'' when this shard can serve now, else why not."""
        if not await self.up():
            return "no scheduler leads (unreachable or standing by)"
        channel = self.channels[self.leader]
        redis_ok, executors_ok = await asyncio.gather(
            check_health(channel, SCHEDULER_REDIS, 1.0),
            check_health(channel, SCHEDULER_EXECUTORS, 1.0),
        )
        if not redis_ok:
            return "the leading scheduler cannot reach Redis"
        if not executors_ok:
            return "no executor is reachable"
        return ""

    async def stats(self, now: float) -> scheduler_pb2.StatsResponse | None:
        """Stats of the shard's leader (following failover); records its load."""
        for _ in self.stubs:
            index = self.leader
            try:
                reply = await self.stub.Stats(scheduler_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.debug("scheduler Stats failed: %s", exc.code().name)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return None
                self.failover(index)
                continue
            self.load = Load(
                work_s=reply.outstanding_work_s,
                executors=sum(e.up for e in reply.executors),
                requests=reply.running + reply.waiting,
                reported_at=now,
            )
            return reply
        self.load = Load(up=False, reported_at=now)
        return None

    async def abort(self, request_id: str) -> None:
        for _ in self.stubs:
            index = self.leader
            try:
                await self.stub.Abort(
                    scheduler_pb2.AbortRequest(request_id=request_id), timeout=5.0
                )
                return
            except grpc.aio.AioRpcError as exc:
                log.warning("abort of %s failed: %s", request_id, exc.code().name)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return
                self.failover(index)


def pick(groups: Sequence[SchedulerGroup]) -> SchedulerGroup:
    """The shard a new request goes to (ties to the lowest shard), counted as placed there."""
    group = min([g for g in groups if g.load.up] or groups, key=lambda g: (g.load.score(), g.index))
    group.load.placed += 1
    return group
