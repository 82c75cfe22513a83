"""Per-API-key limits on `/v1`: concurrent requests (streams included, held until the
response has ended) and request rate (a token bucket), each answered 429 with
`Retry-After` and an OpenAI-style body. Only keys the gateway accepts are counted (a wrong
key gets its 401 from the route, and cannot grow this table); without keys configured, the
limits apply to all clients together. 0 = no limit (the default).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gateway.errors import APIError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class Bucket:
    rate_per_s: float
    burst: float
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float) -> float:
        """0.0 when a request may go now (and counts it), else seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate_per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class KeyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        keys: list[str],
        max_concurrent: int = 0,
        rate_per_s: float = 0.0,
        burst: int = 0,
    ) -> None:
        self.app = app
        self.keys = set(keys)
        self.max_concurrent = max_concurrent
        self.rate_per_s = rate_per_s
        self.burst = float(burst or max(1, math.ceil(rate_per_s)))
        self.active: dict[str, int] = {}
        self.buckets: dict[str, Bucket] = {}

    def _key(self, scope: Scope) -> str | None:
        """The limited key of this request, or None (not /v1, or a key the route refuses)."""
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return None
        given = ""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                given = token.strip() if scheme.lower() == "bearer" else ""
        if not self.keys:
            return ""
        return given if given in self.keys else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self._key(scope)
        if key is None or not (self.max_concurrent or self.rate_per_s):
            return await self.app(scope, receive, send)
        if self.rate_per_s:
            bucket = self.buckets.setdefault(key, Bucket(self.rate_per_s, self.burst))
            wait_s = bucket.take(time.monotonic())
            if wait_s:
                return await _refuse(send, "request rate limit of this API key", wait_s)
        if self.max_concurrent and self.active.get(key, 0) >= self.max_concurrent:
            return await _refuse(
                send, f"more than {self.max_concurrent} concurrent requests for this API key", 1.0
            )
        self.active[key] = self.active.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active[key] -= 1


async def _refuse(send: Send, what: str, retry_after_s: float) -> None:
    error = APIError(
        429,
        f"{what} exceeded; retry later",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )

    async def no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
        return {"type": "http.disconnect"}

    await error.response()({"type": "http"}, no_receive, send)
