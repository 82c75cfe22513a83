"""`create_app(settings)`: the gateway's FastAPI application.

The lifespan loads the model's tokenizer, opens the gRPC channels (scheduler; predictor
replicas balanced round-robin) and asks the scheduler for the maximum model length (falling
back to the model config while the scheduler is away). Middleware order, outermost first:
request id + metrics, body size limit, CORS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response

from services.common.metrics import CONTENT_TYPE_LATEST
from services.common.settings import GatewaySettings
from services.gateway.errors import install_error_handlers
from services.gateway.key_limits import KeyLimitMiddleware
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import (
    BodyLimitMiddleware,
    RequestIdMiddleware,
    UnexpectedErrorMiddleware,
)
from services.gateway.prompts import PromptBuilder
from services.gateway.responses_api.routes import router as responses_router
from services.gateway.responses_api.store import ResponseStore
from services.gateway.routes import require_api_key, router
from services.gateway.state import GatewayState
from services.gateway.upstream import Upstream
from services.gateway.utility import router as utility_router
from services.gateway.version import VERSION

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PLAYGROUND = Path(__file__).with_name("playground.html")


def model_max_length(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> int:
    """The model's context length from its config (tokenizers often say 'unlimited')."""
    from transformers import AutoConfig

    from services.common.models import tokenizer_dir

    config = AutoConfig.from_pretrained(tokenizer_dir(settings.model, settings.data_dir))
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return int(min(tokenizer.model_max_length, 1 << 20))


async def _load_state(settings: GatewaySettings, metrics: GatewayMetrics) -> GatewayState:
    from services.common.models import load_tokenizer, served_model_id

    tokenizer = await asyncio.to_thread(load_tokenizer, settings.model, settings.data_dir)
    config_len = await asyncio.to_thread(model_max_length, settings, tokenizer)
    model_id = settings.served_model_name or served_model_id(settings.model)
    upstream = Upstream(settings)
    prompts = PromptBuilder(
        tokenizer, model_id, lambda: upstream.context_limit(config_len), settings.tool_parser
    )
    responses = ResponseStore(settings.redis_url, settings.response_ttl_s)
    state = GatewayState(
        settings,
        metrics,
        tokenizer,
        upstream,
        prompts,
        model_id,
        config_len,
        int(time.time()),
        responses,
    )
    await upstream.stats()
    return state


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = await _load_state(settings, metrics)
        try:
            yield
        finally:
            await app.state.gateway.upstream.close()
            await app.state.gateway.responses.close()

    app = FastAPI(
        title="ALISE gateway",
        version=VERSION,
        lifespan=lifespan,
        description="OpenAI-compatible API with length prediction and SLOs.",
    )
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(utility_router)
    _add_service_routes(app, metrics)
    # The last added is the outermost: every error response (500s and the body limit's 413
    # included) passes through CORS, and the request id wraps them all.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(
        KeyLimitMiddleware,
        keys=settings.api_keys,
        max_concurrent=settings.key_max_concurrent,
        rate_per_s=settings.key_rate_per_s,
        burst=settings.key_burst,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "X-ALISE-Prediction"],
        )
    app.add_middleware(RequestIdMiddleware, metrics=metrics)
    return app


def _add_service_routes(app: FastAPI, metrics: GatewayMetrics) -> None:
    @app.get("/health/live")
    async def live() -> JSONResponse:
        """200 while this process answers (a liveness probe: restart it only when this fails;
        an unreachable dependency is readiness's business)."""
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    @app.get("/health")
    async def ready(request: Request) -> JSONResponse:
        """200 while a request can be served: a leading scheduler that reaches Redis and some
        executor; else 503 with the reason. The predictor is optional (reported only)."""
        gw: GatewayState = request.app.state.gateway
        reason, predictor = await asyncio.gather(
            gw.upstream.not_ready(), gw.upstream.predictor_up()
        )
        if not reason and not gw.upstream.max_model_len:
            await gw.upstream.stats()
        body = {
            "status": "unavailable" if reason else "ok",
            "scheduler": not reason.startswith("no scheduler"),
            "predictor": predictor,
            "model": gw.model_id,
            "max_model_len": gw.max_model_len(),
        }
        if reason:
            body["reason"] = reason
        return JSONResponse(body, status_code=503 if reason else 200)

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(require_api_key)])
    async def prometheus() -> Response:
        """Behind the API keys when there are any (Prometheus: `authorization` in the scrape
        config); the playground page stays open (it holds no data and asks for a key)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))
