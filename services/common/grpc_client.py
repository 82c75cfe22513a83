"""Client channel helpers: timeouts, retries for idempotent calls, round-robin over replicas.

`make_target(["h1:1", "h2:2"])` gives one channel that balances over several static
addresses; a single DNS name (`dns:///predictor:50052`) balances over every address it
resolves to, which is how `docker compose --scale predictor=N` replicas are found.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
]


def make_target(addresses: Sequence[str]) -> str:
    """One gRPC target for one or several `host:port` addresses (or a `dns:///` name)."""
    if not addresses:
        raise ValueError("no address given")
    if len(addresses) == 1:
        addr = addresses[0]
        return addr if "://" in addr or addr.startswith(("unix:", "ipv4:", "ipv6:")) \
            else f"dns:///{addr}"
    if any("://" in a for a in addresses):
        raise ValueError("several addresses must all be plain host:port")
    return "ipv4:" + ",".join(addresses)


def service_config(idempotent_services: Sequence[str] = (), max_attempts: int = 3) -> str:
    """Round-robin balancing, plus retries on UNAVAILABLE for the named (idempotent) services."""
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}]}
    if idempotent_services:
        config["methodConfig"] = [{
            "name": [{"service": s} for s in idempotent_services],
            "retryPolicy": {
                "maxAttempts": max_attempts,
                "initialBackoff": "0.05s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
    return json.dumps(config)


def aio_channel(addresses: Sequence[str] | str,
                idempotent_services: Sequence[str] = ()) -> grpc.aio.Channel:
    if isinstance(addresses, str):
        addresses = [addresses]
    options = CHANNEL_OPTIONS + [("grpc.service_config", service_config(idempotent_services))]
    return grpc.aio.insecure_channel(make_target(addresses), options=options)


def sync_channel(addresses: Sequence[str] | str,
                 idempotent_services: Sequence[str] = ()) -> grpc.Channel:
    if isinstance(addresses, str):
        addresses = [addresses]
    options = CHANNEL_OPTIONS + [("grpc.service_config", service_config(idempotent_services))]
    return grpc.insecure_channel(make_target(addresses), options=options)


async def check_health(channel: grpc.aio.Channel, service: str = "",
                       timeout: float = 2.0) -> bool:
    """True when the server reports SERVING for `service` ("" = the whole server)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_health_sync(address: str, service: str = "", timeout: float = 2.0) -> bool:
    with sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
