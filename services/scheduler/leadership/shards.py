"""Scheduler shards: which shard owns which registered executor, kept in Redis.

    {ns}:executor_shards   hash   address -> "<shard>:<generation>"
    {ns}:executor_gen      int    counts assignments (every new one takes the next value)

Every shard leader runs `assign` at each discovery pass with the live registry members; the
script (atomic) forgets executors whose registration lapsed, moves those of shards that no
longer exist, and gives each unassigned executor to the shard that owns the fewest (ties to the
lowest shard). A live executor keeps its shard, so its requests never change hands while it
serves; one that lapsed and registers again may land elsewhere.

The generation fences a move: a loop sends Steps with epoch `generation * 2**32 + lease epoch`
(`fenced_epoch`), so the executor refuses the old owner's late Steps once the new owner has
sent one, and the new owner's first Step drops whatever the old one left there. Within one
assignment, a newer leader of the same shard still outranks an older one.
"""

from __future__ import annotations

import redis.asyncio as aioredis

GENERATION_SHIFT = 32  # lease epochs stay far below 2**32

_ASSIGN = """
local live, n = {}, tonumber(ARGV[1])
for i = 2, #ARGV do live[ARGV[i]] = true end
local counts = {}
for s = 0, n - 1 do counts[s] = 0 end
local owned = redis.call('HGETALL', KEYS[1])
for i = 1, #owned, 2 do
  local addr, shard = owned[i], tonumber(string.match(owned[i + 1], '^(%d+):'))
  if not live[addr] or shard == nil or shard >= n then
    redis.call('HDEL', KEYS[1], addr)
  else
    counts[shard] = counts[shard] + 1
    live[addr] = false
  end
end
for i = 2, #ARGV do
  local addr = ARGV[i]
  if live[addr] then
    local best = 0
    for s = 1, n - 1 do if counts[s] < counts[best] then best = s end end
    counts[best] = counts[best] + 1
    local gen = redis.call('INCR', KEYS[2])
    redis.call('HSET', KEYS[1], addr, best .. ':' .. gen)
  end
end
return redis.call('HGETALL', KEYS[1])
"""


def shards_key(namespace: str) -> str:
    return f"{namespace}:executor_shards"


def fenced_epoch(generation: int, lease_epoch: int) -> int:
    return (generation << GENERATION_SHIFT) + lease_epoch


async def assign(
    client: aioredis.Redis, namespace: str, live: list[str], num_shards: int
) -> dict[str, tuple[int, int]]:
    """Assign the live executors to shards; address -> (shard, generation) for every live one."""
    reply = await client.eval(
        _ASSIGN, 2, shards_key(namespace), f"{namespace}:executor_gen", num_shards, *sorted(live)
    )
    flat = [x.decode() if isinstance(x, bytes) else x for x in reply]
    owners = {}
    for address, value in zip(flat[::2], flat[1::2]):
        shard, gen = value.split(":")
        owners[address] = (int(shard), int(gen))
    return owners
