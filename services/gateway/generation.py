"""One request's life upstream: predict, Generate, turn TokenEvents into text, finish.

`Generation.start()` asks for a prediction, opens the Generate stream and waits until the
scheduler has accepted it (its initial metadata or first event), so refusals such as a full
queue become proper HTTP statuses before any byte of a response is sent. `pieces()` then
yields `Piece`s of text as tokens arrive, detokenized and stop-string-checked; at a stop
match the request is aborted upstream. When the scheduler's stream breaks (it crashed,
stopped, or lost its leadership), the request re-attaches with `resume_from` = the tokens
already received, on the next scheduler of the list, for up to `resume_timeout_s`: the client
sees a pause, never a repeated or missing token. `close()` aborts upstream whatever has not finished
(client gone, timeout, error) and, for requests that ended on EOS, reports the true length
to the predictor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from services.common.grpc_client import ACCEPTED_KEY
from services.common.grpc_server import RETRY_AFTER_KEY
from services.common.pb import common_pb2, scheduler_pb2
from services.gateway.errors import APIError, from_grpc
from services.gateway.logprobs import LogprobDecoder, TokenLogprob
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
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop: bool = False  # the matched stop string or stop token stays in the text
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: not asked; else the top alternatives per token (0-20)
    echo: bool = False  # completions: the prompt text opens the answer
    tools_mode: str = ""  # "" | "auto" | "forced": parse tool calls out of the answer
    tool_parser: str = "hermes"  # services/gateway/tools.py PARSERS: the model family's
    prompt_index: int = 0  # which prompt of a batched completion request
    return_token_ids: bool = False  # each piece carries its token ids

    def to_pb(self, prediction: common_pb2.Prediction | None) -> scheduler_pb2.GenerateRequest:
        request = scheduler_pb2.GenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            model=self.model,
            stop_token_ids=self.stop_token_ids,
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # this piece's tokens (if asked)
    token_ids: list[int] = field(default_factory=list)  # this piece's ids (return_token_ids)


class Generation:
    def __init__(self, plan: Plan, upstream: Upstream, tokenizer: PreTrainedTokenizerBase) -> None:
        self.plan = plan
        self.upstream = upstream
        self.logprob_decoder = (
            LogprobDecoder(tokenizer, plan.skip_special_tokens)
            if plan.logprobs is not None
            else None
        )
        self.logprobs: list[TokenLogprob] = []  # every token's, when the request asks
        self.prompt_logprobs: list[TokenLogprob] = []  # echo + logprobs: the prompt's
        self.detok = IncrementalDetokenizer(
            tokenizer, plan.prompt_ids, skip_special_tokens=plan.skip_special_tokens
        )
        self.stops = StopMatcher(plan.stops, plan.include_stop)
        self.prediction: common_pb2.Prediction | None = None  # the predictor's answer
        self.used_prediction: common_pb2.Prediction | None = None  # what the scheduler used
        self.call: GenerateCall | None = None
        self.finish_reason: str | None = None
        self.eos_finish = False
        self.completion_tokens = 0
        self.cumulative_logprob = 0.0  # of the tokens received (best_of ranks by it)
        self.cached_tokens = 0  # prompt tokens the prefix cache served (from the final usage)
        self.usage: scheduler_pb2.Usage | None = None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []  # every output token id received, in order
        self.closed = False  # set by the route once close() bookkeeping ran
        self.group = upstream.place()  # the scheduler shard that serves the request
        self.scheduler_index = 0  # which of the shard's schedulers serves the stream
        self.received = 0  # token events received: where a re-attach resumes
        self.reattaches = 0
        self.submissions = 0  # Generate calls that submitted the request (not re-attaches)
        self.resume_pause_s = 0.0

    async def start(self, admission_wait_s: float | None = None) -> None:
        """Predict, then submit. Returns once the scheduler answered (first event, or a
        refusal), or after `admission_wait_s` without news (None = wait as long as it takes).
        When no scheduler of the shard can admit it now (unreachable, standing by, or without
        Redis) the request is held and submitted again (`_hold`); a stream that breaks after
        the scheduler accepted it re-attaches (`_reopen`)."""
        self.prediction = await self.upstream.predict(
            self.plan.model, self.plan.prompt_text, self.plan.sampling.temperature
        )
        error = await self._submit(admission_wait_s)
        if error is not None:
            await self._hold(error, admission_wait_s)

    async def _submit(self, wait_s: float | None) -> grpc.aio.AioRpcError | None:
        """Submit on each scheduler of the shard at most once. None once one took it (or is
        still deciding after `wait_s`); the last refusal worth holding for (the scheduler went
        away, stands by or cannot reach Redis: `RESUMABLE` codes); any other is raised."""
        error: grpc.aio.AioRpcError | None = None
        for _ in range(len(self.group.stubs)):
            self.submissions += 1
            self.call, self.scheduler_index = self.upstream.generate(
                self.group, self.plan.to_pb(self.prediction)
            )
            await self._admitted(wait_s)
            if not self.call.done() or await self.call.code() == grpc.StatusCode.OK:
                return None
            call = self.call
            error = _call_error(
                await call.code(), await call.details(), await call.trailing_metadata()
            )
            again = self.submissions > 1 and error.code() == ALREADY_EXISTS
            if await _accepted(call) or again:
                if self._resumable(error) or error.code() == ALREADY_EXISTS:
                    await self._reopen(error)  # it was recorded: re-attach
                    return None
            elif self._resumable(error):  # never accepted: gone, standing by, or no Redis
                if _retry_after(error):
                    return error  # the leader answered: it cannot reach Redis
                self.group.failover(self.scheduler_index)
                continue
            self.finish_reason = "error"
            raise from_grpc(error)
        return error

    async def _hold(self, error: grpc.aio.AioRpcError, wait_s: float | None) -> None:
        """No scheduler can admit the request now: hold it and submit again with backoff
        (0.1 s doubling to 1 s) for up to `admission_hold_s`, one of at most
        `admission_hold_max` held at once; then, or when that many are held, a 503 with
        Retry-After."""
        settings = self.upstream.settings
        if settings.admission_hold_s <= 0 or not self.upstream.hold():
            self.finish_reason = "error"
            raise _refusal(error, "too many requests are already waiting for a scheduler")
        try:
            deadline = time.monotonic() + settings.admission_hold_s
            backoff = 0.1
            while (left := deadline - time.monotonic()) > 0:
                await asyncio.sleep(min(backoff, left))
                backoff = min(backoff * 2, 1.0)
                next_error = await self._submit(wait_s)
                if next_error is None:
                    return
                error = next_error
            self.finish_reason = "error"
            raise _refusal(
                error, f"no scheduler could admit it within {settings.admission_hold_s:g}s"
            )
        finally:
            self.upstream.release_hold()

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
                if not self._resumable(exc):
                    self.finish_reason = "error"
                    raise from_grpc(exc) from exc
                await self._reopen(exc)
                continue
            if event is grpc.aio.EOF:  # ended without a final event (a scheduler stopping)
                await self._reopen(None)
                continue
            if not event.finished and event.index < self.received:
                continue  # already sent (a re-attach never repeats one; kept for safety)
            piece = self._apply(event)
            if piece is not None and (piece.text or piece.logprobs or piece.token_ids):
                self.text_parts.append(piece.text)
                yield piece

    def _resumable(self, exc: grpc.aio.AioRpcError) -> bool:
        """A broken connection, a scheduler that stopped or stands by, or one that cannot
        reach Redis for now: worth re-attaching."""
        return exc.code() in RESUMABLE

    async def _reopen(self, exc: grpc.aio.AioRpcError | None) -> None:
        """Re-attach (`resume_from` = tokens received) or, when nothing was received and the
        scheduler never recorded the request, submit it again; on the next scheduler of the
        list after UNAVAILABLE, with backoff, for up to `resume_timeout_s`."""
        failed_at = time.monotonic()
        deadline = failed_at + self.upstream.settings.resume_timeout_s
        log.warning(
            "scheduler stream broke; re-attaching",
            extra={"request_id": self.plan.request_id, "error": _brief(exc), "sent": self.received},
        )
        if exc is None or (exc.code() == UNAVAILABLE and not _retry_after(exc)):
            self.group.failover(self.scheduler_index)
        backoff, fresh = 0.05, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.finish_reason = "error"
                raise APIError(
                    503,
                    f"scheduler unavailable for {self.upstream.settings.resume_timeout_s:g}s "
                    f"(last error: {_brief(exc)})",
                    code="scheduler_unavailable",
                )
            await asyncio.sleep(min(backoff, left))
            backoff = min(backoff * 2, 1.0)
            exc, fresh = await self._try_reopen(fresh, left)
            if exc is None:
                self.reattaches += 1
                self.resume_pause_s += time.monotonic() - failed_at
                return

    async def _try_reopen(
        self, fresh: bool, timeout_s: float
    ) -> tuple[grpc.aio.AioRpcError | None, bool]:
        """One attempt: (None, _) when a stream is open again, else (the error, whether the
        next attempt submits afresh)."""
        if fresh:
            pb = self.plan.to_pb(self.prediction)
        else:
            pb = scheduler_pb2.GenerateRequest(
                request_id=self.plan.request_id, resume_from=self.received
            )
        call, index = self.upstream.generate(self.group, pb, timeout_s=timeout_s)
        waiter = asyncio.ensure_future(call.initial_metadata())
        waiter.add_done_callback(_consume)
        await asyncio.wait([waiter], timeout=timeout_s)
        if not call.done() or await call.code() == grpc.StatusCode.OK:
            previous, self.call, self.scheduler_index = self.call, call, index
            if previous is not None and not previous.done():
                # still open (a batched call whose subscription broke): cancelled only now
                # that the new one counts as the request's reader, so nothing is aborted
                previous.cancel()
            return None, fresh
        code = await call.code()
        error = _call_error(code, await call.details(), await call.trailing_metadata())
        if code == grpc.StatusCode.NOT_FOUND and not fresh and self.received == 0:
            return error, True  # never recorded (or lost before any token): submit it again
        if code == grpc.StatusCode.ALREADY_EXISTS and fresh:
            return error, False  # an earlier attempt did record it: re-attach
        if not self._resumable(error):
            self.finish_reason = "error"
            raise from_grpc(error)
        if not _retry_after(error):  # that scheduler is gone or stands by (not: Redis is)
            self.group.failover(index)
        return error, fresh

    def _apply(self, event: scheduler_pb2.TokenEvent) -> Piece | None:
        if event.HasField("prediction") and self.used_prediction is None:
            self.used_prediction = event.prediction
        if event.finished:
            return self._finish(event)
        self.completion_tokens = self.received = event.index + 1
        self.cumulative_logprob += event.logprob
        self.token_ids.append(event.token_id)
        ids = [event.token_id] if self.plan.return_token_ids else []
        prompt = self._prompt_logprobs(event)
        if event.token_id in self.plan.stop_token_ids and not self.plan.include_stop:
            # a stop token ends the answer without its text
            return Piece("", event.time, prompt, ids)
        text, matched = self.stops.push(self.detok.push(event.token_id))
        if matched:
            self.finish_reason = "stop"
            self._cancel_upstream()
        if self.logprob_decoder is None:
            return Piece(text, event.time, [], ids)
        entry = self.logprob_decoder.entry(event.token_id, event.logprob, event.top_logprobs)
        if entry is None:
            return Piece(text, event.time, prompt, ids)
        self.logprobs.append(entry)
        return Piece(text, event.time, [*prompt, entry], ids)

    def _prompt_logprobs(self, event: scheduler_pb2.TokenEvent) -> list[TokenLogprob]:
        """Completions `echo` with `logprobs`: the prompt's entries, which come with the
        first token's event."""
        if event.index or not self.plan.echo or self.logprob_decoder is None:
            return []
        self.prompt_logprobs = self.logprob_decoder.prompt_entries(
            list(self.plan.prompt_ids), list(event.prompt_logprobs)
        )
        return self.prompt_logprobs

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
        self.cached_tokens = event.usage.cached_tokens
        text, matched = self.stops.push(self.detok.flush())
        if matched:
            self.eos_finish = False
        else:
            text += self.stops.flush()
        return Piece(text, event.time)

    def _cancel_upstream(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
        self.upstream.abort(self.group, self.plan.request_id)

    def close(self) -> None:
        """Abort upstream unless it ended there; observe the true length of EOS endings, and
        the lower bound of answers cut by max_tokens (censored)."""
        if self.call is None:
            return
        if not self.finished:
            self.finish_reason = "abort"
            self._cancel_upstream()
            return
        cut = self.finish_reason == "length" and not self.plan.ignore_eos
        if self.eos_finish or cut:
            self.upstream.observe(
                self.plan.model,
                self.plan.request_id,
                self.plan.prompt_text,
                self.completion_tokens,
                censored=cut,
                temperature=self.plan.sampling.temperature,
            )

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def _consume(task: asyncio.Future[grpc.aio.Metadata]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failed call reports through call.code() instead


def _call_error(
    code: grpc.StatusCode, details: str, trailing: grpc.aio.Metadata | None = None
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


async def _accepted(call: GenerateCall) -> bool:
    """Whether the scheduler accepted the request before the call ended (it says so in the
    initial metadata it sends on accepting)."""
    return any(key == ACCEPTED_KEY for key, _ in await call.initial_metadata() or ())


def _retry_after(exc: grpc.aio.AioRpcError) -> str:
    """The scheduler's `retry-after` trailer ('' = none): its refusal is temporary."""
    return next((str(v) for k, v in exc.trailing_metadata() or () if k == RETRY_AFTER_KEY), "")


def _refusal(exc: grpc.aio.AioRpcError, why: str) -> APIError:
    """The 503 a request gets when it was not admitted: why, the last refusal, and when to
    retry (the scheduler's hint, else 2 s)."""
    return APIError(
        503,
        f"scheduler unavailable: {why} (last error: {_brief(exc)})",
        code="scheduler_unavailable",
        headers={"Retry-After": _retry_after(exc) or "2"},
    )


def _brief(exc: grpc.aio.AioRpcError | None) -> str:
    if exc is None:
        return "stream ended without a final event"
    return f"{exc.code().name}: {exc.details()}"


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS

# Codes after which a stream is re-attached: the connection or the scheduler went away.
RESUMABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
    }
)
