"""The scheduler's batched event streams (services/scheduler/subscriptions.py), in process:
every attached request's new events in one batch, in order, from each attachment's cursor,
the final event last, and attachments that end."""

from __future__ import annotations

import asyncio

from services.common.pb import common_pb2
from services.scheduler.store.streams import RequestStream, final_event
from services.scheduler.subscriptions import Subscription, Subscriptions


def tok(i: int) -> tuple[int, float, float]:
    return (100 + i, -0.5, 1000.0 + i)


def fields(batch) -> list[tuple[str, int, int, bool]]:
    return [(e.request_id, e.index, e.token_id, e.finished) for e in batch.events]


async def test_one_batch_carries_every_attached_requests_new_tokens_in_order():
    sub = Subscription("s")
    a, b = RequestStream("a", prediction=common_pb2.Prediction(length=7)), RequestStream("b")
    sub.attach(a, 0)
    sub.attach(b, 0)
    assert sub.take() is None  # attached, nothing published yet
    a.publish(0, [tok(0), tok(1)])
    b.publish(0, [tok(0)])
    batch = sub.take()
    assert fields(batch) == [("a", 0, 100, False), ("a", 1, 101, False), ("b", 0, 100, False)]
    assert batch.events[0].prediction.length == 7  # the reader's first event carries it
    assert not batch.events[1].HasField("prediction")
    assert sub.take() is None  # nothing new
    b.publish(1, [tok(1), tok(2)])
    b.publish(1, [tok(1)])  # already in the log: not sent again
    assert fields(sub.take()) == [("b", 1, 101, False), ("b", 2, 102, False)]
    assert (sub.batches_sent, sub.events_sent) == (2, 5)


async def test_cursor_from_resume_and_the_final_event_last_then_detached():
    sub = Subscription("s")
    a = RequestStream("a", [tok(0), tok(1), tok(2)])
    sub.attach(a, 2)  # a re-attach: the client has 2 tokens
    a.publish(3, [tok(3)])
    a.finish(final_event("a", 4, "length", common_pb2_usage()))
    assert fields(sub.take()) == [("a", 2, 102, False), ("a", 3, 103, False), ("a", 4, 0, True)]
    assert a not in sub.attached and not a.listeners
    a.publish(4, [tok(4)])  # after the end: nothing reaches the subscription
    assert sub.take() is None


async def test_a_second_attach_replaces_the_first_and_a_stale_detach_keeps_it():
    sub = Subscription("s")
    a = RequestStream("a", [tok(0), tok(1)])
    first = sub.attach(a, 0)
    sub.take()
    second = sub.attach(a, 1)  # re-attached on the same subscription from index 1
    sub.detach(first)  # the old call ending later must not end the new attachment
    assert sub.attached[a] is second
    assert fields(sub.take()) == [("a", 1, 101, False)]
    sub.detach(second)
    a.publish(2, [tok(2)])
    assert sub.take() is None


async def test_abandoned_stream_is_detached_and_closing_detaches_everything():
    sub = Subscription("s")
    a, b = RequestStream("a"), RequestStream("b")
    sub.attach(a, 0)
    sub.attach(b, 0)
    a.abandon()
    sub.take()
    assert a not in sub.attached and b in sub.attached
    subs = Subscriptions()
    opened = subs.add("x")
    opened.attach(b, 0)
    subs.remove(opened)
    assert subs.get("x") is None and b.listeners == {sub}


async def test_batches_wakes_once_for_many_publishes():
    sub = Subscription("s")
    streams = [RequestStream(f"r{i}") for i in range(16)]
    for s in streams:
        sub.attach(s, 0)
    batches = sub.batches()
    first = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0)
    for s in streams:  # a commit's callbacks: every request publishes, synchronously
        s.publish(0, [tok(0)])
    batch = await asyncio.wait_for(first, 5)
    assert [e.request_id for e in batch.events] == [f"r{i}" for i in range(16)]
    await batches.aclose()


def common_pb2_usage():
    from services.scheduler.convert import usage_pb

    return usage_pb(3, 4, 0.0, 0.1, 0.2, 0.3, 0, 0)
