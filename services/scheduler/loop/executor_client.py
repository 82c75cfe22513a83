"""Async client of one executor: Describe and Step with timeouts, fast reconnects.

The loop's Steps go over one long-lived `StepStream` (a message on an open stream costs about
half a unary call's round trip: 0.67 against 1.27 ms p50 on this machine between steps 25 ms
apart). Steps may be pipelined: `start_step` writes the next Step while earlier ones still run
(the executor queues it and starts it as soon as the previous one ends), and results are read
back in order. Any failure of a streamed Step (an error status, a timeout, the executor ending
the stream) drops the stream, so a late reply can never be read as another Step's, and every
Step still waiting on that stream fails too; the next Step opens a new one. `step()` stays a
unary call for one-off Steps.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.grpc_client import CHANNEL_OPTIONS
from services.common.internal_auth import aio_token_interceptors
from services.common.pb import executor_pb2, executor_pb2_grpc

# A restarted executor must be found again within about a second, not grpc's default minutes.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class StepStreamClosed(ConnectionError):
    """The executor ended the step stream, or it broke in a way grpc reports no status for."""


class ExecutorClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address,
            options=CHANNEL_OPTIONS + RECONNECT_OPTIONS,
            interceptors=aio_token_interceptors() or None,  # ALISE_INTERNAL_TOKEN
        )
        self.stub = executor_pb2_grpc.ExecutorStub(self.channel)
        self._stream = None
        self._writing = self._reading = asyncio.Lock()  # per stream (set when one opens)
        self.epoch = 0  # the scheduler's leadership epoch, stamped on every Step (fencing)

    async def describe(self, timeout: float = 2.0) -> executor_pb2.ExecutorInfo:
        return await self.stub.Describe(executor_pb2.DescribeRequest(), timeout=timeout)

    async def step(
        self, request: executor_pb2.StepRequest, timeout: float
    ) -> executor_pb2.StepResult:
        request.epoch = self.epoch
        return await self.stub.Step(request, timeout=timeout)

    def start_step(self, request: executor_pb2.StepRequest, timeout: float) -> asyncio.Task:
        """Send a Step on the step stream (behind any still in flight); await the returned task
        for its StepResult. Raises grpc.aio.AioRpcError, TimeoutError or StepStreamClosed."""
        request.epoch = self.epoch
        if self._stream is None:
            self._stream = self.stub.StepStream()
            self._writing = asyncio.Lock()
            self._reading = asyncio.Lock()
        return asyncio.ensure_future(self._stream_step(self._stream, request, timeout))

    async def _stream_step(self, stream, request, timeout: float) -> executor_pb2.StepResult:
        # both locks are FIFO: Steps are written, then their results read, in start order
        writing, reading = self._writing, self._reading
        try:
            async with asyncio.timeout(timeout):
                async with writing:
                    self._check(stream)
                    await stream.write(request)
                async with reading:
                    self._check(stream)
                    result = await stream.read()
        except (grpc.aio.AioRpcError, TimeoutError, asyncio.CancelledError, StepStreamClosed):
            self._drop(stream)
            raise
        except Exception as exc:
            self._drop(stream)
            raise StepStreamClosed(f"step stream failed: {type(exc).__name__}: {exc}") from exc
        if result is grpc.aio.EOF:
            self._drop(stream)
            raise StepStreamClosed("the executor ended the step stream")
        return result

    def _check(self, stream) -> None:
        if self._stream is not stream:
            raise StepStreamClosed("an earlier Step on this stream failed")

    def _drop(self, stream) -> None:
        if self._stream is stream:
            self._stream = None
        stream.cancel()

    async def close(self) -> None:
        if self._stream is not None:
            self._drop(self._stream)
        await self.channel.close(grace=None)
