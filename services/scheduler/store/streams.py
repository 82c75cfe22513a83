"""Per-request token streams: a durable, append-only event log with any number of readers.

The loop never waits on a client: publishing appends to the request's log (bounded by the
request's `max_tokens`) and wakes readers. Each reader keeps its own cursor into the log, so a
slow client only falls behind, it never fills a buffer or blocks anyone, and a client that
re-attaches with `resume_from` reads the same log from that index: no duplicates, no gaps.
Only tokens already committed to Redis are published (the store writer publishes after commit).
A reader is either a `Generate` call of its own (`events`: one message per token) or an
attachment to a client's subscription (subscriptions.py: every attached request's new events
in one message per commit); a publish wakes per-request readers only while one waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from services.common.grpc_server import ServiceError
from services.common.pb import common_pb2, scheduler_pb2


class StreamListener(Protocol):
    """Told when a stream has news (subscriptions.py's Subscription)."""

    def changed(self, stream: RequestStream) -> None: ...


class RequestStream:
    def __init__(
        self,
        request_id: str,
        tokens: list[tuple[int, float, float]] | None = None,
        prediction: common_pb2.Prediction | None = None,
    ) -> None:
        self.request_id = request_id
        self.tokens: list[tuple[int, float, float]] = list(tokens or [])  # (id, logprob, time)
        self.tops: dict[int, list] = {}  # output index -> its top_logprobs (TopLogprob)
        self.prompt: dict[int, common_pb2.PromptLogprob] = {}  # prompt position -> logprob
        self.final: scheduler_pb2.TokenEvent | None = None
        self.prediction = prediction
        self.readers = 0
        self.abandoned = False  # the scheduler lost its leadership: readers must re-attach
        self.listeners: set[StreamListener] = set()  # subscriptions it is attached to
        self._wake: asyncio.Event | None = None  # set while a per-request reader waits
        self._end = asyncio.Event()  # the final event is in, or the stream was abandoned

    @property
    def done(self) -> bool:
        return self.final is not None

    def publish(
        self, start: int, items: list[tuple[int, float, float]], tops: dict | None = None
    ) -> None:
        """Append tokens `start..start+len(items)-1`; ones already in the log are skipped.
        `tops`: output index -> that token's top_logprobs alternatives."""
        if self.final is not None:
            return
        if start > len(self.tokens):
            raise ValueError(
                f"{self.request_id}: token {start} published after {len(self.tokens)} tokens (gap)"
            )
        skip = len(self.tokens) - start
        if skip < len(items):
            self.tokens.extend(items[skip:])
            if tops:
                self.tops.update(tops)
            self._notify()

    def add_prompt_logprobs(self, start: int, entries: list[common_pb2.PromptLogprob]) -> None:
        """Prompt positions start.. (a recomputed chunk simply computes them again)."""
        self.prompt.update(enumerate(entries, start))

    def finish(self, event: scheduler_pb2.TokenEvent) -> None:
        """Publish the final event (only the first one counts)."""
        if self.final is None:
            self.final = event
            self._end.set()
            self._notify()

    def abandon(self) -> None:
        """End every reader that has caught up with UNAVAILABLE (they re-attach elsewhere)."""
        self.abandoned = True
        self._end.set()
        self._notify()

    async def ended(self) -> None:
        """Wait for the final event (or the stream's abandonment); not woken by tokens."""
        await self._end.wait()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None
        for subscription in self.listeners:
            subscription.changed(self)

    async def _wait(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        await self._wake.wait()

    def fill_event(self, event: scheduler_pb2.TokenEvent, index: int) -> None:
        """Write token `index`'s event into `event` (a fresh message)."""
        token_id, logprob, t = self.tokens[index]
        event.request_id = self.request_id
        event.index = index
        event.token_id = token_id
        event.logprob = logprob
        event.time = t
        if index in self.tops:
            event.top_logprobs.extend(self.tops[index])
        if index == 0 and self.prompt:
            event.prompt_logprobs.extend(self.prompt[p] for p in sorted(self.prompt))

    def _event(self, index: int) -> scheduler_pb2.TokenEvent:
        event = scheduler_pb2.TokenEvent()
        self.fill_event(event, index)
        return event

    async def events(self, start: int = 0) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """Token events from output index `start`, then the final event; ends after it."""
        cursor, first = start, True
        self.readers += 1
        try:
            while True:
                while cursor < len(self.tokens):
                    event = self._event(cursor)
                    if first and self.prediction is not None:
                        event.prediction.CopyFrom(self.prediction)
                    first = False
                    cursor += 1
                    yield event
                if self.final is not None:
                    final = scheduler_pb2.TokenEvent()
                    final.CopyFrom(self.final)
                    if first and self.prediction is not None:
                        final.prediction.CopyFrom(self.prediction)
                    yield final
                    return
                if self.abandoned:
                    raise ServiceError(
                        grpc.StatusCode.UNAVAILABLE,
                        "this scheduler is no longer the leader; re-attach with resume_from",
                    )
                await self._wait()
        finally:
            self.readers -= 1


def final_event(
    request_id: str, n_out: int, finish_reason: str, usage: scheduler_pb2.Usage, error: str = ""
) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(
        request_id=request_id,
        index=n_out,
        finished=True,
        finish_reason=finish_reason,
        usage=usage,
        error=error,
    )
