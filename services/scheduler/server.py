"""Start the scheduler service in-process: `handle = await start_scheduler(settings)`.

    settings = SchedulerSettings(redis_url=redis.url, executors=[f"127.0.0.1:{ex.port}"],
                                 scheduler_port=0, policy="hybrid")
    handle = await start_scheduler(settings)     # handle.port: the bound gRPC port
    ...
    await handle.stop()

Without `redis_url` an embedded redis-server is started under `data_dir/redis` (and stopped
with the handle). `metrics_port` > 0 serves Prometheus text on that port.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.common.grpc_server import GrpcServer, start_server
from services.common.pb import scheduler_pb2_grpc
from services.common.redis_runner import EmbeddedRedis
from services.common.settings import SchedulerSettings
from services.scheduler.service import SchedulerService
from services.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)


@dataclass
class SchedulerHandle:
    port: int
    service: SchedulerService
    grpc_server: GrpcServer
    metrics_server: object | None = None
    embedded_redis: EmbeddedRedis | None = None

    @property
    def address(self) -> str:
        return f"{self.service.settings.scheduler_host}:{self.port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving; unfinished requests stay in Redis for the next start."""
        self.service.stopping = True
        await self.grpc_server.stop(grace)
        await self.service.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.embedded_redis is not None:
            await asyncio.to_thread(self.embedded_redis.stop)


async def start_scheduler(settings: SchedulerSettings) -> SchedulerHandle:
    embedded = None
    if not settings.redis_url:
        embedded = await asyncio.to_thread(EmbeddedRedis(settings.data_dir / "redis").start)
        settings = settings.model_copy(update={"redis_url": embedded.url})
    service = None
    try:
        service = SchedulerService(settings)  # unknown policy or knob: ValueError
        await service.start()
        server = await start_server(
            [
                (
                    scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                    SchedulerServicer(service),
                    "alise.v1.Scheduler",
                )
            ],
            f"{settings.scheduler_host}:{settings.scheduler_port}",
        )
    except BaseException:
        if service is not None:
            await service.stop()
        if embedded is not None:
            embedded.stop()
        raise
    metrics_server = None
    if settings.metrics_port:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(
            settings.metrics_port, registry=service.metrics.registry
        )
    log.info(
        "scheduler serving",
        extra={
            "port": server.port,
            "policy": settings.policy,
            "policy_config": settings.policy_config,
            "executors": settings.executors,
        },
    )
    return SchedulerHandle(server.port, service, server, metrics_server, embedded)
