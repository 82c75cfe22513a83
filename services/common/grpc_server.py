"""Async gRPC server builder: health checking, reflection and one error-mapping interceptor.

Servicers raise plain exceptions; `ErrorMappingInterceptor` turns each into a status code in
one place (ServiceError carries its own code; ValueError -> INVALID_ARGUMENT; LookupError ->
NOT_FOUND; TimeoutError -> DEADLINE_EXCEEDED; anything else -> INTERNAL, logged).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.internal_auth import TokenCheck, internal_token

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


RETRY_AFTER_KEY = "retry-after"  # trailer: the refusal is temporary, retry after N seconds


class ServiceError(Exception):
    """An error that carries the gRPC status code the client should see."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # sent as a `retry-after` trailer: not worth retrying


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a raised exception maps to."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):  # includes pydantic.ValidationError
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc) or "not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after)),))
    await context.abort(code, message)


_PASSTHROUGH = (grpc.aio.AbortError, asyncio.CancelledError)

# A servicer method as grpc calls it: (request, or iterator of requests; context).
_StreamHandler = Callable[[object, grpc.aio.ServicerContext], AsyncIterator[object]]


def _mapped_stream(inner: _StreamHandler, method: str) -> _StreamHandler:
    """A streaming handler (unary_stream or stream_stream) whose exceptions become statuses.
    A handler may be an async generator, or a coroutine that writes with `context.write`."""
    if not inspect.isasyncgenfunction(inner):

        async def writer(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
            try:
                await inner(request_or_iterator, context)  # type: ignore[misc]
            except _PASSTHROUGH:
                raise
            except Exception as exc:
                await _abort(context, method, exc)

        return writer  # type: ignore[return-value]

    async def handler(
        request_or_iterator: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        try:
            async for item in inner(request_or_iterator, context):
                yield item
        except _PASSTHROUGH:
            raise
        except Exception as exc:
            await _abort(context, method, exc)

    return handler


# grpc is untyped for mypy here (pyproject override): its classes are Any.
class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> object:
                try:
                    return await inner(request, context)
                except _PASSTHROUGH:
                    raise
                except Exception as exc:
                    await _abort(context, method, exc)
                return None  # not reached: abort() raises

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream:
            return handler._replace(unary_stream=_mapped_stream(handler.unary_stream, method))
        if handler.stream_stream:
            return handler._replace(stream_stream=_mapped_stream(handler.stream_stream, method))
        return handler


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool = True) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("",) + self.service_names:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


async def start_server(
    # Any: each add_XServicer_to_server takes its own servicer type.
    registrations: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], object, str]],
    address: str,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    serving: bool = True,
) -> GrpcServer:
    """Start an aio server on `address` (host:port, port 0 = pick a free one).

    `registrations` holds (add_XServicer_to_server, servicer, full service name) triples.
    With ALISE_INTERNAL_TOKEN set, every call but health's must carry it (internal_auth.py).
    Health is SERVING for every service once started (`serving=False`: NOT_SERVING until
    `set_serving`); reflection lists them all.
    """
    token = internal_token()
    server = grpc.aio.server(
        interceptors=[
            *([TokenCheck(token)] if token else []),
            ErrorMappingInterceptor(),
            *interceptors,
        ],
        options=SERVER_OPTIONS,
    )
    names: list[str] = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    grpc_server = GrpcServer(server, health_servicer, port, tuple(names))
    await grpc_server.set_serving(serving)
    log.info("gRPC server listening", extra={"address": address, "port": port, "services": names})
    return grpc_server
