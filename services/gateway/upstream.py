"""The gateway's gRPC side: scheduler (Generate/Abort/Stats/health) and predictor replicas.

Schedulers: one leads, any others stand by (they answer UNAVAILABLE). The gateway keeps the
index of the one it believes leads and moves to the next on UNAVAILABLE (`failover`).

Predictions are best effort: one Predict with a short deadline, and any failure (slow, down,
no replica) means the request goes ahead without one. Observations are fire-and-forget
background tasks. Aborts are also background tasks so they survive the cancellation of the
HTTP handler that asks for them (a disconnecting client cancels its handler).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from services.common.grpc_client import SCHEDULER_SERVICE, aio_channel, check_health
from services.common.pb import (
    common_pb2,
    predictor_pb2,
    predictor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.settings import GatewaySettings

if TYPE_CHECKING:
    # The Generate stream: an async iterator of TokenEvents, with .cancel().
    GenerateCall: TypeAlias = grpc.aio.UnaryStreamCall[
        scheduler_pb2.GenerateRequest, scheduler_pb2.TokenEvent
    ]

log = logging.getLogger(__name__)

HEALTH_CACHE_S = 1.0
STATS_TIMEOUT_S = 2.0


class Upstream:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        # One channel per scheduler: a leader and its standbys, tried in order (not balanced).
        self.scheduler_channels = [
            aio_channel(address, idempotent_services=["grpc.health.v1.Health"])
            for address in settings.scheduler_address
        ]
        self.schedulers = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in self.scheduler_channels]
        self.leader = 0  # index of the scheduler believed to lead
        self.predictor_channel = aio_channel(
            settings.predictor_addresses, idempotent_services=["alise.v1.Predictor"]
        )
        self.predictor = predictor_pb2_grpc.PredictorStub(self.predictor_channel)
        self._tasks: set[asyncio.Task[None]] = set()
        self._health: dict[str, tuple[float, bool]] = {}
        self.max_model_len: int = 0  # from the scheduler's Stats, 0 = unknown yet
        self.max_kv_tokens: int = 0  # the largest executor KV pool, from Stats, 0 = unknown

    @property
    def scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        return self.schedulers[self.leader]

    def failover(self, failed: int) -> None:
        """The scheduler at index `failed` is down or stands by: try the next one."""
        if self.leader == failed:
            self.leader = (failed + 1) % len(self.schedulers)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for channel in self.scheduler_channels:
            await channel.close()
        await self.predictor_channel.close()

    def _background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # Scheduler.

    async def scheduler_up(self) -> bool:
        """A scheduler leads: the current one, or another (which then becomes current)."""
        checked_at, up = self._health.get("scheduler", (0.0, False))
        if time.monotonic() - checked_at < HEALTH_CACHE_S:
            return up
        up = False
        for _ in self.schedulers:
            if await check_health(self.scheduler_channels[self.leader], SCHEDULER_SERVICE, 1.0):
                up = True
                break
            self.failover(self.leader)
        self._health["scheduler"] = (time.monotonic(), up)
        return up

    async def predictor_up(self) -> bool:
        """Health check, cached for HEALTH_CACHE_S so /health polling stays cheap."""
        checked_at, up = self._health.get("predictor", (0.0, False))
        if time.monotonic() - checked_at < HEALTH_CACHE_S:
            return up
        up = await check_health(self.predictor_channel, timeout=1.0)
        self._health["predictor"] = (time.monotonic(), up)
        return up

    async def stats(self) -> scheduler_pb2.StatsResponse | None:
        for _ in self.schedulers:
            index = self.leader
            try:
                reply = await self.scheduler.Stats(
                    scheduler_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                log.debug("scheduler Stats failed: %s", exc.code().name)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return None
                self.failover(index)
                continue
            if reply.max_model_len > 0:
                self.max_model_len = reply.max_model_len
            if reply.max_kv_tokens > 0:
                self.max_kv_tokens = reply.max_kv_tokens
            return reply
        return None

    def context_limit(self, config_max_len: int) -> int:
        """Tokens one request may use (prompt + output): the model's length, capped by the
        largest executor KV pool, as far as the scheduler has reported them."""
        limit = self.max_model_len or config_max_len
        return min(limit, self.max_kv_tokens) if self.max_kv_tokens else limit

    def generate(
        self, request: scheduler_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> tuple[GenerateCall, int]:
        """Start a Generate stream on the current scheduler: (the call, that scheduler's index).
        The call is an async iterator of TokenEvent with .cancel()."""
        timeout = self.settings.request_timeout_s if timeout_s is None else timeout_s
        return self.scheduler.Generate(request, timeout=timeout), self.leader

    def abort(self, request_id: str) -> asyncio.Task[None]:
        return self._background(self._abort(request_id))

    async def _abort(self, request_id: str) -> None:
        for _ in self.schedulers:
            index = self.leader
            try:
                await self.scheduler.Abort(
                    scheduler_pb2.AbortRequest(request_id=request_id), timeout=5.0
                )
                return
            except grpc.aio.AioRpcError as exc:
                log.warning("abort of %s failed: %s", request_id, exc.code().name)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return
                self.failover(index)

    # Predictor.

    async def predict(self, model: str, prompt: str) -> common_pb2.Prediction | None:
        # Every replica unreachable: a call would fail anyway, but only after the retries'
        # backoff (~150 ms per request, measured against a closed port). gRPC keeps
        # reconnecting in the background, so predictions resume when a replica is back.
        state = self.predictor_channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            log.debug("no prediction: no predictor replica is reachable")
            return None
        timeout = self.settings.predictor_timeout_ms / 1000.0
        request = predictor_pb2.PredictRequest(model=model, prompts=[prompt])
        try:
            reply = await asyncio.wait_for(
                self.predictor.Predict(request, timeout=timeout), timeout
            )
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            log.debug("no prediction: %s", getattr(exc, "code", lambda: "timeout")())
            return None
        return reply.predictions[0] if reply.predictions else None

    def observe(self, model: str, request_id: str, prompt: str, true_length: int) -> None:
        self._background(self._observe(model, request_id, prompt, true_length))

    async def _observe(self, model: str, request_id: str, prompt: str, length: int) -> None:
        obs = predictor_pb2.Observation(request_id=request_id, prompt=prompt, true_length=length)
        try:
            await self.predictor.Observe(
                predictor_pb2.ObserveRequest(model=model, observations=[obs]), timeout=5.0
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("observe failed: %s", exc.code().name)
