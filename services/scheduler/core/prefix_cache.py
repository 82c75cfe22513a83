"""Automatic prefix caching for one device pool (docs/scheduling.md, "Prefix caching").

A *full* block (block_size tokens whose KV is computed) is identified by a chained hash:
    h_0 = salt,   h_i = hash((h_{i-1}, token ids of block i))
where the salt is derived from `cache_salt` (the model and KV dtype: anything that changes
the KV of the same tokens). Equal hashes mean equal token prefixes (up to a 64-bit hash
collision, the same assumption as vLLM's default builtin hash), so a request whose tokens
start with the same full blocks can read their KV instead of computing it.

State kept here, next to the BlockManager's free list:
  * `ref[b]`: how many device block tables hold block b; it is shared read-only when > 1;
  * `by_hash` / `hash_of`: the registered blocks (at most one block per hash; a duplicate
    computed concurrently stays private and unregistered);
  * `lru`: registered blocks no table holds any more, oldest first. They still hold valid KV
    and count as free: a new block is taken from the plain free list first, and only then
    by evicting the least recently freed cached block (its hash is dropped).
Hashes of a request's full blocks are computed once per request and kept until it is freed.
Pure bookkeeping, no I/O; hashlib only derives the salt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core.request import Request


def salt_hash(cache_salt: str) -> int:
    """The chain's root: a stable 63-bit integer of the salt (the same in every process)."""
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def chain_hashes(token_ids: list[int], block_size: int, cache_salt: str = "") -> list[int]:
    """Hashes of the full blocks of `token_ids` (for tests and placement look-ups)."""
    out: list[int] = []
    h = salt_hash(cache_salt)
    for i in range(len(token_ids) // block_size):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, cache_salt: str, free: list[int]):
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.root = salt_hash(cache_salt)
        self.free = free  # the BlockManager's free list (shared, not copied)
        self.ref = [0] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self._hashes: dict[str, list[int]] = {}  # request -> hashes of its full blocks
        self._committed: dict[str, int] = {}  # request -> leading blocks already registered
        # counters (tokens for queries/hits, blocks for evictions)
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- hashing and look-up ----------------------------------------------------------------
    def hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The request's block hashes, extended to at least `num_blocks` full blocks of its
        known tokens (prompt, then output)."""
        rid = req.request_id
        known = self._hashes.get(rid)
        if known is None:
            known = self._hashes[rid] = []
        if len(known) >= num_blocks:
            return known
        bs, prompt, output = self.block_size, req.prompt_token_ids, req.output_token_ids
        n_prompt = len(prompt)
        h = known[-1] if known else self.root
        for i in range(len(known), num_blocks):
            start, end = i * bs, (i + 1) * bs
            if end <= n_prompt:
                block = tuple(prompt[start:end])
            elif start >= n_prompt:
                block = tuple(output[start - n_prompt : end - n_prompt])
            else:
                block = tuple(prompt[start:]) + tuple(output[: end - n_prompt])
            h = hash((h, block))
            known.append(h)
        return known

    def max_prefix_blocks(self, req: Request) -> int:
        """Blocks a cache hit may cover: full blocks only, and never every known token (the
        last one is always computed, so the step has logits to sample from); none for a
        request that reads its prompt's logits."""
        if req.reads_prompt_logits:
            return 0
        return (req.num_known_tokens - 1) // self.block_size

    def peek(self, req: Request) -> int:
        """Leading blocks of `req` this cache holds, without remembering anything about it
        (placement asks every executor's cache about a request only one will admit)."""
        h, found, bs = self.root, 0, self.block_size
        tokens = req.all_token_ids
        for i in range(self.max_prefix_blocks(req)):
            h = hash((h, tuple(tokens[i * bs : (i + 1) * bs])))
            if h not in self.by_hash:
                break
            found += 1
        return found

    def match(self, req: Request, max_blocks: int) -> list[int]:
        """Cached blocks holding the longest prefix of `req`'s first `max_blocks` blocks."""
        by_hash = self.by_hash
        out: list[int] = []
        for h in self.hashes(req, max_blocks)[:max_blocks]:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def attach_cost(self, blocks: list[int]) -> int:
        """Free-count blocks that taking a reference on `blocks` consumes (the evictable
        ones; blocks another request holds cost nothing)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    # -- references -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (out of the LRU when unreferenced)."""
        ref, lru = self.ref, self.lru
        for b in blocks:
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1

    def take(self, n: int) -> list[int]:
        """n fresh blocks (referenced once): free ones first, then evict the oldest cached."""
        out: list[int] = []
        free, ref = self.free, self.ref
        for _ in range(n):
            if free:
                b = free.pop()
            else:
                b = self.lru.popitem(last=False)[0]
                del self.by_hash[self.hash_of.pop(b)]
                self.evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block, in the order given: an unreferenced registered
        block joins the LRU (the first given is evicted first), any other goes free."""
        ref, lru, hash_of, free = self.ref, self.lru, self.hash_of, self.free
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0:
                if b in hash_of:
                    lru[b] = None
                else:
                    free.append(b)

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        self._committed.pop(request_id, None)

    def recommit(self, request_id: str) -> None:
        """Look at every full block of the request again at its next `commit` (after a
        swap-in rebuilt its table with new blocks)."""
        self._committed.pop(request_id, None)

    # -- registration -----------------------------------------------------------------------
    def commit(self, req: Request, table: list[int]) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        rid = req.request_id
        # tokens whose ids are known (a pipelined step may compute one still being sampled)
        full = min(req.num_computed_tokens, req.num_known_tokens) // self.block_size
        done = self._committed.get(rid, 0)
        if full <= done:
            return
        hashes = self.hashes(req, full)
        by_hash, hash_of = self.by_hash, self.hash_of
        for i in range(done, min(full, len(table))):
            b, h = table[i], hashes[i]
            if b not in hash_of and h not in by_hash:
                by_hash[h] = b
                hash_of[b] = h
        self._committed[rid] = full

    # -- checks -----------------------------------------------------------------------------
    def check(self, holders: list[list[int]], total: int) -> None:
        """Raise AssertionError when refcounts, the LRU, the registry or the free list
        disagree with the tables in `holders` (every device block table)."""
        count = [0] * total
        for table in holders:
            assert len(set(table)) == len(table), "a table holds one block twice"
            for b in table:
                count[b] += 1
        assert count == self.ref, "refcounts differ from the tables holding the blocks"
        lru, free = set(self.lru), set(self.free)
        assert not lru & free, "a block is both cached-free and free"
        for b in range(total):
            held = count[b] > 0
            assert held + (b in lru) + (b in free) == 1, f"block {b}: held, cached or free?"
        assert all(b in self.hash_of for b in lru), "an LRU block has no hash"
        assert not free & self.hash_of.keys(), "a free block still has a hash"
        assert len(self.by_hash) == len(self.hash_of), "registry out of step"
        for h, b in self.by_hash.items():
            assert self.hash_of.get(b) == h, f"block {b} registered under two hashes"
