"""Pure-ASGI middleware: request ids + per-request metrics, the request body size limit, and
unexpected errors as OpenAI-style 500s inside the CORS layer.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched and the
per-token path pays nothing.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import TYPE_CHECKING

from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("alise.gateway")
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/version",
    "/health",
    "/health/live",
    "/health/ready",
    "/metrics",
    "/",
}


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Takes a valid client `X-Request-Id` or makes one; echoes it; counts the request. The id
    is the client's handle for logs; generations get a fresh scheduler key of their own."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        request_id = given if given and _VALID_ID.match(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = _route_label(scope["path"])
            self.metrics.requests.labels(path, str(status[0] or 499)).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - start)


def _route_label(path: str) -> str:
    """The metrics label of a path: a known route, `/v1/responses/{id}`, or `other`."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "other"


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks: list[bytes] = []
        size, done = 0, False
        while not done:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            done = not message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        error = APIError(
            413, f"request body larger than {self.max_bytes} bytes", code="body_too_large"
        )
        response = error.response()
        await response({"type": "http"}, _no_receive, send)


class UnexpectedErrorMiddleware:
    """An exception no handler took becomes an OpenAI-style 500 here, inside the CORS layer,
    so browsers can read it (Starlette's own last-resort handler sits outside every
    middleware). After a response has started, the exception goes on up as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            error = APIError(
                500,
                f"internal error: {type(exc).__name__}",
                type="server_error",
                code="internal_error",
            )
            await error.response()(scope, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return {"type": "http.disconnect"}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None
