"""Start the scheduler service in-process: `handle = await start_scheduler(settings)`.

    settings = SchedulerSettings(redis_url=redis.url, executors=[f"127.0.0.1:{ex.port}"],
                                 scheduler_port=0, policy="hybrid")
    handle = await start_scheduler(settings)     # handle.port: the bound gRPC port
    ...
    await handle.stop()

Several schedulers may run against one Redis: the first to take the leader lease serves,
the others stand by (`handle.leading` is False; Generate answers UNAVAILABLE, and the health
status of `alise.v1.Scheduler` is NOT_SERVING while the overall status stays SERVING) and take
over when the leader's lease lapses (leadership/leader.py).

Without `redis_url` an embedded redis-server is started under `data_dir/redis` (and stopped
with the handle). `metrics_port` > 0 serves Prometheus text on that port.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common.grpc_client import SCHEDULER_EXECUTORS, SCHEDULER_REDIS, SCHEDULER_SERVICE
from services.common.grpc_server import NOT_SERVING, SERVING, GrpcServer, start_server
from services.common.models import served_model_id
from services.common.pb import scheduler_pb2_grpc
from services.common.redis_runner import EmbeddedRedis
from services.common.settings import SchedulerSettings
from services.common.tasks import cancel_and_wait
from services.scheduler.core.policies import make_policy
from services.scheduler.leadership.leader import Leadership, holder_address
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.service import SchedulerService, parse_policy_config
from services.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)


@dataclass
class SchedulerHandle:
    port: int
    leadership: Leadership
    grpc_server: GrpcServer
    metrics_server: object | None = None
    embedded_redis: EmbeddedRedis | None = None
    readiness: asyncio.Task[None] | None = None
    servicer: SchedulerServicer | None = None  # its subscriptions, for assertions

    @property
    def service(self) -> SchedulerService:
        """The service while this scheduler leads (a standby has none: RuntimeError)."""
        if self.leadership.service is None:
            raise RuntimeError("this scheduler is standing by (another one leads)")
        return self.leadership.service

    @property
    def leading(self) -> bool:
        return self.leadership.service is not None

    @property
    def address(self) -> str:
        return f"{self.leadership.settings.scheduler_host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving; unfinished requests stay in Redis for the next leader."""
        if self.leadership.service is not None:
            self.leadership.service.stopping = True
        await cancel_and_wait(self.readiness)
        await self.grpc_server.stop(grace)
        await self.leadership.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.embedded_redis is not None:
            await asyncio.to_thread(self.embedded_redis.stop)


async def start_scheduler(settings: SchedulerSettings) -> SchedulerHandle:
    """Serve gRPC, then lead at once when the leader lease is free (else stand by)."""
    embedded = None
    if not settings.redis_url:
        embedded = await asyncio.to_thread(EmbeddedRedis(settings.data_dir / "redis").start)
        settings = settings.model_copy(update={"redis_url": embedded.url})
    metrics = SchedulerMetrics(served_model_id(settings.model))
    make_policy(settings.policy, **parse_policy_config(settings.policy_config))  # check early
    server = leadership = None
    try:
        servicer = SchedulerServicer()
        server = await start_server(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, SCHEDULER_SERVICE)],
            f"{settings.scheduler_host}:{settings.scheduler_port}",
        )
        await server.health.set(SCHEDULER_SERVICE, NOT_SERVING)

        async def leading(now: bool) -> None:
            await server.health.set(SCHEDULER_SERVICE, SERVING if now else NOT_SERVING)

        leadership = Leadership(settings, metrics, holder_address(server.port), leading)
        servicer.leadership = leadership
        await leadership.start()
        readiness = asyncio.create_task(_report_readiness(server, leadership), name="readiness")
    except BaseException:
        if leadership is not None:
            await leadership.stop()
        if server is not None:
            await server.stop(0)
        if embedded is not None:
            embedded.stop()
        raise
    metrics_server = None
    if settings.metrics_port:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(settings.metrics_port, registry=metrics.registry)
    log.info(
        "scheduler serving",
        extra={
            "port": server.port,
            "policy": settings.policy,
            "policy_config": settings.policy_config,
            "executors": settings.executors,
            "leading": leadership.service is not None,
        },
    )
    return SchedulerHandle(
        server.port, leadership, server, metrics_server, embedded, readiness, servicer
    )


READINESS_POLL_S = 0.25


async def _report_readiness(server: GrpcServer, leadership: Leadership) -> None:
    """Keep the readiness health names (SCHEDULER_REDIS, SCHEDULER_EXECUTORS) true to what
    this scheduler sees; a standby reports NOT_SERVING for executors (it drives none)."""
    last: tuple[bool, bool] | None = None
    while True:
        now = leadership.readiness()
        if now != last:
            await server.health.set(SCHEDULER_REDIS, SERVING if now[0] else NOT_SERVING)
            await server.health.set(SCHEDULER_EXECUTORS, SERVING if now[1] else NOT_SERVING)
            last = now
        await asyncio.sleep(READINESS_POLL_S)
