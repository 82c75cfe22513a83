"""vLLM's utility routes: `POST /tokenize`, `POST /detokenize` (API key as `/v1`) and
`GET /version` (open), so clients can count tokens with the served model's own tokenizer and
chat template."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from services.gateway.errors import bad_request
from services.gateway.routes import ERRORS, require_api_key
from services.gateway.schemas import ChatMessage
from services.gateway.version import VERSION

if TYPE_CHECKING:
    from services.gateway.state import GatewayState


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


router = APIRouter(responses=ERRORS)
protected = [Depends(require_api_key)]


@router.post("/tokenize", response_model=TokenizeResponse, dependencies=protected)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    gw: GatewayState = request.app.state.gateway
    gw.prompts.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        text = await gw.prompts.chat_text(body.messages)
        special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        special = body.add_special_tokens is not False
    ids = await asyncio.to_thread(
        lambda: list(gw.tokenizer(text, add_special_tokens=special)["input_ids"])
    )
    return TokenizeResponse(count=len(ids), max_model_len=gw.max_model_len(), tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse, dependencies=protected)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    gw: GatewayState = request.app.state.gateway
    gw.prompts.check_model(body.model)
    vocab = gw.prompts.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens"
        )
    text = await asyncio.to_thread(gw.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}
