"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything the gateway refuses is raised as `APIError`; the handlers installed by
`install_error_handlers` also turn FastAPI's validation errors (400), unknown routes (404),
wrong methods (405) and, as a last resort, unexpected exceptions (500) into the same shape.
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.grpc_server import RETRY_AFTER_KEY

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# gRPC status of an upstream call -> the HTTP error the client sees.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "scheduler_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
}


def from_grpc(exc: grpc.aio.AioRpcError, retry_after_s: int = 1) -> APIError:
    status, code = _GRPC_TO_HTTP.get(exc.code(), (502, "upstream_error"))
    hinted = [v for k, v in exc.trailing_metadata() or () if k == RETRY_AFTER_KEY]
    headers = None
    if hinted:  # the scheduler says how long its refusal lasts (e.g. Redis unreachable)
        headers = {"Retry-After": str(hinted[0])}
    elif status == 429:
        headers = {"Retry-After": str(retry_after_s)}
    detail = exc.details() or exc.code().name
    return APIError(status, f"scheduler: {detail}", code=code, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', 'parse error')}", None
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(
            exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})
        ).response()

    # Unexpected exceptions: middleware.UnexpectedErrorMiddleware (inside the CORS layer).
