"""Stored Responses (`/v1/responses` with `store`): one JSON record per response id, kept for
`response_ttl_s`.

With `ALISE_REDIS_URL` set (as `alise serve`, docker compose and the Kubernetes manifests set
it) the records live in Redis under `alise:response:<id>`, so a conversation continued with
`previous_response_id` may land on any gateway replica; unset, they live in this process's
memory (at most MEMORY_CAP records, the oldest dropped first). Redis being unreachable is a
503 for the request that needs it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from services.gateway.errors import APIError

KEY_PREFIX = "alise:response:"
MEMORY_CAP = 10_000


class ResponseStore:
    def __init__(self, redis_url: str | None, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._memory: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._redis = None
        if redis_url:
            from services.common.redis_runner import async_client

            self._redis = async_client(redis_url)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        data = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        if self._redis is None:
            self._memory[response_id] = (time.monotonic() + self.ttl_s, data)
            self._memory.move_to_end(response_id)
            while len(self._memory) > MEMORY_CAP:
                self._memory.popitem(last=False)
            return
        await self._call(self._redis.set(KEY_PREFIX + response_id, data, px=self._ttl_ms()))

    async def get(self, response_id: str) -> dict[str, Any] | None:
        if self._redis is None:
            expires, data = self._memory.get(response_id, (0.0, ""))
            if expires < time.monotonic():
                self._memory.pop(response_id, None)
                return None
            record: dict[str, Any] = json.loads(data)
            return record
        raw = await self._call(self._redis.get(KEY_PREFIX + response_id))
        return None if raw is None else dict(json.loads(raw))

    async def delete(self, response_id: str) -> bool:
        if self._redis is None:
            found = await self.get(response_id) is not None
            self._memory.pop(response_id, None)
            return found
        return bool(await self._call(self._redis.delete(KEY_PREFIX + response_id)))

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    async def _call(self, awaitable: Any) -> Any:
        import redis

        try:
            return await awaitable
        except (redis.RedisError, OSError) as exc:
            raise APIError(
                503,
                f"the response store (Redis) is unavailable: {exc}",
                code="store_unavailable",
                headers={"Retry-After": "1"},
            ) from None
