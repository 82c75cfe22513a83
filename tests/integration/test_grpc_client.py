"""Client channel helpers against real gRPC servers on loopback: targets for host names and
IPv6 literals, round-robin over replicas, retries on UNAVAILABLE and the default deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_client import (
    aio_channel,
    check_health,
    make_target,
    service_config,
    split_host_port,
    sync_channel,
)
from services.common.grpc_server import ServiceError, start_server
from services.common.pb import predictor_pb2, predictor_pb2_grpc
from services.common.redis_runner import free_port

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
PREDICTOR = "alise.v1.Predictor"


class CountingInterceptor(grpc.aio.ServerInterceptor):
    """Counts the calls a server receives, by method (every attempt of a retried call)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def intercept_service(self, continuation, handler_call_details):
        self.calls[handler_call_details.method] += 1
        return await continuation(handler_call_details)


class FlakyPredictor(predictor_pb2_grpc.PredictorServicer):
    """Answers UNAVAILABLE to its first `failures` Predicts, then a prediction; or sleeps
    `delay_s` before answering."""

    def __init__(self, failures: int = 0, delay_s: float = 0.0) -> None:
        self.failures = failures
        self.delay_s = delay_s
        self.attempts = 0

    async def Predict(self, request, context):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "warming up")
        await asyncio.sleep(self.delay_s)
        return predictor_pb2.PredictResponse(predictions=[{"length": 7, "source": "prior"}])


async def health_server(host: str = "127.0.0.1"):
    counter = CountingInterceptor()
    server = await start_server([], f"{host}:0", interceptors=[counter])
    return server, counter


async def predictor_server(servicer: FlakyPredictor):
    return await start_server(
        [(predictor_pb2_grpc.add_PredictorServicer_to_server, servicer, PREDICTOR)], "127.0.0.1:0"
    )


def predict_request() -> predictor_pb2.PredictRequest:
    return predictor_pb2.PredictRequest(model="m", prompts=["hello"])


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_targets_for_names_literals_and_bad_addresses():
    assert make_target(["localhost:5001"]) == "dns:///localhost:5001"  # left to gRPC
    assert make_target(["dns:///predictor:50052"]) == "dns:///predictor:50052"
    assert make_target(["localhost:5001", "127.0.0.1:5002"]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert make_target(["[::1]:5001", "[::1]:5002"]) == "ipv6:[::1]:5001,[::1]:5002"
    # A name that does not resolve is left out; when none does, the first is left to gRPC.
    assert make_target(["localhost:5001", "nowhere.invalid:5002"]) == "ipv4:127.0.0.1:5001"
    assert make_target(["a.invalid:1", "b.invalid:2"]) == "dns:///a.invalid:1"
    assert split_host_port("[::1]:80") == ("::1", 80)
    for bad in ("::1:80", "host", "host:0", "[::1]", "host:http"):
        with pytest.raises(ValueError):
            split_host_port(bad)
    with pytest.raises(ValueError):
        make_target(["dns:///a:1", "b:2"])
    with pytest.raises(ValueError):
        make_target([])


def test_service_config_retries_named_services_only():
    config = json.loads(service_config([PREDICTOR], max_attempts=4))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": PREDICTOR}]
    assert method["retryPolicy"]["maxAttempts"] == 4
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert "timeout" not in method  # grpcio applies that one early; see the module
    assert "methodConfig" not in json.loads(service_config())
    with pytest.raises(ValueError):
        aio_channel("localhost:1", [PREDICTOR], timeout_s=0)


async def test_round_robin_over_two_servers_named_by_host_name():
    (a, count_a), (b, count_b) = await health_server(), await health_server()
    try:
        async with aio_channel([f"localhost:{a.port}", f"localhost:{b.port}"]) as channel:
            assert all([await check_health(channel) for _ in range(40)])
        # Round-robin alternates once both are connected; the first calls may all go to the
        # replica that connected first.
        assert count_a.calls[HEALTH_CHECK] + count_b.calls[HEALTH_CHECK] == 40
        assert count_a.calls[HEALTH_CHECK] >= 10 and count_b.calls[HEALTH_CHECK] >= 10
    finally:
        await a.stop(0)
        await b.stop(0)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_round_robin_over_ipv6_literals():
    (a, count_a), (b, count_b) = await health_server("[::1]"), await health_server("[::1]")
    try:
        async with aio_channel([f"[::1]:{a.port}", f"[::1]:{b.port}"]) as channel:
            assert all([await check_health(channel) for _ in range(20)])
        assert count_a.calls[HEALTH_CHECK] >= 4 and count_b.calls[HEALTH_CHECK] >= 4
    finally:
        await a.stop(0)
        await b.stop(0)


async def test_a_replica_that_is_down_costs_no_failed_calls():
    up, count = await health_server()
    try:
        addresses = [f"127.0.0.1:{free_port()}", f"localhost:{up.port}"]  # first: closed
        async with aio_channel(addresses) as channel:
            assert all([await check_health(channel) for _ in range(20)])
        assert count.calls[HEALTH_CHECK] == 20
    finally:
        await up.stop(0)


def sync_check(addresses: list[str]) -> int:
    with sync_channel(addresses) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return sum(
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
            for _ in range(10)
        )


async def test_sync_channel_with_host_names():
    (a, count_a), (b, count_b) = await health_server(), await health_server()
    try:
        addresses = [f"localhost:{a.port}", f"localhost:{b.port}", "nowhere.invalid:1"]
        assert await asyncio.to_thread(sync_check, addresses) == 10
        assert count_a.calls[HEALTH_CHECK] >= 1 and count_b.calls[HEALTH_CHECK] >= 1
    finally:
        await a.stop(0)
        await b.stop(0)


async def test_unavailable_is_retried_for_named_services_only():
    flaky = FlakyPredictor(failures=1)
    server = await predictor_server(flaky)
    address = f"localhost:{server.port}"
    try:
        async with aio_channel(address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await predictor_pb2_grpc.PredictorStub(plain).Predict(predict_request(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and flaky.attempts == 1

        flaky.attempts = 0
        async with aio_channel(address, idempotent_services=[PREDICTOR]) as retrying:
            reply = await predictor_pb2_grpc.PredictorStub(retrying).Predict(
                predict_request(), timeout=5
            )
            assert reply.predictions[0].length == 7 and flaky.attempts == 2

            flaky.attempts, flaky.failures = 0, 10  # more failures than the 3 attempts
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await predictor_pb2_grpc.PredictorStub(retrying).Predict(
                    predict_request(), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and flaky.attempts == 3
    finally:
        await server.stop(0)


def sync_predict_seconds(address: str, timeout: float | None) -> tuple[grpc.StatusCode, float]:
    with sync_channel(address, idempotent_services=[PREDICTOR], timeout_s=0.3) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            predictor_pb2_grpc.PredictorStub(channel).Predict(predict_request(), timeout=timeout)
        return info.value.code(), time.monotonic() - started


async def test_default_deadline_only_for_calls_that_set_none():
    server = await predictor_server(FlakyPredictor(delay_s=30.0))
    address = f"127.0.0.1:{server.port}"
    try:
        async with aio_channel(address, idempotent_services=[PREDICTOR], timeout_s=0.3) as channel:
            stub = predictor_pb2_grpc.PredictorStub(channel)
            for call_timeout, low, high in (
                (None, 0.29, 1.5),
                (0.05, 0.04, 0.29),
                (1.0, 0.99, 2.5),
            ):  # a call's own one is kept
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Predict(predict_request(), timeout=call_timeout)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert low <= time.monotonic() - started < high, call_timeout
        code, seconds = await asyncio.to_thread(sync_predict_seconds, address, None)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.29 <= seconds < 1.5
    finally:
        await server.stop(0)
