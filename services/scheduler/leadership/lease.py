"""The scheduler leader lease: one scheduler of several against one Redis serves, the others
stand by and take over when its lease lapses.

    {ns}:leader   string  the holder's id (`host:port/instance`), with a TTL (`lease_ttl_s`)
    {ns}:epoch    int     the leadership epoch: incremented each time another holder takes over

The leader renews its lease every `lease_renew_s`. A standby tries to acquire it every
`lease_renew_s / 2`, so it takes over at most `lease_ttl_s + lease_renew_s / 2` after the
leader's last renewal (plus the time to rebuild from Redis). Every iteration commit carries the
holder's epoch and Redis refuses one from an older epoch (store_script.py), so a deposed
leader that wakes up late cannot write; it learns it lost the lease from that refusal or from
its next renewal, and stands by again.

A holder whose lease expired while nobody else took it (e.g. Redis was unreachable for longer
than the TTL) gets it back with the same epoch, so its queued writes stay valid; a stored epoch
below the holder's (Redis restarted without its last second of writes) is written back. A new process
always starts a new epoch; when the recorded holder has this process's own address, it was a
previous process on the same port, which is dead (the port is bound exclusively), and this one
takes over at once instead of waiting for the TTL.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

NOT_LEADER = "not the leader"  # in the details of UNAVAILABLE from a scheduler standing by

# KEYS: leader, epoch. ARGV: holder id, ttl ms, held epoch (0 = none), holder address.
# Returns the epoch now held, or 0 when another holder has the lease.
ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
local epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
local mine = tonumber(ARGV[3])
if cur == ARGV[1] and mine == epoch then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return epoch
end
if cur and cur ~= ARGV[1] then
  local addr = string.match(cur, '^(.*)/[^/]*$')
  if addr ~= ARGV[4] then return 0 end
end
if cur == false and mine > 0 and mine >= epoch then
  if mine > epoch then redis.call('SET', KEYS[2], mine) end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return mine
end
if mine > 0 then return 0 end
epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return epoch
"""

# KEYS: leader. ARGV: holder id. Deletes the lease only if this holder has it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class LeaseTiming:
    ttl_s: float = 3.0
    renew_s: float = 1.0

    @property
    def takeover_bound_s(self) -> float:
        """Worst case from the leader's last renewal to a standby holding the lease."""
        return self.ttl_s + self.renew_s / 2


class Lease:
    """Acquire, renew and release the leader lease of namespace `ns`.

    `epoch` is 0 until acquired and again once `renew()` found another holder (the next
    acquisition then starts a new term)."""

    def __init__(
        self, client: aioredis.Redis, ns: str, address: str, timing: LeaseTiming | None = None
    ) -> None:
        self.client = client
        self.keys = [f"{ns}:leader", f"{ns}:epoch"]
        self.address = address
        self.holder = f"{address}/{uuid.uuid4().hex[:12]}"
        self.timing = timing or LeaseTiming()
        self.epoch = 0
        self._acquire = client.register_script(ACQUIRE)
        self._release = client.register_script(RELEASE)

    async def try_acquire(self) -> bool:
        """Take the lease when it is free (or ours); True when this holder now leads."""
        ttl_ms = max(1, int(self.timing.ttl_s * 1000))
        got = int(
            await self._acquire(
                keys=self.keys, args=[self.holder, ttl_ms, self.epoch, self.address]
            )
        )
        if got == 0:
            return False
        if got != self.epoch:
            log.info("leader lease acquired", extra={"holder": self.holder, "epoch": got})
        self.epoch = got
        return True

    async def renew(self) -> bool:
        """Extend our lease; False when another holder has taken it over."""
        if self.epoch == 0:
            return False
        if await self.try_acquire():
            return True
        log.warning("leader lease lost", extra={"holder": self.holder, "epoch": self.epoch})
        self.epoch = 0
        return False

    async def release(self) -> None:
        """Give the lease up (a clean shutdown), so a standby takes over without waiting."""
        await self._release(keys=self.keys[:1], args=[self.holder])

    async def holder_now(self) -> str | None:
        raw = await self.client.get(self.keys[0])
        return raw.decode() if isinstance(raw, bytes) else raw
