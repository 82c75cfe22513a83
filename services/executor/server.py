"""Start the executor gRPC service: engine + servicer + health + Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from services.common.executor_registry import Registration
from services.common.grpc_server import GrpcServer, start_server
from services.common.pb import executor_pb2_grpc
from services.executor.metrics import ExecutorMetrics
from services.executor.servicer import ExecutorServicer
from services.executor.warmup import Phase, Startup

if TYPE_CHECKING:
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

log = logging.getLogger(__name__)
SERVICE_NAME = "alise.v1.Executor"


class StartupFailed(RuntimeError):
    """The executor could not load its model or warm up; the reason was logged on one line."""


@dataclass
class ExecutorHandle:
    server: GrpcServer
    servicer: ExecutorServicer
    metrics: ExecutorMetrics
    startup: Startup
    registration: Registration | None = None
    warmup: dict | None = None  # what the warm-up did (warmup.warm_up_engine)

    @property
    def engine(self) -> Engine:
        if self.servicer.engine is None:
            raise RuntimeError(f"the executor is {self.startup.phase.value}: no engine yet")
        return self.servicer.engine

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        if self.registration is not None:  # schedulers stop sending before the server goes
            await self.registration.stop()
        await self.server.stop()
        self.servicer.lane.close()
        if self.servicer.engine is not None:
            await asyncio.to_thread(self.servicer.engine.close)


def advertise_address(settings: ExecutorSettings, port: int) -> str:
    """Where schedulers reach this executor: the setting, else the bind host (or, bound to
    every interface, the host name) and the bound port."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.executor_host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def open_executor(settings: ExecutorSettings) -> ExecutorHandle:
    """The gRPC server listening on settings.executor_host:executor_port (port 0 = a free
    one) with health NOT_SERVING and no engine yet: Steps are refused as UNAVAILABLE."""
    metrics, startup = ExecutorMetrics(), Startup()
    servicer = ExecutorServicer(None, metrics, startup)
    address = f"{settings.executor_host}:{settings.executor_port}"
    server = await start_server(
        [(executor_pb2_grpc.add_ExecutorServicer_to_server, servicer, SERVICE_NAME)],
        address,
        serving=False,
    )
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    return ExecutorHandle(server, servicer, metrics, startup)


async def bring_up(
    handle: ExecutorHandle, settings: ExecutorSettings, engine: Engine | None = None
) -> None:
    """Load `engine` (default: from `settings`, off the event loop), warm it up, then report
    SERVING and register. A failure is logged on one line, the server stopped, and
    StartupFailed raised.

    Loading and warm-up run on the engine's lane, the thread that will run every Step: on a
    CPU, each thread that starts torch's parallel work gets its own OpenMP team, and a second
    team's idle threads make the running team's threads sleep between ops (a one-row decode
    step measured 2x slower when the engine was loaded in one thread and stepped in another)."""
    lane = handle.servicer.lane
    try:
        if engine is None:
            from services.executor.engine import Engine

            engine = await lane.submit(partial(Engine.from_settings, settings))
        handle.servicer.engine = engine
        handle.startup.advance(Phase.WARMING)
        warm_up = getattr(engine, "warm_up", None)  # the benchmark stub has nothing to warm
        handle.warmup = await lane.submit(warm_up) if warm_up else {}
    except Exception as exc:
        phase = handle.startup.phase.value
        reason = handle.startup.fail(exc)
        log.error("executor start-up failed while %s: %s", phase, reason)
        await handle.stop()
        raise StartupFailed(reason) from exc
    handle.startup.advance(Phase.SERVING)
    await handle.server.set_serving(True)
    if settings.registry_url:
        handle.registration = Registration(
            settings.registry_url,
            settings.redis_namespace,
            advertise_address(settings, handle.server.port),
        )
        await handle.registration.start()
    log_ready(engine.describe(), handle.warmup)


def log_ready(info: dict, warmup: dict) -> None:
    """The one start-up line: model, device, pool sizes, memory plan, graphs."""
    memory = info.get("gpu_memory") or {}
    fields = {
        k: info[k]
        for k in ("model", "device", "dtype", "kv_dtype", "num_device_blocks", "num_host_blocks")
    }
    fields.update(
        bytes_per_block=info.get("bytes_per_block"),
        kv_gib=round(memory.get("kv_bytes", 0) / 2**30, 3),
        gpu_memory_utilization=memory.get("utilization"),
        cuda_graphs=info.get("cuda_graph_buckets", []),
        warmup_s=round(warmup.get("seconds", 0.0), 2),
    )
    log.info("executor ready", extra=fields)


async def start_executor(
    settings: ExecutorSettings, engine: Engine | None = None
) -> ExecutorHandle:
    """Serve `engine` (default: built from `settings`) once loaded and warmed up: the server
    listens from the start (NOT_SERVING) and reports SERVING when this returns."""
    handle = await open_executor(settings)
    await bring_up(handle, settings, engine)
    return handle
