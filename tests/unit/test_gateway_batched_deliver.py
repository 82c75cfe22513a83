"""BatchedCall.deliver after a re-attach on the same subscription: the replaced attachment's
events may arrive before and among the new attachment's replay (resume index onward, in
order). Each index is queued once, in order, none lost; the final event only after every
token before it."""

from __future__ import annotations

import asyncio
from collections import deque

from services.common.pb import scheduler_pb2
from services.gateway.events import BatchedCall


def _call(resume_from: int) -> BatchedCall:
    call = BatchedCall.__new__(BatchedCall)  # the delivery side alone: no scheduler
    call._events, call._wake = deque(), asyncio.Event()
    call._next_index, call._final_queued = resume_from, False
    return call


def _token(i: int) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", index=i, token_id=100 + i)


def _final(n: int) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", index=n, finished=True, finish_reason="length")


def test_events_racing_ahead_of_the_replay_neither_skip_nor_repeat_an_index():
    call = _call(resume_from=1)
    old = [_token(2), _token(3), _final(5)]  # the replaced attachment, ahead of the replay
    replay = [_token(i) for i in range(1, 5)] + [_final(5)]
    for event in (old[0], replay[0], old[1], replay[1], replay[2], old[2], replay[3], replay[4]):
        call.deliver(event)
    got = list(call._events)
    assert [e.index for e in got if not e.finished] == [1, 2, 3, 4]
    assert [e.finished for e in got] == [False] * 4 + [True]
