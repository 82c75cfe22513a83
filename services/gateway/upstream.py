"""The gateway's gRPC side: scheduler (Generate/Abort/Stats/health) and predictor replicas.

Schedulers: one shard, or several (services/gateway/shards.py); in each, one scheduler leads
and any others stand by (they answer UNAVAILABLE).

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

from services.common.grpc_client import aio_channel, check_health
from services.common.pb import common_pb2, predictor_pb2, predictor_pb2_grpc, scheduler_pb2
from services.common.settings import GatewaySettings
from services.gateway.events import BatchedCall
from services.gateway.shards import REFRESH_S, SchedulerGroup, pick, shard_addresses

if TYPE_CHECKING:
    # The Generate stream: an async iterator of TokenEvents, with .cancel() (or its batched
    # stand-in, services/gateway/events.py).
    GenerateCall: TypeAlias = (
        grpc.aio.UnaryStreamCall[scheduler_pb2.GenerateRequest, scheduler_pb2.TokenEvent]
        | BatchedCall
    )

log = logging.getLogger(__name__)

HEALTH_CACHE_S = 1.0


class Upstream:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.shards = [SchedulerGroup(a, i) for i, a in enumerate(shard_addresses(settings))]
        self.predictor_channel = aio_channel(
            settings.predictor_addresses, idempotent_services=["alise.v1.Predictor"]
        )
        self.predictor = predictor_pb2_grpc.PredictorStub(self.predictor_channel)
        self._tasks: set[asyncio.Task[None]] = set()
        self._health: dict[str, tuple[float, bool]] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self.max_model_len: int = 0  # from the scheduler's Stats, 0 = unknown yet
        self.max_kv_tokens: int = 0  # the largest executor KV pool, from Stats, 0 = unknown
        self.held = 0  # new requests waiting for a scheduler to admit them (Generation._hold)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for group in self.shards:
            await group.close()
        await self.predictor_channel.close()

    def _background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # Scheduler shards.

    def place(self) -> SchedulerGroup:
        """The shard for a new request (the only one, or the least loaded); the shards' loads
        are refreshed in the background when older than REFRESH_S."""
        if len(self.shards) == 1:
            return self.shards[0]
        stale = min(g.load.reported_at for g in self.shards) < time.monotonic() - REFRESH_S
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = self._background(self._refresh())
        return pick(self.shards)

    async def _refresh(self) -> None:
        await self.stats()

    async def scheduler_up(self) -> bool:
        """Some shard has a leading scheduler (cached for HEALTH_CACHE_S)."""
        checked_at, up = self._health.get("scheduler", (0.0, False))
        if time.monotonic() - checked_at < HEALTH_CACHE_S:
            return up
        up = any(await asyncio.gather(*(g.up() for g in self.shards)))
        self._health["scheduler"] = (time.monotonic(), up)
        return up

    async def not_ready(self) -> str:
        """'' while some shard can serve (a leading scheduler that reaches Redis and some
        executor), else the first shard's reason; not cached (readiness probes are rare)."""
        reasons = await asyncio.gather(*(g.not_ready() for g in self.shards))
        if any(not r for r in reasons):
            return ""
        return "; ".join(sorted(set(reasons)))

    async def predictor_up(self) -> bool:
        """Health check, cached for HEALTH_CACHE_S so /health polling stays cheap."""
        checked_at, up = self._health.get("predictor", (0.0, False))
        if time.monotonic() - checked_at < HEALTH_CACHE_S:
            return up
        up = await check_health(self.predictor_channel, timeout=1.0)
        self._health["predictor"] = (time.monotonic(), up)
        return up

    async def stats(self) -> scheduler_pb2.StatsResponse | None:
        """Every shard's Stats (their loads recorded); the first shard's reply that came."""
        now = time.monotonic()
        replies = await asyncio.gather(*(g.stats(now) for g in self.shards))
        for reply in replies:
            if reply is None:
                continue
            if reply.max_model_len > 0:
                self.max_model_len = reply.max_model_len
            if reply.max_kv_tokens > 0:
                self.max_kv_tokens = max(self.max_kv_tokens, reply.max_kv_tokens)
        return next((r for r in replies if r is not None), None)

    def context_limit(self, config_max_len: int) -> int:
        """Tokens one request may use (prompt + output): the model's length, capped by the
        largest executor KV pool, as far as the scheduler has reported them."""
        limit = self.max_model_len or config_max_len
        return min(limit, self.max_kv_tokens) if self.max_kv_tokens else limit

    def generate(
        self,
        group: SchedulerGroup,
        request: scheduler_pb2.GenerateRequest,
        timeout_s: float | None = None,
    ) -> tuple[GenerateCall, int]:
        """Start a Generate stream on the shard's current scheduler: (the call, that
        scheduler's index). The call is an async iterator of TokenEvent with .cancel(); with
        `batch_events` its events come on the gateway's subscription to that scheduler."""
        timeout = self.settings.request_timeout_s if timeout_s is None else timeout_s
        if self.settings.batch_events:
            return BatchedCall(group.mux, group.stub, request, timeout), group.leader
        return group.stub.Generate(request, timeout=timeout), group.leader

    def abort(self, group: SchedulerGroup, request_id: str) -> asyncio.Task[None]:
        return self._background(group.abort(request_id))

    def hold(self) -> bool:
        """Take one of the `admission_hold_max` places for a request waiting to be
        admitted; False when all are taken."""
        if self.held >= self.settings.admission_hold_max:
            return False
        self.held += 1
        return True

    def release_hold(self) -> None:
        self.held -= 1

    # Predictor.

    async def predict(
        self, model: str, prompt: str, temperature: float | None = None
    ) -> common_pb2.Prediction | None:
        # Every replica unreachable: a call would fail anyway, but only after the retries'
        # backoff (~150 ms per request, measured against a closed port). gRPC keeps
        # reconnecting in the background, so predictions resume when a replica is back.
        state = self.predictor_channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            log.debug("no prediction: no predictor replica is reachable")
            return None
        timeout = self.settings.predictor_timeout_ms / 1000.0
        request = predictor_pb2.PredictRequest(
            model=model, prompts=[prompt], temperature=temperature
        )
        try:
            reply = await asyncio.wait_for(
                self.predictor.Predict(request, timeout=timeout), timeout
            )
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            log.debug("no prediction: %s", getattr(exc, "code", lambda: "timeout")())
            return None
        return reply.predictions[0] if reply.predictions else None

    def observe(
        self,
        model: str,
        request_id: str,
        prompt: str,
        true_length: int,
        censored: bool = False,
        temperature: float | None = None,
    ) -> None:
        obs = predictor_pb2.Observation(
            request_id=request_id, prompt=prompt, true_length=true_length, censored=censored
        )
        request = predictor_pb2.ObserveRequest(
            model=model, observations=[obs], temperature=temperature
        )
        self._background(self._observe(request))

    async def _observe(self, request: predictor_pb2.ObserveRequest) -> None:
        try:
            await self.predictor.Observe(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.debug("observe failed: %s", exc.code().name)
