"""Start the executor gRPC service: engine + servicer + health + Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.executor_registry import Registration
from services.common.grpc_server import GrpcServer, start_server
from services.common.metrics import TOKEN_BUCKETS, Metrics
from services.common.pb import executor_pb2_grpc
from services.executor.messages import StepOutput
from services.executor.servicer import ExecutorServicer

if TYPE_CHECKING:
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

log = logging.getLogger(__name__)
SERVICE_NAME = "alise.v1.Executor"


class ExecutorMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        self.step_time = self.histogram("executor_step_seconds", "Step handler time.")
        self.forward_time = self.histogram("executor_forward_seconds", "Forward pass time.")
        self.swap_wait = self.histogram(
            "executor_swap_wait_seconds", "Time steps waited for swap copies."
        )
        self.batch_tokens = self.histogram(
            "executor_batch_tokens", "Tokens per forward pass.", buckets=TOKEN_BUCKETS
        )
        self.prefill_tokens = self.counter("executor_prefill_tokens", "Prompt tokens computed.")
        self.decode_tokens = self.counter("executor_decode_tokens", "Decode tokens computed.")

    def observe(self, out: StepOutput) -> None:
        self.step_time.observe(out.timings.total_s)
        self.forward_time.observe(out.timings.forward_s)
        self.swap_wait.observe(out.timings.swap_wait_s)
        self.batch_tokens.observe(out.num_prefill_tokens + out.num_decode_tokens)
        self.prefill_tokens.inc(out.num_prefill_tokens)
        self.decode_tokens.inc(out.num_decode_tokens)


@dataclass
class ExecutorHandle:
    server: GrpcServer
    engine: Engine
    metrics: ExecutorMetrics
    registration: Registration | None = None

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        if self.registration is not None:  # schedulers stop sending before the server goes
            await self.registration.stop()
        await self.server.stop()
        await asyncio.to_thread(self.engine.close)


def advertise_address(settings: ExecutorSettings, port: int) -> str:
    """Where schedulers reach this executor: the setting, else the bind host (or, bound to
    every interface, the host name) and the bound port."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.executor_host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def start_executor(
    settings: ExecutorSettings, engine: Engine | None = None
) -> ExecutorHandle:
    """Serve `engine` (default: built from `settings`, off the event loop) on
    settings.executor_host:executor_port (port 0 = a free one)."""
    if engine is None:
        from services.executor.engine import Engine

        engine = await asyncio.to_thread(Engine.from_settings, settings)
    metrics = ExecutorMetrics()
    servicer = ExecutorServicer(engine, metrics)
    address = f"{settings.executor_host}:{settings.executor_port}"
    server = await start_server(
        [(executor_pb2_grpc.add_ExecutorServicer_to_server, servicer, SERVICE_NAME)], address
    )
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    registration = None
    if settings.registry_url:
        registration = Registration(
            settings.registry_url,
            settings.redis_namespace,
            advertise_address(settings, server.port),
        )
        await registration.start()
    info = engine.describe()
    log.info(
        "executor ready",
        extra={
            k: info[k]
            for k in (
                "model",
                "device",
                "dtype",
                "kv_dtype",
                "num_device_blocks",
                "num_host_blocks",
            )
        },
    )
    return ExecutorHandle(server, engine, metrics, registration)
