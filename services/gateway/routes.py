"""The `/v1` routes: completions, chat completions (streaming and not) and models.

A generation is prepared (validated, tokenized), started upstream while watching for the
client going away, then either streamed as SSE or collected into one JSON body. Whatever
way it ends, `Generation.close()` runs: it aborts upstream anything unfinished.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway.errors import APIError
from services.gateway.fanout import best, merged, sibling_plans
from services.gateway.generation import Generation, Plan
from services.gateway.middleware import new_request_id
from services.gateway.render import DONE, ChunkMaker, full_response, prediction_header, sse
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from services.gateway.state import GatewayState

_T = TypeVar("_T")
log = logging.getLogger(__name__)

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503, 504)}


async def require_api_key(request: Request) -> None:
    keys = request.app.state.gateway.settings.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(
            401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
        )
    if not any(hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys):
        raise APIError(401, "invalid API key", code="invalid_api_key")


router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=ERRORS)


def _card(gw: GatewayState) -> ModelCard:
    return ModelCard(
        id=gw.model_id,
        created=gw.started,
        max_model_len=gw.max_model_len(),
        max_kv_tokens=gw.upstream.max_kv_tokens or None,
    )


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request.app.state.gateway)])


@router.get("/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """OpenAI's `models.retrieve`: the served model's card, or a 404 `model_not_found`."""
    gw: GatewayState = request.app.state.gateway
    gw.prompts.check_model(model)
    return _card(gw)


def _header(name: str, kind: str, description: str) -> dict:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": {"type": kind},
    }


# Extensions for clients that cannot change bodies (the body wins when both are given).
EXTENSION_HEADERS = {
    "parameters": [
        _header("X-Priority", "integer", "Request priority (vLLM's: lower = served earlier)."),
        _header("X-SLO-TTFT-MS", "number", "Time-to-first-token objective (ms)."),
        _header("X-SLO-TBT-MS", "number", "Time-between-tokens objective (ms)."),
        _header("X-SLO-Deadline-MS", "number", "Completion deadline (ms after arrival)."),
        _header("X-Request-Id", "string", "Echoed back; made up when absent or invalid."),
    ]
}


@router.post("/completions", openapi_extra=EXTENSION_HEADERS)
async def completions(body: CompletionRequest, request: Request) -> Response:
    gw: GatewayState = request.app.state.gateway
    plans = await gw.prompts.completion(body, request.headers, generation_id(request))
    return await _respond(request, plans, body, chat=False)


@router.post("/chat/completions", openapi_extra=EXTENSION_HEADERS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    gw: GatewayState = request.app.state.gateway
    plan = await gw.prompts.chat(body, request.headers, generation_id(request))
    return await _respond(request, [plan], body, chat=True)


def generation_id(request: Request) -> str:
    """The scheduler's key for a generation: always fresh. The client's X-Request-Id is only
    echoed (and logged beside this one): two clients sending the same id never collide."""
    rid = new_request_id()
    log.info("generation %s for X-Request-Id %s", rid, request.state.request_id)
    return rid


async def _respond(
    request: Request, plans: list[Plan], body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    answers = max(body.n or 1, getattr(body, "best_of", None) or 1)
    if answers > 1 or len(plans) > 1:
        every = [p for plan in plans for p in sibling_plans(plan, answers)]
        return await _respond_many(request, every, body, chat)
    plan = plans[0]
    gw: GatewayState = request.app.state.gateway
    arrival = time.perf_counter()
    gen = Generation(plan, gw.upstream, gw.tokenizer)
    gw.metrics.prompt_tokens.observe(len(plan.prompt_ids))
    gw.metrics.active_streams.inc()
    try:
        wait = gw.settings.admission_wait_ms / 1000.0 if body.stream else None
        await until_disconnect(request, gen.start(wait), gw.settings.request_timeout_s)
        gw.metrics.predictions.labels(gen.prediction.source if gen.prediction else "none").inc()
        headers = {"X-ALISE-Prediction": prediction_header(gen.prediction)}
        if body.stream:
            maker = ChunkMaker(
                gen,
                chat,
                bool(body.stream_options and body.stream_options.include_usage),
                body.return_token_times,
            )
            return SSEResponse(
                _error_events(_stream(gen, maker, gw, arrival)),
                headers,
                on_close=lambda: close_generation(gw, gen),
            )
        left = gw.settings.request_timeout_s - (time.perf_counter() - arrival)
        await until_disconnect(request, collect(gen), max(left, 0.0))
        record_generation(gw, gen, arrival)
        return JSONResponse(full_response(gen, chat), headers=headers)
    except BaseException:
        close_generation(gw, gen)
        raise
    finally:
        if not body.stream:
            close_generation(gw, gen)


async def _respond_many(
    request: Request, plans: list[Plan], body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    """n > 1 or best_of: one generation per answer (`fanout.py`), one response."""
    gw: GatewayState = request.app.state.gateway
    arrival = time.perf_counter()
    gens = [Generation(p, gw.upstream, gw.tokenizer) for p in plans]
    for gen in gens[1:]:
        gen.group = gens[0].group  # one shard: the siblings find the prompt in its cache
    gw.metrics.prompt_tokens.observe(len(plans[0].prompt_ids))
    gw.metrics.active_streams.inc(len(gens))  # each generation's close_generation takes one off

    def close_all() -> None:
        for gen in gens:
            close_generation(gw, gen)

    try:
        wait = gw.settings.admission_wait_ms / 1000.0 if body.stream else None
        await until_disconnect(request, gens[0].start(wait), gw.settings.request_timeout_s)
        headers = {"X-ALISE-Prediction": prediction_header(gens[0].prediction)}
        if body.stream:
            return SSEResponse(
                _error_events(_stream_many(gens, body, chat, gw, arrival)),
                headers,
                on_close=close_all,
            )
        left = gw.settings.request_timeout_s - (time.perf_counter() - arrival)
        await until_disconnect(request, _collect_many(gens), max(left, 0.0))
        for gen in gens:
            record_generation(gw, gen, arrival)
        n = body.n or 1
        chosen = best(gens, n) if len(gens) > n * len({g.plan.prompt_index for g in gens}) else gens
        return JSONResponse(full_response(chosen[0], chat, *chosen[1:]), headers=headers)
    except BaseException:
        close_all()
        raise
    finally:
        if not body.stream:
            close_all()


async def _collect_many(gens: list[Generation]) -> None:
    async for _ in merged(gens):
        pass


async def _stream_many(
    gens: list[Generation],
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    gw: GatewayState,
    arrival: float,
) -> AsyncIterator[bytes]:
    usage = bool(body.stream_options and body.stream_options.include_usage)
    makers = [ChunkMaker(gens[0], chat, usage, body.return_token_times)]
    makers += [
        ChunkMaker(g, chat, usage, body.return_token_times, i, makers[0].id)
        for i, g in enumerate(gens[1:], 1)
    ]
    deadline = arrival + gw.settings.request_timeout_s
    for maker in makers:
        if (head := maker.first()) is not None:
            yield head
    async with asyncio.timeout_at(loop_deadline(deadline)):
        async for i, piece in until_shutdown(merged(gens), gw.shutting_down):
            if piece is None:
                record_generation(gw, gens[i], arrival)
                yield makers[i].finish()
            elif chunk := makers[i].piece(piece.text, piece.time, piece.logprobs, piece.token_ids):
                yield chunk
    for chunk in makers[0].tail(gens):
        yield chunk


async def _error_events(chunks: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """The stream's chunks; a failure on the way ends it with an error event and [DONE].
    Closing this stream closes `chunks` at once (its cleanup runs then, not at GC)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse(exc.body())
        yield DONE
    except TimeoutError:
        yield sse(APIError(504, "request timed out", code="timeout").body())
        yield DONE
    finally:
        await chunks.aclose()


async def collect(gen: Generation) -> None:
    async for _ in gen.pieces():
        pass


async def _stream(
    gen: Generation, maker: ChunkMaker, gw: GatewayState, arrival: float
) -> AsyncIterator[bytes]:
    deadline = arrival + gw.settings.request_timeout_s
    first_sent = False
    try:
        if (head := maker.first()) is not None:
            yield head
        async with asyncio.timeout_at(loop_deadline(deadline)):
            async for piece in until_shutdown(gen.pieces(), gw.shutting_down):
                if not first_sent:
                    gw.metrics.ttft.observe(time.perf_counter() - arrival)
                    first_sent = True
                if chunk := maker.piece(piece.text, piece.time, piece.logprobs, piece.token_ids):
                    yield chunk
        record_generation(gw, gen, arrival)
        for chunk in maker.last():
            yield chunk
    finally:
        close_generation(gw, gen)


async def until_shutdown(pieces: AsyncIterator[_T], stop: asyncio.Event) -> AsyncIterator[_T]:
    """The pieces, until the server's drain period ends: then a 503 error event."""
    stopping = asyncio.ensure_future(stop.wait())
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(pieces))
            await asyncio.wait({nxt, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise APIError(
                    503,
                    "the server is shutting down; the request was aborted",
                    code="shutting_down",
                )
            try:
                yield nxt.result()
            except StopAsyncIteration:
                return
    finally:
        stopping.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()


def close_generation(gw: GatewayState, gen: Generation) -> None:
    if gen.closed:
        return
    gen.closed = True
    was_running = gen.call is not None and gen.finish_reason is None
    gen.close()
    if was_running:
        gw.metrics.aborts.labels("client_gone_or_timeout").inc()
    gw.metrics.active_streams.dec()


def record_generation(gw: GatewayState, gen: Generation, arrival: float) -> None:
    gw.metrics.e2e.observe(time.perf_counter() - arrival)
    gw.metrics.generation_tokens.observe(gen.completion_tokens)
    gw.metrics.finished.labels(gen.finish_reason or "abort").inc()


def loop_deadline(perf_deadline: float) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + max(0.0, perf_deadline - time.perf_counter())


async def until_disconnect(request: Request, coro: Awaitable[_T], timeout_s: float) -> _T:
    """Run `coro` unless the client disconnects first (499) or it takes too long (504)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {work, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    if watcher in done:
        raise APIError(499, "client closed the request", code="client_closed_request")
    raise APIError(504, "request timed out", code="timeout")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """An event stream whose generator is always closed (upstream abort) when it ends."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[bytes], headers: dict[str, str], on_close: Callable[[], None]
    ) -> None:
        super().__init__(
            content, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self.on_close()
