"""A real aio gRPC server on loopback: health, reflection and error mapping."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.grpc_client import aio_channel, check_health
from services.common.grpc_server import ServiceError, start_server, status_for
from services.common.pb import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class FailingExecutor(executor_pb2_grpc.ExecutorServicer):
    async def Describe(self, request, context):
        raise ValueError("bad describe")

    async def Step(self, request, context):
        if request.step_id == 1:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        if request.step_id == 2:
            raise KeyError("no such request")
        if request.step_id == 3:
            raise RuntimeError("boom")
        return executor_pb2.StepResult(step_id=request.step_id)


class StreamingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def Generate(self, request, context):
        yield scheduler_pb2.TokenEvent(request_id=request.request_id, index=0, token_id=5)
        raise ValueError("stream broke")


@pytest.fixture
async def server():
    srv = await start_server(
        [
            (
                executor_pb2_grpc.add_ExecutorServicer_to_server,
                FailingExecutor(),
                "alise.v1.Executor",
            ),
            (
                scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                StreamingScheduler(),
                "alise.v1.Scheduler",
            ),
        ],
        "127.0.0.1:0",
    )
    yield srv
    await srv.stop(0)


async def test_health_serving_then_not(server):
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        # connected first: check_health's 2 s bound covers connecting, which a loaded
        # machine once stretched past it (seen once in make test)
        await asyncio.wait_for(channel.channel_ready(), 30)
        assert await check_health(channel)
        assert await check_health(channel, "alise.v1.Executor")
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await server.set_serving(False)
        assert not await check_health(channel, "alise.v1.Executor")


async def test_reflection_lists_services(server):
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for reply in stub.ServerReflectionInfo(requests()):
            names = [s.name for s in reply.list_services_response.service]
        assert {"alise.v1.Executor", "alise.v1.Scheduler", "grpc.health.v1.Health"} <= set(names)


@pytest.mark.parametrize(
    "step_id,code",
    [
        (1, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (2, grpc.StatusCode.NOT_FOUND),
        (3, grpc.StatusCode.INTERNAL),
    ],
)
async def test_interceptor_maps_errors(server, step_id, code):
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(executor_pb2.StepRequest(step_id=step_id))
        assert info.value.code() == code
        ok = await stub.Step(executor_pb2.StepRequest(step_id=9))
        assert ok.step_id == 9


async def test_interceptor_maps_value_error_and_stream_errors(server):
    async with aio_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad describe" in info.value.details()
        events = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for event in scheduler_pb2_grpc.SchedulerStub(channel).Generate(
                scheduler_pb2.GenerateRequest(request_id="r1")
            ):
                events.append(event)
        assert [e.token_id for e in events] == [5]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_status_for_timeout():
    assert status_for(TimeoutError())[0] == grpc.StatusCode.DEADLINE_EXCEEDED
