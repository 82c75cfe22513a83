"""Token events from a scheduler, batched: one `Subscribe` stream per scheduler connection.

The scheduler sends one `EventBatch` per Redis commit carrying the new events of every request
this gateway attached (services/scheduler/subscriptions.py), instead of one message per
request and token. `EventMux` keeps that stream open (opening it again after it breaks) and
routes each event to its request's `BatchedCall`.

A scheduler without `Subscribe` (an older version, during an upgrade) answers it
UNIMPLEMENTED: the request then takes a plain Generate call, its events on it.

A `BatchedCall` is what `Upstream.generate` returns in this mode, and behaves as the
per-request Generate call does for `Generation`: it sends `Generate` naming the subscription
(refusals, acceptance and the request's end come on that call; it carries no events), and
`read()` returns the request's events from the subscription, then EOF after the final event.
When the subscription breaks (the scheduler died or stopped), or the Generate call fails
(e.g. the scheduler lost its leadership), `read()` raises that error and the generation
re-attaches with `resume_from` as usual: the scheduler sends events only after their commit,
from the cursor the re-attach names, so nothing is repeated or lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.grpc_client import SUBSCRIBED_KEY
from services.common.pb import scheduler_pb2, scheduler_pb2_grpc


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Subscription:
    """One open Subscribe stream and the requests routed from it."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.id = uuid.uuid4().hex
        self.call = stub.Subscribe(scheduler_pb2.SubscribeRequest(subscription=self.id))
        self.routes: dict[str, BatchedCall] = {}
        self.error: grpc.aio.AioRpcError | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Wait until the scheduler says it is open; its error when it refused or failed."""
        metadata = await self.call.initial_metadata()
        if not any(key == SUBSCRIBED_KEY for key, _ in metadata or ()):
            code = await self.call.code()
            raise grpc.aio.AioRpcError(
                code, metadata, await self.call.trailing_metadata(), await self.call.details()
            )
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for batch in self.call:
                routes = self.routes
                for event in batch.events:
                    route = routes.get(event.request_id)
                    if route is not None:
                        route.deliver(event)
            error = _error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the subscription")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed the subscription")
        self.error = error
        routes, self.routes = self.routes, {}
        for route in routes.values():
            route.fail(error)

    def close(self) -> None:
        self.call.cancel()
        if self.task is not None:
            self.task.cancel()


class EventMux:
    """The subscription to one scheduler (opened on first use, again after it broke)."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.stub = stub
        self._current: _Subscription | None = None
        self._opening: asyncio.Future[_Subscription] | None = None

    async def subscription(self) -> _Subscription:
        """An open subscription; raises the scheduler's error when none can be opened."""
        current = self._current
        if current is not None and current.error is None:
            return current
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> _Subscription:
        try:
            subscription = _Subscription(self.stub)
            try:
                await subscription.open()
            except BaseException:
                subscription.close()
                raise
            if self._current is not None:
                self._current.close()
            self._current = subscription
            return subscription
        finally:
            self._opening = None

    async def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            with contextlib.suppress(BaseException):
                await self._opening
        if self._current is not None:
            self._current.close()
            if self._current.task is not None:
                with contextlib.suppress(BaseException):
                    await self._current.task
            self._current = None


class BatchedCall:
    """One request's Generate with its events from the subscription: the subset of a
    Generate call's interface that `Generation` uses (read, cancel, done, code, details,
    trailing_metadata, initial_metadata, async iteration)."""

    def __init__(
        self,
        mux: EventMux,
        stub: scheduler_pb2_grpc.SchedulerStub,
        request: scheduler_pb2.GenerateRequest,
        timeout: float | None,
    ) -> None:
        self.request_id = request.request_id
        self._events: deque[scheduler_pb2.TokenEvent] = deque()
        self._wake = asyncio.Event()
        self._error: grpc.aio.AioRpcError | None = None  # failed before Generate, or broke
        self._ended = False  # the final event was read
        self._call: Any = None  # the Generate call (grpc's UnaryStreamCall)
        self._subscription: _Subscription | None = None
        self._plain = False  # the scheduler has no Subscribe: a plain Generate call
        self._next_index = request.resume_from  # the output index the next event must have
        self._final_queued = False
        self._starting = asyncio.ensure_future(self._start(mux, stub, request, timeout))

    async def _start(
        self,
        mux: EventMux,
        stub: scheduler_pb2_grpc.SchedulerStub,
        request: scheduler_pb2.GenerateRequest,
        timeout: float | None,
    ) -> None:
        try:
            subscription = await mux.subscription()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a scheduler without Subscribe
                self._plain = True  # (an older version, mid-upgrade): events on the call
                self._call = stub.Generate(request, timeout=timeout)
                return
            self._error = exc
            return
        # routed before Generate: the scheduler attaches the request only when it accepts it
        subscription.routes[self.request_id] = self
        self._subscription = subscription
        if subscription.error is not None:
            self.fail(subscription.error)
        request.subscription = subscription.id
        self._call = stub.Generate(request, timeout=timeout)
        self._call.add_done_callback(lambda _call: self._wake.set())

    # -- the subscription's side ------------------------------------------------------------
    def deliver(self, event: scheduler_pb2.TokenEvent) -> None:
        """Queue the next event. After a re-attach on the same subscription, events the
        previous attachment sent may still arrive (the same tokens, from the same log), before
        or while the new attachment replays from its resume index in order: a token that is
        not the next index is dropped (a repeat, or one racing ahead of the replay, which
        sends it again in its place), and so is a final event that follows more tokens than
        were queued (its index is the number of tokens before it)."""
        if event.finished:
            if self._final_queued or event.index > self._next_index:  # index: tokens before it
                return
            self._final_queued = True
        elif event.index != self._next_index:
            return
        else:
            self._next_index = event.index + 1
        self._events.append(event)
        self._wake.set()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._error is None:
            self._error = error
        self._wake.set()

    def _leave(self) -> None:
        subscription = self._subscription
        if subscription is not None and subscription.routes.get(self.request_id) is self:
            del subscription.routes[self.request_id]

    # -- what Generation uses ---------------------------------------------------------------
    async def read(self) -> scheduler_pb2.TokenEvent | Any:
        """The next event, `grpc.aio.EOF` after the final one; raises when the subscription
        broke or the Generate call failed (events received before are returned first)."""
        await self._starting
        if self._plain:
            return await self._call.read()
        while True:
            if self._events:
                event = self._events.popleft()
                if event.finished:
                    self._ended = True
                    self._leave()
                return event
            if self._ended:
                return grpc.aio.EOF
            if self._error is not None:
                self._leave()
                raise self._error
            if self._call.done():
                code = await self._call.code()
                if code != grpc.StatusCode.OK:
                    self._leave()
                    raise grpc.aio.AioRpcError(
                        code,
                        await self._call.initial_metadata(),
                        await self._call.trailing_metadata(),
                        await self._call.details(),
                    )
                # ended with the request: its final event is on its way
            self._wake.clear()
            await self._wake.wait()

    async def __aiter__(self) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        while (event := await self.read()) is not grpc.aio.EOF:
            yield event

    def cancel(self) -> bool:
        self._leave()
        if not self._starting.done():
            self._starting.cancel()
            return True
        return self._call.cancel() if self._call is not None else False

    def done(self) -> bool:
        if not self._starting.done():
            return False
        return self._call is None or self._call.done()

    async def initial_metadata(self) -> grpc.aio.Metadata:
        await self._starting
        if self._call is None:
            return grpc.aio.Metadata()
        return await self._call.initial_metadata()

    async def code(self) -> grpc.StatusCode:
        await self._starting
        if self._call is None:
            return self._failure().code()
        return await self._call.code()

    async def details(self) -> str:
        await self._starting
        if self._call is None:
            return self._failure().details() or ""
        return await self._call.details()

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await self._starting
        if self._call is None:
            return self._failure().trailing_metadata() or grpc.aio.Metadata()
        return await self._call.trailing_metadata()

    def _failure(self) -> grpc.aio.AioRpcError:
        return self._error or _error(grpc.StatusCode.CANCELLED, "cancelled before it was sent")
