"""Async client of one executor: Describe and Step with timeouts, fast reconnects."""
from __future__ import annotations

import grpc

from services.common.grpc_client import CHANNEL_OPTIONS
from services.common.pb import executor_pb2, executor_pb2_grpc

# A restarted executor must be found again within about a second, not grpc's default minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ExecutorClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address,
                                                 options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)

    async def describe(self, timeout: float = 2.0) -> executor_pb2.ExecutorInfo:
        return await self.stub.Describe(executor_pb2.DescribeRequest(), timeout=timeout)

    async def step(self, request: executor_pb2.StepRequest,
                   timeout: float) -> executor_pb2.StepResult:
        return await self.stub.Step(request, timeout=timeout)

    def start_step(self, request: executor_pb2.StepRequest, timeout: float):
        """Start a Step; await the returned call for its StepResult."""
        return self.stub.Step(request, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close(grace=None)
