"""`/v1/responses`: create (JSON or typed SSE events), retrieve and delete stored responses.

A request is turned into the chat request it stands for (`chat.py`) and planned by the
chat path, so validation, the chat template, tools, structured outputs and the SLO/priority
extensions (body or `X-*` headers) are the chat endpoint's; the generation runs and ends as in
`routes.py` (client gone, timeout, shutdown: aborted upstream). A finished response with
`store` (the default) is kept in the response store before the client gets it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.params import refuse_unsupported
from services.gateway.render import prediction_header
from services.gateway.responses_api.chat import (
    NO_EFFECT,
    REFUSED,
    Turn,
    conversation,
    renamed,
    to_chat,
)
from services.gateway.responses_api.events import ResponseEvents
from services.gateway.responses_api.schemas import ResponsesRequest
from services.gateway.routes import (
    ERRORS,
    EXTENSION_HEADERS,
    SSEResponse,
    close_generation,
    collect,
    generation_id,
    loop_deadline,
    record_generation,
    require_api_key,
    until_disconnect,
    until_shutdown,
)

if TYPE_CHECKING:
    from services.gateway.generation import Plan
    from services.gateway.state import GatewayState

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=ERRORS)


@router.post("/responses", openapi_extra=EXTENSION_HEADERS)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    gw: GatewayState = request.app.state.gateway
    refuse_unsupported(
        body.model_extra or {}, set(ResponsesRequest.model_fields), REFUSED, NO_EFFECT
    )
    gw.prompts.check_model(body.model)
    items = await conversation(gw.responses, body)
    try:
        plan = await gw.prompts.chat(to_chat(body, items), request.headers, generation_id(request))
    except APIError as exc:
        raise renamed(exc) from None
    turn = Turn(body, items, gw.model_id, id="resp_" + plan.request_id)
    return await _respond(request, turn, plan)


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    record = await request.app.state.gateway.responses.get(response_id)
    if record is None:
        raise _not_found(response_id)
    return JSONResponse(record["response"])


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not await request.app.state.gateway.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
    )


async def _keep(gw: GatewayState, turn: Turn, response: dict[str, Any]) -> None:
    if turn.body.store is not False:
        await gw.responses.put(turn.id, turn.record(response))


async def _respond(request: Request, turn: Turn, plan: Plan) -> Response:
    gw: GatewayState = request.app.state.gateway
    stream = bool(turn.body.stream)
    arrival = time.perf_counter()
    gen = Generation(plan, gw.upstream, gw.tokenizer)
    gw.metrics.prompt_tokens.observe(len(plan.prompt_ids))
    gw.metrics.active_streams.inc()
    try:
        wait = gw.settings.admission_wait_ms / 1000.0 if stream else None
        await until_disconnect(request, gen.start(wait), gw.settings.request_timeout_s)
        gw.metrics.predictions.labels(gen.prediction.source if gen.prediction else "none").inc()
        headers = {"X-ALISE-Prediction": prediction_header(gen.prediction)}
        if stream:
            events = ResponseEvents(turn, gen)
            return SSEResponse(
                _error_events(_stream(events, gw, arrival), events),
                headers,
                on_close=lambda: close_generation(gw, gen),
            )
        left = gw.settings.request_timeout_s - (time.perf_counter() - arrival)
        await until_disconnect(request, collect(gen), max(left, 0.0))
        record_generation(gw, gen, arrival)
        response = turn.response(gen)
        await _keep(gw, turn, response)
        return JSONResponse(response, headers=headers)
    except BaseException:
        close_generation(gw, gen)
        raise
    finally:
        if not stream:
            close_generation(gw, gen)


async def _stream(
    events: ResponseEvents, gw: GatewayState, arrival: float
) -> AsyncGenerator[bytes, None]:
    gen = events.gen
    deadline = arrival + gw.settings.request_timeout_s
    first_sent = False
    try:
        for chunk in events.head():
            yield chunk
        async with asyncio.timeout_at(loop_deadline(deadline)):
            async for piece in until_shutdown(gen.pieces(), gw.shutting_down):
                if not first_sent:
                    gw.metrics.ttft.observe(time.perf_counter() - arrival)
                    first_sent = True
                if chunk := events.piece(piece.text):
                    yield chunk
        record_generation(gw, gen, arrival)
        final = events.turn.response(gen)
        await _keep(gw, events.turn, final)
        for chunk in events.tail(final):
            yield chunk
    finally:
        close_generation(gw, gen)


async def _error_events(
    chunks: AsyncGenerator[bytes, None], events: ResponseEvents
) -> AsyncIterator[bytes]:
    """The stream's events; a failure on the way ends it with an `error` event."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield events.error(exc)
    except TimeoutError:
        yield events.error(APIError(504, "request timed out", code="timeout"))
    finally:
        await chunks.aclose()
