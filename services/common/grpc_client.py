"""Client channel helpers: timeouts, retries for idempotent calls, round-robin over replicas.

Targets. One address goes to gRPC as `dns:///host:port`: gRPC resolves it itself, re-resolves
it when connections drop, and balances over every address it resolves to, which is how
`docker compose --scale predictor=N` replicas behind one service name are found.

Several addresses (`predictor-1:50052,predictor-2:50052`, `localhost:A,localhost:B`) cannot go
through gRPC's resolver: a `dns:` target names one host, and the only schemes that take a list,
`ipv4:` and `ipv6:`, take IP literals (a host name there fails every call). So `make_target`
resolves each host with `getaddrinfo` when the channel is built and hands gRPC the literals.
gRPC's own round_robin policy then balances over them and picks only replicas it is connected
to, so a replica that is down costs no failed calls. That is why this was chosen over one
channel per address with a round-robin in Python, which would re-resolve names but send every
N-th call to a dead replica. The price: names in a list are resolved once. A replica that comes
back under a new IP is found only when the channel is rebuilt (a restart of the client); for
replicas whose addresses move, give one DNS name instead.

Timeouts. Unary calls to the services named as idempotent that set no deadline of their own
get `DEFAULT_TIMEOUT_S`, so a call that forgot its `timeout=` cannot hang on a stuck server;
calls that pass one keep it. This is a client interceptor, not the service config's `timeout`
field: grpcio applies that one about 1-1.5 s early (grpc/grpc#34547, #40633; measured here
with 1.85: a 2 s config timeout expired after 0.5-0.7 s, 0.3 s and 1 s ones at once).
Streaming calls get no default (a Generate stream lives as long as its request).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.internal_auth import (
    CallDetails,
    SyncTokenAdder,
    aio_token_interceptors,
    internal_token,
)

log = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

ChannelOptions = list[tuple[str, int | str]]

CHANNEL_OPTIONS: ChannelOptions = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
]

DEFAULT_TIMEOUT_S = 30.0
_SCHEMES = ("unix:", "ipv4:", "ipv6:", "dns:")


# Initial metadata a scheduler sends when it accepts a Generate (or a re-attach): a call that
# fails after it was accepted is resumed, one that fails before is submitted again.
ACCEPTED_KEY = "alise-accepted"
# Initial metadata of a scheduler's Subscribe stream: the subscription is open (Generate
# calls may name it from then on).
SUBSCRIBED_KEY = "alise-subscribed"
# The scheduler's gRPC service: its health is SERVING only on the leading scheduler (a standby
# reports the overall status "" SERVING).
SCHEDULER_SERVICE = "alise.v1.Scheduler"
# Readiness of a leading scheduler, one health name per dependency, so a caller can say why
# it is not ready: SERVING while it reaches Redis / while some executor is up.
SCHEDULER_REDIS = "alise.v1.Scheduler.redis"
SCHEDULER_EXECUTORS = "alise.v1.Scheduler.executors"


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[ipv6]:port` -> (host without brackets, port)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = address.rpartition(":")
        if ":" in host:  # a bare IPv6 literal: its port is ambiguous without brackets
            host = ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port or [ipv6]:port, got {address!r}")
    return host, int(port)


def _resolve(address: str) -> tuple[list[str], list[str]]:
    """Every IPv4 and IPv6 `ip:port` literal (gRPC URI form) that `address` resolves to."""
    host, port = split_host_port(address)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = [f"{sa[0]}:{port}" for family, *_, sa in infos if family == socket.AF_INET]
    v6 = [f"[{sa[0]}]:{port}" for family, *_, sa in infos if family == socket.AF_INET6]
    return list(dict.fromkeys(v4)), list(dict.fromkeys(v6))


def _static_target(addresses: Sequence[str]) -> str:
    """`ipv4:` (or `ipv6:`) target with the literals of every address that resolves.

    One target holds one family: IPv4 when every resolved host has an IPv4 address (loopback
    servers usually listen on 127.0.0.1), else IPv6 when every one has IPv6, else the family
    that covers more hosts (the others are left out, with a warning). Hosts that do not resolve
    are left out with a warning; when none resolves, the channel falls back to the first one as
    a `dns:` target, which gRPC keeps resolving, so calls fail (UNAVAILABLE) instead of the
    client failing to start.
    """
    resolved: list[tuple[str, list[str], list[str]]] = []
    for address in addresses:
        try:
            resolved.append((address, *_resolve(address)))
        except OSError as exc:
            log.warning(
                "gRPC address %s does not resolve (%s); left out of the channel", address, exc
            )
    if not resolved:
        log.warning("no gRPC address of %s resolves; using %s alone", list(addresses), addresses[0])
        return f"dns:///{addresses[0]}"
    with_v4 = [r for r in resolved if r[1]]
    with_v6 = [r for r in resolved if r[2]]
    if len(with_v4) >= len(with_v6):
        scheme, chosen, literals = "ipv4:", with_v4, [lit for r in with_v4 for lit in r[1]]
    else:
        scheme, chosen, literals = "ipv6:", with_v6, [lit for r in with_v6 for lit in r[2]]
    for address, *_ in resolved:
        if all(address != c[0] for c in chosen):
            log.warning(
                "gRPC address %s has no %s address; left out of the channel", address, scheme[:-1]
            )
    return scheme + ",".join(dict.fromkeys(literals))


def make_target(addresses: Sequence[str]) -> str:
    """One gRPC target for one or several `host:port` addresses (or one `dns:///` name).

    Several addresses are resolved now (see the module docstring); one is left to gRPC."""
    if not addresses:
        raise ValueError("no address given")
    if len(addresses) == 1:
        addr = addresses[0]
        return addr if "://" in addr or addr.startswith(_SCHEMES) else f"dns:///{addr}"
    if any("://" in a or a.startswith(_SCHEMES) for a in addresses):
        raise ValueError("several addresses must all be plain host:port")
    return _static_target(addresses)


def service_config(idempotent_services: Sequence[str] = (), max_attempts: int = 3) -> str:
    """Round-robin balancing, plus retries on UNAVAILABLE for the named (idempotent) services."""
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if idempotent_services:
        config["methodConfig"] = [
            {
                "name": [{"service": s} for s in idempotent_services],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def _method_prefixes(services: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"/{s}/" for s in services)


def _needs_default(
    details: grpc.ClientCallDetails | grpc.aio.ClientCallDetails, prefixes: tuple[str, ...]
) -> bool:
    method: str | bytes = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return details.timeout is None and method.startswith(prefixes)


# grpc is untyped for mypy here (pyproject override), so its classes are Any: subclassing one
# needs the ignores below.
class _AioDefaultTimeout(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Gives unary calls to the named services `timeout_s` when they set no deadline."""

    def __init__(self, services: Sequence[str], timeout_s: float) -> None:
        self.prefixes = _method_prefixes(services)
        self.timeout_s = timeout_s

    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, _Req], Awaitable[grpc.aio.UnaryUnaryCall[_Req, _Resp]]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request: _Req,
    ) -> grpc.aio.UnaryUnaryCall[_Req, _Resp]:
        if _needs_default(client_call_details, self.prefixes):
            client_call_details = client_call_details._replace(timeout=self.timeout_s)
        return await continuation(client_call_details, request)


class _SyncDefaultTimeout(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The blocking-channel twin of `_AioDefaultTimeout`."""

    def __init__(self, services: Sequence[str], timeout_s: float) -> None:
        self.prefixes = _method_prefixes(services)
        self.timeout_s = timeout_s

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Req], grpc.Future],
        client_call_details: grpc.ClientCallDetails,
        request: _Req,
    ) -> grpc.Future:
        if _needs_default(client_call_details, self.prefixes):
            d = client_call_details
            client_call_details = CallDetails(
                d.method,
                self.timeout_s,
                d.metadata,
                d.credentials,
                getattr(d, "wait_for_ready", None),
                getattr(d, "compression", None),
            )
        return continuation(client_call_details, request)


def _target_and_options(
    addresses: Sequence[str] | str, idempotent_services: Sequence[str]
) -> tuple[str, ChannelOptions]:
    if isinstance(addresses, str):
        addresses = [addresses]
    config = service_config(idempotent_services)
    return make_target(addresses), CHANNEL_OPTIONS + [("grpc.service_config", config)]


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds or None, got {timeout_s}")


def aio_channel(
    addresses: Sequence[str] | str,
    idempotent_services: Sequence[str] = (),
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> grpc.aio.Channel:
    """A channel over `addresses`; the named services' unary calls are retried on UNAVAILABLE
    and get `timeout_s` when they set no deadline (None = no default)."""
    _check_timeout(timeout_s)
    target, options = _target_and_options(addresses, idempotent_services)
    interceptors: list[grpc.aio.ClientInterceptor] = (
        [_AioDefaultTimeout(idempotent_services, timeout_s)]
        if idempotent_services and timeout_s is not None
        else []
    )
    interceptors += aio_token_interceptors()
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors or None)


def sync_channel(
    addresses: Sequence[str] | str,
    idempotent_services: Sequence[str] = (),
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> grpc.Channel:
    """The blocking twin of `aio_channel`."""
    _check_timeout(timeout_s)
    target, options = _target_and_options(addresses, idempotent_services)
    channel = grpc.insecure_channel(target, options=options)
    if idempotent_services and timeout_s is not None:
        channel = grpc.intercept_channel(
            channel, _SyncDefaultTimeout(idempotent_services, timeout_s)
        )
    if token := internal_token():
        channel = grpc.intercept_channel(channel, SyncTokenAdder(token))
    return channel


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout: float = 2.0) -> bool:
    """True when the server reports SERVING for `service` ("" = the whole server)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def check_health_sync(address: str, service: str = "", timeout: float = 2.0) -> bool:
    """The blocking twin of `check_health`, on a channel of its own to `address`."""
    with sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
