"""One request's life upstream: predict, Generate, turn TokenEvents into text, finish.

`Generation.start()` asks for a prediction, opens the Generate stream and waits until the
scheduler has accepted it (its initial metadata or first event), so refusals such as a full
queue become proper HTTP statuses before any byte of a response is sent. `pieces()` then
yields `Piece`s of text as tokens arrive, detokenized and stop-string-checked; at a stop
match the request is aborted upstream. `close()` aborts upstream whatever has not finished
(client gone, timeout, error) and, for requests that ended on EOS, reports the true length
to the predictor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from services.common.pb import common_pb2, scheduler_pb2
from services.gateway.errors import APIError, from_grpc
from services.gateway.textgen import IncrementalDetokenizer, StopMatcher
from services.gateway.upstream import Upstream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.gateway.upstream import GenerateCall

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything a request needs upstream, validated and tokenized."""

    request_id: str
    model: str
    prompt_text: str  # what the model sees (chat-formatted); sent to the predictor
    prompt_ids: list[int]
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int | None = None
    slo: common_pb2.Slo | None = None

    def to_pb(self, prediction: common_pb2.Prediction | None) -> scheduler_pb2.GenerateRequest:
        request = scheduler_pb2.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            model=self.model,
        )
        if self.priority is not None:
            request.priority = self.priority
        if self.slo is not None:
            request.slo.CopyFrom(self.slo)
        if prediction is not None:
            request.prediction.CopyFrom(prediction)
        return request


@dataclass
class Piece:
    text: str
    time: float  # scheduler time of the last token in this piece (unix s)


class Generation:
    def __init__(self, plan: Plan, upstream: Upstream, tokenizer: PreTrainedTokenizerBase) -> None:
        self.plan = plan
        self.upstream = upstream
        self.detok = IncrementalDetokenizer(tokenizer, plan.prompt_ids)
        self.stops = StopMatcher(plan.stops)
        self.prediction: common_pb2.Prediction | None = None  # the predictor's answer
        self.used_prediction: common_pb2.Prediction | None = None  # what the scheduler used
        self.call: GenerateCall | None = None
        self.finish_reason: str | None = None
        self.eos_finish = False
        self.completion_tokens = 0
        self.usage: scheduler_pb2.Usage | None = None
        self.text_parts: list[str] = []
        self.closed = False  # set by the route once close() bookkeeping ran

    async def start(self, admission_wait_s: float | None = None) -> None:
        """Predict, then submit. Returns once the scheduler answered (first event, or a
        refusal), or after `admission_wait_s` without news (None = wait as long as it takes)."""
        self.prediction = await self.upstream.predict(self.plan.model, self.plan.prompt_text)
        self.call = self.upstream.generate(self.plan.to_pb(self.prediction))
        await self._admitted(admission_wait_s)
        if self.call.done():
            code = await self.call.code()
            if code != grpc.StatusCode.OK:
                self.finish_reason = "error"
                raise from_grpc(_call_error(code, await self.call.details()))

    async def _admitted(self, wait_s: float | None) -> None:
        waiter = asyncio.ensure_future(self.call.initial_metadata())
        waiter.add_done_callback(_consume)
        await asyncio.wait([waiter], timeout=wait_s)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def pieces(self) -> AsyncIterator[Piece]:
        while not self.finished:
            try:
                event = await self.call.read()
            except grpc.aio.AioRpcError as exc:
                self.finish_reason = "error"
                raise from_grpc(exc) from exc
            if event is grpc.aio.EOF:
                self.finish_reason = "error"
                raise APIError(
                    502, "scheduler closed the stream without finishing", code="upstream_error"
                )
            piece = self._apply(event)
            if piece is not None and piece.text:
                self.text_parts.append(piece.text)
                yield piece

    def _apply(self, event: scheduler_pb2.TokenEvent) -> Piece | None:
        if event.HasField("prediction") and self.used_prediction is None:
            self.used_prediction = event.prediction
        if event.finished:
            return self._finish(event)
        self.completion_tokens = event.index + 1
        text, matched = self.stops.push(self.detok.push(event.token_id))
        if matched:
            self.finish_reason = "stop"
            self._cancel_upstream()
        return Piece(text, event.time)

    def _finish(self, event: scheduler_pb2.TokenEvent) -> Piece | None:
        self.usage = event.usage
        if event.finish_reason == "error":
            self.finish_reason = "error"
            raise APIError(
                502, f"generation failed: {event.error or 'unknown error'}", code="generation_error"
            )
        self.finish_reason = event.finish_reason or "stop"
        self.eos_finish = self.finish_reason == "stop" and not self.plan.ignore_eos
        if event.usage.completion_tokens:
            self.completion_tokens = event.usage.completion_tokens
        text, matched = self.stops.push(self.detok.flush())
        if matched:
            self.eos_finish = False
        else:
            text += self.stops.flush()
        return Piece(text, event.time)

    def _cancel_upstream(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
        self.upstream.abort(self.plan.request_id)

    def close(self) -> None:
        """Abort upstream unless it ended there; observe the true length of EOS endings."""
        if self.call is None:
            return
        if not self.finished:
            self.finish_reason = "abort"
            self._cancel_upstream()
        elif self.eos_finish:
            self.upstream.observe(
                self.plan.model, self.plan.request_id, self.plan.prompt_text, self.completion_tokens
            )

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _consume(task: asyncio.Future[grpc.aio.Metadata]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failed call reports through call.code() instead


def _call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
