"""The stack's services, described once: what `alise serve` starts and what
docker-compose.yml must mirror (tests/unit/test_compose.py checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULER_PORT = 50051
SCHEDULER_STANDBY_BASE_PORT = 50055  # on one machine the standbys need ports of their own
PREDICTOR_PORT = 50052
EXECUTOR_BASE_PORT = 50061
GATEWAY_PORT = 8000


@dataclass(frozen=True)
class LocalPorts:
    """`alise serve`'s loopback gRPC ports, all at fixed offsets from one base (the default
    base gives the ports above, which docker-compose and Kubernetes use too)."""

    base: int = SCHEDULER_PORT

    @property
    def scheduler(self) -> int:
        return self.base

    @property
    def predictor(self) -> int:
        return self.base + PREDICTOR_PORT - SCHEDULER_PORT

    def standby(self, i: int) -> int:
        return self.base + SCHEDULER_STANDBY_BASE_PORT - SCHEDULER_PORT + i

    def executor(self, i: int) -> int:
        return self.base + EXECUTOR_BASE_PORT - SCHEDULER_PORT + i

    def schedulers(self, n: int) -> list[int]:
        return [self.scheduler] + [self.standby(i) for i in range(n - 1)]

    def all(self, num_executors: int, num_schedulers: int) -> list[int]:
        execs = [self.executor(i) for i in range(num_executors)]
        return [*self.schedulers(num_schedulers), self.predictor, *execs]


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # also the docker-compose service name (or its prefix)
    command: tuple[str, ...]  # arguments after `alise`
    env: dict[str, str] = field(default_factory=dict)
    health: tuple[str, str] = ("grpc", "")  # ("grpc", "host:port") or ("http", url)
    depends_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class RedisPlan:
    """The embedded Redis `alise serve` supervises: a fixed loopback port (a restart comes back
    on it), its data directory (the append-only file a restart replays) and its password."""

    data_dir: str
    port: int
    password: str
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        from services.common.redis_runner import redis_url

        return redis_url(self.host, self.port, self.password)


def redis_spec(plan: RedisPlan) -> ServiceSpec:
    return ServiceSpec(
        "redis",
        ("redis", "serve", "--host", plan.host, "--port", str(plan.port), "--dir", plan.data_dir),
        {REDIS_PASSWORD_ENV: plan.password},
        ("redis", plan.url),
    )


REDIS_PASSWORD_ENV = "ALISE_EMBEDDED_REDIS_PASSWORD"


def executor_names(num_executors: int) -> list[str]:
    return [f"executor-{i}" for i in range(num_executors)]


def scheduler_names(num_schedulers: int) -> list[str]:
    """The leader at start is `scheduler`; standbys are `scheduler-1`, `scheduler-2`, ..."""
    return ["scheduler"] + [f"scheduler-{i}" for i in range(1, num_schedulers)]


def scheduler_ports(num_schedulers: int, ports: LocalPorts | None = None) -> list[int]:
    return (ports or LocalPorts()).schedulers(num_schedulers)


def local_topology(
    num_executors: int,
    redis_url: str,
    host: str = "127.0.0.1",
    gateway_host: str = "127.0.0.1",
    gateway_port: int = GATEWAY_PORT,
    num_schedulers: int = 1,
    redis: RedisPlan | None = None,
    ports: LocalPorts | None = None,
) -> list[ServiceSpec]:
    """Services in start order for one machine (loopback addresses, one port each). With
    several schedulers the first leads and the others stand by (leader lease in Redis). With
    `redis`, the embedded Redis is the first service (supervised like the others) and
    `redis_url` is ignored."""
    if redis is not None:
        redis_url = redis.url
    ports = ports or LocalPorts()
    executors = [
        (name, f"{host}:{ports.executor(i)}")
        for i, name in enumerate(executor_names(num_executors))
    ]
    specs = [redis_spec(redis)] if redis is not None else []
    specs += [
        ServiceSpec(
            "predictor",
            ("predictor", "serve"),
            {"ALISE_PREDICTOR_HOST": host, "ALISE_PREDICTOR_PORT": str(ports.predictor)},
            ("grpc", f"{host}:{ports.predictor}"),
        )
    ]
    for i, (name, address) in enumerate(executors):
        specs.append(
            ServiceSpec(
                name,
                ("executor", "serve"),
                {"ALISE_EXECUTOR_HOST": host, "ALISE_EXECUTOR_PORT": str(ports.executor(i))},
                ("grpc", address),
            )
        )
    schedulers = [f"{host}:{port}" for port in ports.schedulers(num_schedulers)]
    for name, address in zip(scheduler_names(num_schedulers), schedulers):
        specs.append(
            ServiceSpec(
                name,
                ("scheduler", "serve"),
                {
                    "ALISE_SCHEDULER_HOST": host,
                    "ALISE_SCHEDULER_PORT": address.rsplit(":", 1)[1],
                    "ALISE_EXECUTORS": ",".join(a for _, a in executors),
                    "ALISE_REDIS_URL": redis_url,
                },
                ("grpc", address),
                tuple(n for n, _ in executors) + (("redis",) if redis is not None else ()),
            )
        )
    predictor = f"{host}:{ports.predictor}"
    specs.append(_gateway_spec(host, gateway_host, gateway_port, schedulers, predictor, redis_url))
    return specs


def _gateway_spec(
    host: str,
    gateway_host: str,
    gateway_port: int,
    schedulers: list[str],
    predictor: str,
    redis_url: str,
) -> ServiceSpec:
    """The gateway: listens on gateway_host, reaches the scheduler and predictor on host (and
    Redis, for stored Responses); its health URL uses host when it listens on all
    interfaces."""
    return ServiceSpec(
        "gateway",
        ("gateway", "serve"),
        {
            "ALISE_GATEWAY_HOST": gateway_host,
            "ALISE_GATEWAY_PORT": str(gateway_port),
            "ALISE_SCHEDULER_ADDRESS": ",".join(schedulers),
            "ALISE_PREDICTOR_ADDRESSES": predictor,
            "ALISE_REDIS_URL": redis_url,
        },
        (
            "http",
            f"http://{host if gateway_host in ('0.0.0.0', '') else gateway_host}:"
            f"{gateway_port}/health",
        ),
        ("scheduler", "predictor"),
    )
