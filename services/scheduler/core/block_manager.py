"""Paged KV accounting for one executor: a device pool and a host (swap) pool of fixed-size blocks.

Pure bookkeeping: the executor owns the memory, this decides which block ids hold what.
Allocators check then act: a failed allocation returns None and changes nothing.

Step-ordering rule (executor runs swap_out, swap_in, free, then the forward pass): host blocks
released by a swap-in are quarantined until `begin_step()` so that a swap-out in the same step
never overwrites a host block that is still being read.

With `enable_prefix_caching` (core/prefix_cache.py, docs/scheduling.md "Prefix caching"), device
blocks are reference-counted and full blocks are shared read-only between requests:
  * `num_free_device_blocks` counts the plain free blocks plus the cached blocks no request
    holds (evictable on demand), so policies see every block an allocation could obtain;
  * a request without a device table whose `num_computed_tokens` is > 0 (the scheduler set it
    to its cached prefix, `cached_prefix_len`) gets those cached blocks attached by its first
    `allocate`, then fresh blocks for the rest;
  * `commit` registers blocks once they are full of computed tokens;
  * `swap_out` copies only the blocks the request holds alone. Blocks shared with other
    requests stay on the device with those requests; the swapped request drops its reference
    and remembers their hashes, so it pins no device memory while swapped. `swap_in`
    re-attaches them through the cache at their positions in the rebuilt table (only host
    blocks are copied back). If one was evicted meanwhile (`swap_in_lost`), the KV is gone:
    `Batch.swap_in` turns the request into a recompute, which keeps what is still cached;
  * `free` drops references: blocks left unreferenced join the LRU of cached blocks when
    registered, the free list otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.arith import ceil_div
from services.scheduler.core.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from services.scheduler.core.request import Request

_EMPTY: list[int] = []


class BlockManager:
    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = False,
        cache_salt: str = "",
    ) -> None:
        if num_device_blocks < 1:
            raise ValueError(f"num_device_blocks must be >= 1, got {num_device_blocks}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        # free lists are stacks; reversed so the lowest ids are handed out first
        self._free_dev = list(range(num_device_blocks - 1, -1, -1))
        self._free_host = list(range(num_host_blocks - 1, -1, -1))
        self._host_quarantine: list[int] = []
        self._dev: dict[str, list[int]] = {}
        self._host: dict[str, list[int]] = {}
        # swapped requests' shared blocks left on the device: (table position, block hash)
        self._kept: dict[str, list[tuple[int, int]]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.cache: PrefixCache | None = (
            PrefixCache(num_device_blocks, block_size, cache_salt, self._free_dev)
            if enable_prefix_caching
            else None
        )

    # -- sizes ------------------------------------------------------------------------------
    def blocks_for_tokens(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Free device blocks an `allocate(req, num_new_tokens)` takes: the blocks that grow
        the table to `num_computed_tokens + num_new_tokens`; for a request whose cached
        prefix is still to be attached, the fresh blocks plus the cached blocks it would take
        out of the evictable LRU (blocks other requests hold cost nothing)."""
        rid = req.request_id
        table = self._dev.get(rid)
        need = ceil_div(req.num_computed_tokens + num_new_tokens, self.block_size)
        if table:
            return need - len(table)
        if self.cache is None or not req.num_computed_tokens or rid in self._host:
            return need
        prefix = self._prefix(req)
        return need - len(prefix) + self.cache.attach_cost(prefix)

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens at the start of `req` (prompt, then output) whose KV sits in cached full
        blocks: never all of its tokens (one is left to compute); 0 without caching."""
        cache = self.cache
        if cache is None:
            return 0
        return len(cache.match(req, cache.max_prefix_blocks(req))) * self.block_size

    def attach_cost(self, req: Request) -> int:
        """Free-count blocks the attachment of `req`'s cached prefix would take (0 when it
        has a device table already or nothing cached)."""
        if self.cache is None or not req.num_computed_tokens or req.request_id in self._dev:
            return 0
        return self.cache.attach_cost(self._prefix(req))

    def _prefix(self, req: Request) -> list[int]:
        assert self.cache is not None
        return self.cache.match(req, req.num_computed_tokens // self.block_size)

    def num_swap_in_blocks(self, req: Request, num_new_tokens: int = 0) -> int:
        """Free device blocks that swapping `req` in and then growing it by `num_new_tokens`
        take: its host blocks, the shared blocks it left on the device that are now only
        cached (evictable), and what its table still lacks for the new tokens."""
        rid = req.request_id
        host = len(self._host.get(rid, _EMPTY))
        kept = self._kept.get(rid)
        if kept:
            held = host + len(kept)
            host += self._kept_cost(kept)
        else:
            held = host
        grow = ceil_div(req.num_computed_tokens + num_new_tokens, self.block_size) - held
        return host + grow if grow > 0 else host

    def _kept_cost(self, kept: list[tuple[int, int]]) -> int:
        cache = self.cache
        assert cache is not None
        by_hash, ref = cache.by_hash, cache.ref
        return sum(1 for _, h in kept if h in by_hash and ref[by_hash[h]] == 0)

    def swap_in_lost(self, request_id: str) -> bool:
        """Whether a shared block the swapped-out request left on the device was evicted
        since (its KV is gone: the request must be recomputed instead of swapped in)."""
        kept = self._kept.get(request_id)
        if not kept:
            return False
        assert self.cache is not None
        by_hash = self.cache.by_hash
        return any(h not in by_hash for _, h in kept)

    def num_swap_out_blocks(self, request_id: str, num_tokens: int) -> int:
        """Host blocks `swap_out(request_id, num_tokens)` would take (blocks held alone)."""
        table = self._dev.get(request_id, _EMPTY)
        keep = min(len(table), self.blocks_for_tokens(num_tokens))
        if self.cache is None:
            return keep
        ref = self.cache.ref
        return sum(1 for b in table[:keep] if ref[b] == 1)

    def num_freeable_blocks(self, request_id: str) -> int:
        """Device blocks that preempting the request would add to the free count (the ones
        it holds alone; shared blocks stay with their other holders)."""
        table = self._dev.get(request_id, _EMPTY)
        if self.cache is None:
            return len(table)
        ref = self.cache.ref
        return sum(1 for b in table if ref[b] == 1)

    @property
    def num_free_device_blocks(self) -> int:
        """Free device blocks, including cached blocks no request holds (evictable)."""
        if self.cache is not None:
            return len(self._free_dev) + len(self.cache.lru)
        return len(self._free_dev)

    @property
    def num_cached_free_blocks(self) -> int:
        """Of the free device blocks, those still holding cached KV."""
        return len(self.cache.lru) if self.cache is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def device_utilization(self) -> float:
        return 1.0 - self.num_free_device_blocks / self.num_device_blocks

    @property
    def host_utilization(self) -> float:
        if self.num_host_blocks == 0:
            return 0.0
        return 1.0 - (len(self._free_host) + len(self._host_quarantine)) / self.num_host_blocks

    # -- device allocation ------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        need = self.num_new_blocks(req, num_new_tokens)
        return need + reserve_blocks <= self.num_free_device_blocks

    def allocate(
        self, req: Request, num_new_tokens: int, reserve_blocks: int = 0
    ) -> list[int] | None:
        """Grow `req`'s device table to hold its computed + new tokens.

        Returns the newly added block ids ([] when none were needed) or None when the pool
        (minus `reserve_blocks`) cannot hold them; nothing changes on failure. With prefix
        caching, the first allocation of a request also attaches its cached prefix (its
        `num_computed_tokens`, whole blocks): the returned ids then start with those blocks.
        """
        if self.cache is not None:
            return self._allocate_cached(req, num_new_tokens, reserve_blocks)
        rid = req.request_id
        if rid in self._host:
            raise ValueError(f"request {rid} is swapped out; swap it in before allocating")
        table = self._dev.get(rid)  # num_new_blocks and ceil_div inlined: the hot path
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
        if table:
            need -= len(table)
        if need <= 0:
            return _EMPTY
        free = self._free_dev
        if need + reserve_blocks > len(free):
            return None
        new = [free.pop() for _ in range(need)]
        if table is None:
            self._dev[rid] = list(new)
        else:
            table.extend(new)
        return new

    def _allocate_cached(self, req: Request, num_new_tokens: int, reserve: int) -> list[int] | None:
        rid = req.request_id
        if rid in self._host:
            raise ValueError(f"request {rid} is swapped out; swap it in before allocating")
        cache = self.cache
        assert cache is not None
        need = ceil_div(req.num_computed_tokens + num_new_tokens, self.block_size)
        table = self._dev.get(rid)
        if table is None:
            return self._attach(req, need, reserve)
        need -= len(table)
        if need <= 0:
            return _EMPTY
        if need + reserve > cache.num_free:
            return None
        new = cache.take(need)
        table.extend(new)
        return new

    def _attach(self, req: Request, need: int, reserve: int) -> list[int] | None:
        """First allocation of a request under prefix caching: its cached prefix, then
        fresh blocks up to `need` blocks in all."""
        cache, bs, rid = self.cache, self.block_size, req.request_id
        assert cache is not None
        computed = req.num_computed_tokens
        prefix = cache.match(req, computed // bs) if computed else []
        if len(prefix) * bs != computed:
            raise ValueError(
                f"request {rid}: {computed} tokens counted as cached, "
                f"{len(prefix) * bs} are (set num_computed_tokens to cached_prefix_len first)"
            )
        fresh = need - len(prefix)
        if fresh + cache.attach_cost(prefix) + reserve > cache.num_free:
            return None
        cache.acquire(prefix)
        table = prefix + cache.take(fresh)
        if not table:
            return _EMPTY
        self._dev[rid] = table
        cache.queries += req.num_tokens
        cache.hits += computed
        return list(table)

    def commit(self, req: Request) -> None:
        """Register `req`'s device blocks that are full of computed tokens in the prefix cache
        (the scheduler calls it after each step; a no-op without caching)."""
        if self.cache is not None:
            table = self._dev.get(req.request_id)
            if table:
                self.cache.commit(req, table)

    def free(self, request_id: str) -> int:
        """Return every block of the request (device and host) to the pools; returns the count.
        With prefix caching a shared block only loses one reference, and an unreferenced
        cached block joins the LRU (the request's last block first, so the deepest blocks
        of a prefix are evicted before its head)."""
        n = 0
        cache = self.cache
        table = self._dev.pop(request_id, None)
        if table:
            if cache is None:
                self._free_dev.extend(reversed(table))
            else:
                cache.release(table[::-1])
            n += len(table)
        if cache is not None:
            self._kept.pop(request_id, None)  # shared blocks it left hold no reference of it
            cache.forget(request_id)
        table = self._host.pop(request_id, None)
        if table:
            self._free_host.extend(reversed(table))
            n += len(table)
        return n

    # -- swapping ---------------------------------------------------------------------------
    def swap_out(
        self, request_id: str, num_tokens: int | None = None
    ) -> list[tuple[int, int]] | None:
        """Move the request's KV to host blocks; returns (device, host) pairs, None if no room.

        With `num_tokens`, only the blocks holding those tokens are copied; the rest of the
        device table (blocks allocated but never written) is simply freed. With prefix
        caching, blocks shared with other requests are not copied: they stay on the device.
        """
        table = self._dev.get(request_id)
        if table is None:
            raise ValueError(f"request {request_id} has no device blocks to swap out")
        keep = (
            len(table)
            if num_tokens is None
            else min(len(table), self.blocks_for_tokens(num_tokens))
        )
        if self.cache is not None:
            return self._swap_out_cached(request_id, table, keep)
        if keep > len(self._free_host):
            return None
        del self._dev[request_id]
        if keep == 0:  # nothing computed yet: nothing to copy, the request simply loses its blocks
            self._free_dev.extend(reversed(table))
            return []
        host = [self._free_host.pop() for _ in range(keep)]
        self._free_dev.extend(reversed(table))
        self._host[request_id] = host
        return list(zip(table[:keep], host))

    def _swap_out_cached(
        self, request_id: str, table: list[int], keep: int
    ) -> list[tuple[int, int]] | None:
        cache = self.cache
        assert cache is not None
        ref = cache.ref
        moved = [i for i in range(keep) if ref[table[i]] == 1]
        if len(moved) > len(self._free_host):
            return None
        del self._dev[request_id]
        hash_of = cache.hash_of  # a shared block is always registered (attached by hash)
        kept = [(i, hash_of[table[i]]) for i in range(keep) if ref[table[i]] > 1]
        host = [self._free_host.pop() for _ in moved]
        pairs = [(table[i], h) for i, h in zip(moved, host)]
        # every reference goes: shared blocks stay with their other holders, and the moved
        # blocks' KV stays valid on the device, so registered ones join the LRU
        cache.release(table[::-1])
        if keep:
            self._host[request_id] = host
            if kept:
                self._kept[request_id] = kept
        return pairs

    def swap_in(self, request_id: str, reserve_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Move the request's KV back to device blocks; returns (host, device) pairs or None.
        Shared blocks it kept on the device return to their positions in its table."""
        host = self._host.get(request_id)
        if host is None:
            raise ValueError(f"request {request_id} is not swapped out")
        if self.cache is not None:
            return self._swap_in_cached(request_id, host, reserve_blocks)
        if len(host) + reserve_blocks > len(self._free_dev):
            return None
        del self._host[request_id]
        dev = [self._free_dev.pop() for _ in range(len(host))]
        self._dev[request_id] = dev
        self._host_quarantine.extend(host)
        return list(zip(host, dev))

    def _swap_in_cached(
        self, request_id: str, host: list[int], reserve: int
    ) -> list[tuple[int, int]] | None:
        cache = self.cache
        assert cache is not None
        kept = self._kept.get(request_id, [])
        shared = [cache.by_hash.get(h, -1) for _, h in kept]
        if -1 in shared:
            raise ValueError(f"request {request_id}: a shared block was evicted; recompute it")
        if len(host) + cache.attach_cost(shared) + reserve > cache.num_free:
            return None
        del self._host[request_id]
        self._kept.pop(request_id, None)
        cache.acquire(shared)
        dev = cache.take(len(host))
        table = [-1] * (len(host) + len(kept))
        for (i, _), b in zip(kept, shared):
            table[i] = b
        fresh = iter(dev)
        self._dev[request_id] = [next(fresh) if b < 0 else b for b in table]
        cache.recommit(request_id)
        self._host_quarantine.extend(host)
        return list(zip(host, dev))

    def begin_step(self) -> None:
        """Release host blocks read by the previous step's swap-ins."""
        if self._host_quarantine:
            self._free_host.extend(reversed(self._host_quarantine))
            self._host_quarantine.clear()

    # -- queries ----------------------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return list(self._dev.get(request_id, _EMPTY))

    def num_device_blocks_of(self, request_id: str) -> int:
        table = self._dev.get(request_id)
        return len(table) if table else 0

    def num_host_blocks_of(self, request_id: str) -> int:
        table = self._host.get(request_id)
        return len(table) if table else 0

    def num_kept_blocks_of(self, request_id: str) -> int:
        """Shared device blocks a swapped-out request still holds."""
        return len(self._kept.get(request_id, ()))

    def is_on_device(self, request_id: str) -> bool:
        return request_id in self._dev

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host

    def cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters: tokens looked up and found at attachment (queries, hits),
        evicted blocks, cached blocks now unreferenced; {} without caching."""
        cache = self.cache
        if cache is None:
            return {}
        return {
            "prefix_cache_queries": cache.queries,
            "prefix_cache_hits": cache.hits,
            "prefix_cache_evictions": cache.evictions,
            "prefix_cache_free_blocks": len(cache.lru),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError when a block is lost, duplicated or owned twice; with prefix
        caching also when refcounts, sharing, the LRU or the registry are inconsistent."""
        if self.cache is None:
            self._check_pool("device", self.num_device_blocks, self._free_dev, self._dev, [])
            assert not self._kept, "kept shared blocks without prefix caching"
        else:
            self.cache.check(list(self._dev.values()), self.num_device_blocks)
            assert all(self._dev.values()), "device: empty table kept"
            assert self._kept.keys() <= self._host.keys(), "kept blocks of a request not swapped"
        # a swapped request whose blocks are all shared has no host block, only kept ones
        host_tables = {rid: t for rid, t in self._host.items() if t or rid not in self._kept}
        self._check_pool(
            "host", self.num_host_blocks, self._free_host, host_tables, self._host_quarantine
        )
        both = self._dev.keys() & self._host.keys()
        assert not both, f"requests on device and host at once: {sorted(both)}"

    @staticmethod
    def _check_pool(
        name: str, total: int, free: list[int], tables: dict[str, list[int]], quarantine: list[int]
    ) -> None:
        owned = [b for t in tables.values() for b in t]
        every = owned + list(free) + list(quarantine)
        assert len(every) == total, f"{name}: {len(every)} blocks accounted, pool has {total}"
        assert len(set(every)) == total, f"{name}: a block is owned twice or free twice"
        assert all(0 <= b < total for b in every), f"{name}: block id out of range"
        assert all(len(t) > 0 for t in tables.values()), f"{name}: empty table kept"
