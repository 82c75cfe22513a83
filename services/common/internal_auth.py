"""Service-to-service authentication: a shared secret in gRPC metadata.

Every gRPC server (executor, scheduler, predictor) refuses a call that does not carry
`ALISE_INTERNAL_TOKEN` in its `alise-internal-token` metadata with UNAUTHENTICATED, except
the standard health service (probes and the launcher ask it without credentials; it says
only SERVING or not). Every channel made by `services.common.grpc_client` adds the token
from the same variable. Unset or empty = no check (a development stack on one machine);
`alise serve` generates one per start, compose and Kubernetes take it from a Secret/env.

Why a shared secret rather than mTLS: it is one value in one Secret, the same in compose,
Kubernetes and `alise serve` (generated per start), with no certificates to issue, rotate
and match to pod names, and checking it costs a constant-time comparison per call. What it
does not do is encrypt: on a network that others can read, run the services behind a mesh
that adds mTLS (Istio, Linkerd) or on a private network; the token then still keeps every
process that does not hold it out of the internal plane.
"""

from __future__ import annotations

import hmac
import os
from collections import namedtuple
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

TOKEN_ENV = "ALISE_INTERNAL_TOKEN"
METADATA_KEY = "alise-internal-token"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def internal_token() -> str:
    return os.environ.get(TOKEN_ENV, "")


def _presented(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {METADATA_KEY} metadata"
        )

    make = (
        grpc.unary_unary_rpc_method_handler
        if not handler.request_streaming and not handler.response_streaming
        else grpc.unary_stream_rpc_method_handler
        if not handler.request_streaming
        else grpc.stream_unary_rpc_method_handler
        if not handler.response_streaming
        else grpc.stream_stream_rpc_method_handler
    )
    return make(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call but health's without the shared secret."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        if hmac.compare_digest(_presented(details.invocation_metadata).encode(), self.token):
            return handler
        return _refusal(handler)


def _with_token(metadata: Any, token: str) -> Any:
    return grpc.aio.Metadata(*(metadata or ()), (METADATA_KEY, token))


class _AioAdder:
    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return d._replace(metadata=_with_token(d.metadata, self.token))


# grpc.aio files an interceptor under the first call kind it is an instance of, so each kind
# needs a class of its own.
class _AioUnaryUnary(_AioAdder, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioAdder, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioAdder, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioAdder, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def aio_token_interceptors(token: str | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the shared secret (default: ALISE_INTERNAL_TOKEN) to every call
    of an asyncio channel; none when there is no secret."""
    token = internal_token() if token is None else token
    if not token:
        return []
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    return [kind(token) for kind in kinds]


class CallDetails(
    namedtuple(
        "CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    """A blocking channel's call details, rebuilt by a client interceptor (grpc's own class
    is abstract)."""


class SyncTokenAdder(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """The blocking-channel twin of `AioTokenAdder`."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return CallDetails(
            d.method,
            d.timeout,
            [*(d.metadata or ()), (METADATA_KEY, self.token)],
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
