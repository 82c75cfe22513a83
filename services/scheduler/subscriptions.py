"""Subscriptions: one event stream per client connection, carrying the token events of every
request attached to it, batched.

A gateway opens one `Subscribe` stream per scheduler and names it in each `Generate`
(`GenerateRequest.subscription`); that request's events then go out on the subscription
instead of on its own call. Publishing a token only marks the request's attachment dirty;
the subscription's sender wakes once after the store writer has run a commit's callbacks
(every token of that commit published) and sends one `EventBatch` with the new events of
every dirty request. So a step costs one message per gateway, not one per running request.

The guarantees are those of the per-request streams (store/streams.py): events come from the
request's log of committed tokens, each attachment keeps its own cursor (from the Generate's
`resume_from`), and a request's final event is its last. An attachment ends after its final
event, when its Generate call is cancelled (the client went away), or when the request's
stream is abandoned (the Generate call then fails with UNAVAILABLE and the client
re-attaches, as it does from a per-request stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.common.pb import scheduler_pb2
from services.scheduler.store.streams import RequestStream


class Attachment:
    """One request read through a subscription: where its next event starts."""

    __slots__ = ("cursor", "first", "stream")

    def __init__(self, stream: RequestStream, cursor: int) -> None:
        self.stream = stream
        self.cursor = cursor
        self.first = True  # the next event is this reader's first: it carries the prediction


class Subscription:
    def __init__(self, subscription_id: str) -> None:
        self.id = subscription_id
        self.attached: dict[RequestStream, Attachment] = {}
        self._dirty: dict[RequestStream, None] = {}  # insertion-ordered set
        self._wake = asyncio.Event()
        self.batches_sent = 0
        self.events_sent = 0

    def attach(self, stream: RequestStream, start: int) -> Attachment:
        """Deliver `stream`'s events from output index `start` (a second attach of the same
        request replaces the first: the client re-attached)."""
        attachment = Attachment(stream, start)
        self.attached[stream] = attachment
        stream.listeners.add(self)
        self.changed(stream)
        return attachment

    def detach(self, attachment: Attachment) -> None:
        stream = attachment.stream
        if self.attached.get(stream) is attachment:
            del self.attached[stream]
            stream.listeners.discard(self)
            self._dirty.pop(stream, None)

    def close(self) -> None:
        for attachment in list(self.attached.values()):
            self.detach(attachment)

    def changed(self, stream: RequestStream) -> None:
        """`stream` has news (tokens, its final event, or abandonment): send it with the next
        batch."""
        self._dirty[stream] = None
        self._wake.set()

    def take(self) -> scheduler_pb2.EventBatch | None:
        """Every dirty attachment's new events as one batch (None: nothing new)."""
        dirty, self._dirty = self._dirty, {}
        batch = scheduler_pb2.EventBatch()
        events = batch.events
        for stream in dirty:
            attachment = self.attached.get(stream)
            if attachment is None:
                continue
            end = len(stream.tokens)
            while attachment.cursor < end:
                event = events.add()
                stream.fill_event(event, attachment.cursor)
                self._first(attachment, event)
                attachment.cursor += 1
            if stream.final is not None:
                event = events.add()
                event.CopyFrom(stream.final)
                self._first(attachment, event)
                self.detach(attachment)
            elif stream.abandoned:
                self.detach(attachment)  # its Generate call tells the client to re-attach
        if not events:
            return None
        self.batches_sent += 1
        self.events_sent += len(events)
        return batch

    @staticmethod
    def _first(attachment: Attachment, event: scheduler_pb2.TokenEvent) -> None:
        if attachment.first:
            attachment.first = False
            if attachment.stream.prediction is not None:
                event.prediction.CopyFrom(attachment.stream.prediction)

    async def batches(self) -> AsyncIterator[scheduler_pb2.EventBatch]:
        """The batches, as the attached requests publish; runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self.take()
            if batch is not None:
                yield batch


class Subscriptions:
    """The subscriptions open on this process, by id (the servicer's)."""

    def __init__(self) -> None:
        self.open: dict[str, Subscription] = {}

    def get(self, subscription_id: str) -> Subscription | None:
        return self.open.get(subscription_id)

    def add(self, subscription_id: str) -> Subscription:
        if not subscription_id or subscription_id in self.open:
            raise ValueError(f"subscription id {subscription_id!r} is empty or already open")
        subscription = self.open[subscription_id] = Subscription(subscription_id)
        return subscription

    def remove(self, subscription: Subscription) -> None:
        if self.open.get(subscription.id) is subscription:
            del self.open[subscription.id]
        subscription.close()
