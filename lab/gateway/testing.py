"""Run a real gateway (uvicorn on loopback) inside this process, for tests and benchmarks."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings

if TYPE_CHECKING:
    from services.common.redis_runner import EmbeddedRedis
    from services.executor.server import ExecutorHandle
    from services.launcher.supervisor import Supervisor
    from services.launcher.topology import ServiceSpec
    from services.scheduler.server import SchedulerHandle

_T = TypeVar("_T")


@contextmanager
def running_gateway(
    settings: GatewaySettings, port: int | None = None, start_timeout_s: float = 120.0
) -> Iterator[str]:
    """Serve `create_app(settings)` on 127.0.0.1:`port` (default: a free one) in a thread;
    yields the base URL."""
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.cli import server_config

    port = port or free_port()
    here = settings.model_copy(update={"gateway_host": "127.0.0.1", "gateway_port": port})
    config = server_config(create_app(here), here)  # what `alise gateway serve` runs
    config.lifespan, config.timeout_graceful_shutdown = "on", 2
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


class ProcessStack:
    """Executors, schedulers and a gateway as separate `alise ... serve` processes on free
    loopback ports (plus a private embedded Redis), for tests and benchmarks that kill and
    restart services. `model="tiny"` builds a random-weight model with the bundled tokenizer;
    `with_executor=False` leaves the scheduler without one, so requests wait in its queue (idle
    streams). Children are named `executor-0..`, `scheduler-0..` (the first is the leader at
    start, the others stand by), `predictor` (with `with_predictor`) and `gateway`. `watch()`
    restarts crashed children like `alise serve` does."""

    def __init__(
        self,
        run_dir: Path,
        model: str = "tiny",
        with_executor: bool = True,
        env: dict[str, str] | None = None,
        health_timeout_s: float = 300.0,
        num_executors: int = 1,
        num_schedulers: int = 1,
        with_predictor: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.model = model
        self.num_executors = num_executors if with_executor else 0
        self.num_schedulers = num_schedulers
        self.with_predictor = with_predictor
        self.extra_env = env or {}
        self.health_timeout_s = health_timeout_s
        self.supervisor: Supervisor | None = None
        self.redis: EmbeddedRedis | None = None
        self.url = ""
        self.model_id = ""
        self.executor_addresses: list[str] = []
        self.scheduler_addresses: list[str] = []
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()

    @property
    def scheduler_address(self) -> str:
        return self.scheduler_addresses[0]

    def _model_setting(self) -> str:
        if self.model != "tiny":
            return self.model
        from lab.executor.tiny import make_tiny_model

        return str(make_tiny_model(self.run_dir / "tiny-model"))

    def _specs(self) -> list[ServiceSpec]:
        from services.launcher.topology import ServiceSpec

        specs = []
        for i in range(self.num_executors):
            port = free_port()
            self.executor_addresses.append(f"127.0.0.1:{port}")
            specs.append(
                ServiceSpec(
                    f"executor-{i}",
                    ("executor", "serve"),
                    {
                        "ALISE_EXECUTOR_PORT": str(port),
                        "ALISE_DEVICE": self.extra_env.get("ALISE_DEVICE", "cpu"),
                    },
                    ("grpc", self.executor_addresses[-1]),
                )
            )
        executors = self.executor_addresses or [f"127.0.0.1:{free_port()}"]
        predictor = f"127.0.0.1:{free_port()}"
        if self.with_predictor:
            specs.append(
                ServiceSpec(
                    "predictor",
                    ("predictor", "serve"),
                    {"ALISE_PREDICTOR_PORT": predictor.rsplit(":", 1)[1]},
                    ("grpc", predictor),
                )
            )
        specs += self._scheduler_specs(executors)
        gw_port = free_port()
        self.url = f"http://127.0.0.1:{gw_port}"
        specs.append(
            ServiceSpec(
                "gateway",
                ("gateway", "serve"),
                {
                    "ALISE_GATEWAY_PORT": str(gw_port),
                    "ALISE_SCHEDULER_ADDRESS": ",".join(self.scheduler_addresses),
                    "ALISE_PREDICTOR_ADDRESSES": predictor,
                    "ALISE_REDIS_URL": self.redis.url,
                },
                ("http", self.url + "/v1/models"),
                ("scheduler-0",),
            )
        )
        return specs

    def _scheduler_specs(self, executors: list[str]) -> list[ServiceSpec]:
        from services.launcher.topology import ServiceSpec

        specs = []
        for i in range(self.num_schedulers):
            port = free_port()
            self.scheduler_addresses.append(f"127.0.0.1:{port}")
            specs.append(
                ServiceSpec(
                    f"scheduler-{i}",
                    ("scheduler", "serve"),
                    {
                        "ALISE_SCHEDULER_PORT": str(port),
                        "ALISE_EXECUTORS": ",".join(executors),
                        "ALISE_REDIS_URL": self.redis.url,
                        "ALISE_EXECUTOR_GRACE_S": "3600",
                    },
                    ("grpc", self.scheduler_addresses[-1]),
                    # standbys start once the first is up, so it takes the lease first
                    tuple(f"executor-{j}" for j in range(self.num_executors))
                    + (("scheduler-0",) if i else ()),
                )
            )
        return specs

    def __enter__(self) -> ProcessStack:
        from services.common.models import served_model_id
        from services.common.redis_runner import EmbeddedRedis
        from services.launcher.supervisor import Supervisor, base_env

        self.run_dir.mkdir(parents=True, exist_ok=True)
        model = self._model_setting()
        self.model_id = served_model_id(model)
        self.redis = EmbeddedRedis(self.run_dir / "redis").start()
        env = base_env(
            {
                "ALISE_MODEL": model,
                "ALISE_LOG_LEVEL": "WARNING",
                "ALISE_KV_MEMORY_GB": "0.25",
                "ALISE_SWAP_MEMORY_GB": "0.1",
                # answers are compared with undisturbed runs: fp32, which recomputes bit for
                # bit on a CPU (bf16, `auto`'s choice where it is faster, does not)
                "ALISE_DTYPE": "fp32",
                **self.extra_env,
            }
        )
        self.supervisor = Supervisor(self._specs(), self.run_dir / "logs", env)
        try:
            self.supervisor.start_all(self.health_timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def gateway_pid(self) -> int:
        return self.pid("gateway")

    def pid(self, name: str) -> int:
        return self.supervisor.pids()[name]

    def leader(self, timeout_s: float = 15.0) -> str:
        """The name of the scheduler that leads now (waits for one during a takeover)."""
        from services.common.grpc_client import SCHEDULER_SERVICE, check_health_sync

        deadline = time.monotonic() + timeout_s
        while True:
            for i, address in enumerate(self.scheduler_addresses):
                if check_health_sync(address, SCHEDULER_SERVICE, timeout=1.0):
                    return f"scheduler-{i}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler leads after {timeout_s:g}s")
            time.sleep(0.1)

    def scheduler_address_of(self, name: str) -> str:
        return self.scheduler_addresses[int(name.rsplit("-", 1)[1])]

    def redis_url(self) -> str:
        return self.redis.url

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` (e.g. signal.SIGKILL, SIGSTOP, SIGCONT) to one child."""
        os.kill(self.pid(name), sig)

    def restart(self, name: str) -> None:
        """Start a child again that was killed (not waiting for its health)."""
        child = self.supervisor.child(name)
        if child.process is not None and child.process.poll() is None:
            child.process.kill()
            child.process.wait()
        child.start(self.supervisor.env)

    def watch(self, interval_s: float = 0.2) -> None:
        """Restart crashed children in the background, as `alise serve` does."""

        def run() -> None:
            while not self._stop_watch.wait(interval_s):
                self.supervisor.poll()

        self._watcher = threading.Thread(target=run, name="stack-watch", daemon=True)
        self._watcher.start()

    def __exit__(self, *exc: object) -> None:
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(5)
        if self.supervisor is not None:
            self.supervisor.stop_all(timeout=10)
        if self.redis is not None:
            self.redis.stop()


class BackgroundLoop:
    """An asyncio loop in a daemon thread, for in-process gRPC services under sync tests."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="services", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = 300.0) -> _T:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Backend(TypedDict):
    """What `inprocess_backend` yields."""

    loop: BackgroundLoop
    scheduler: SchedulerHandle
    executor: ExecutorHandle | None
    address: str  # the scheduler's


class Stack(Backend):
    """What `inprocess_stack` yields."""

    url: str  # the gateway's base URL
    redis_url: str  # the embedded Redis (a second gateway on it shares stored Responses)


# In-process executors: small pools, and fp32, exact across recomputes (see ProcessStack)
TEST_EXECUTOR: dict[str, object] = {
    "executor_port": 0,
    "device": "cpu",
    "dtype": "fp32",
    "kv_memory_gb": 0.05,
    "swap_memory_gb": 0.02,
}


@contextmanager
def inprocess_backend(
    run_dir: Path,
    model_dir: str | Path | None,
    redis_url: str,
    executor_kw: dict[str, object] | None = None,
    **scheduler_kw: object,
) -> Iterator[Backend]:
    """A real executor (serving `model_dir` on CPU; None = no executor, requests stay queued)
    and scheduler on loopback, run in a background loop. Yields {"loop", "scheduler",
    "executor", "address"}."""
    from services.common.settings import ExecutorSettings, SchedulerSettings
    from services.scheduler.server import start_scheduler

    loop = BackgroundLoop()
    executor = scheduler = None
    try:
        if model_dir is not None:
            from services.executor.server import start_executor

            given = {"model": str(model_dir), "data_dir": run_dir, **(executor_kw or {})}
            settings = ExecutorSettings(**{**TEST_EXECUTOR, **given})
            executor = loop.run(start_executor(settings))
            executors = [f"127.0.0.1:{executor.port}"]
        else:
            executors = [f"127.0.0.1:{free_port()}"]
        scheduler = loop.run(
            start_scheduler(
                SchedulerSettings(
                    **{
                        "redis_url": redis_url,
                        "executors": executors,
                        "scheduler_port": 0,
                        "data_dir": run_dir,
                        "executor_grace_s": 600,
                        **scheduler_kw,
                    }
                )
            )
        )
        yield {
            "loop": loop,
            "scheduler": scheduler,
            "executor": executor,
            "address": f"127.0.0.1:{scheduler.port}",
        }
    finally:
        if scheduler is not None:
            loop.run(scheduler.stop())
        if executor is not None:
            loop.run(executor.stop())
        loop.close()


@contextmanager
def inprocess_stack(
    run_dir: Path,
    model_dir: str | Path,
    executor_kw: dict[str, object] | None = None,
    scheduler_kw: dict[str, object] | None = None,
    **gateway_kw: object,
) -> Iterator[Stack]:
    """Embedded Redis + `inprocess_backend` + a gateway with no predictor reachable (requests
    go on with the policy's prior), storing Responses in that Redis. Yields {"url", "loop", "scheduler", "executor", "address"}."""
    from services.common.redis_runner import EmbeddedRedis

    with (
        EmbeddedRedis(Path(run_dir) / "redis") as redis,
        inprocess_backend(
            run_dir, model_dir, redis.url, executor_kw, **(scheduler_kw or {})
        ) as backend,
    ):
        settings = GatewaySettings(
            **{
                "model": str(model_dir),
                "scheduler_address": backend["address"],
                "predictor_addresses": [f"127.0.0.1:{free_port()}"],
                "redis_url": redis.url,
                **gateway_kw,
            }
        )
        with running_gateway(settings) as url:
            yield {"url": url, "redis_url": redis.url, **backend}
