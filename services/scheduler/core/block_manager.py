"""Paged KV accounting for one executor: a device pool and a host (swap) pool of fixed-size blocks.

Pure bookkeeping: the executor owns the memory, this decides which block ids hold what.
Allocators check then act: a failed allocation returns None and changes nothing.

Step-ordering rule (executor runs swap_out, swap_in, free, then the forward pass): host blocks
released by a swap-in are quarantined until `begin_step()` so that a swap-out in the same step
never overwrites a host block that is still being read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.arith import ceil_div

if TYPE_CHECKING:
    from services.scheduler.core.request import Request

_EMPTY: list[int] = []


class BlockManager:
    def __init__(
        self, num_device_blocks: int, num_host_blocks: int = 0, block_size: int = 16
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

    # -- sizes ------------------------------------------------------------------------------
    def blocks_for_tokens(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Device blocks `req` needs so that `num_computed_tokens + num_new_tokens` fit."""
        table = self._dev.get(req.request_id)
        need = ceil_div(req.num_computed_tokens + num_new_tokens, self.block_size)
        return need - len(table) if table else need

    @property
    def num_free_device_blocks(self) -> int:
        return len(self._free_dev)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def device_utilization(self) -> float:
        return 1.0 - len(self._free_dev) / self.num_device_blocks

    @property
    def host_utilization(self) -> float:
        if self.num_host_blocks == 0:
            return 0.0
        return 1.0 - (len(self._free_host) + len(self._host_quarantine)) / self.num_host_blocks

    # -- device allocation ------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, reserve_blocks: int = 0) -> bool:
        return self.num_new_blocks(req, num_new_tokens) + reserve_blocks <= len(self._free_dev)

    def allocate(
        self, req: Request, num_new_tokens: int, reserve_blocks: int = 0
    ) -> list[int] | None:
        """Grow `req`'s device table to hold its computed + new tokens.

        Returns the newly added block ids ([] when none were needed) or None when the pool
        (minus `reserve_blocks`) cannot hold them; nothing changes on failure.
        """
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

    def free(self, request_id: str) -> int:
        """Return every block of the request (device and host) to the pools; returns the count."""
        n = 0
        table = self._dev.pop(request_id, None)
        if table:
            self._free_dev.extend(reversed(table))
            n += len(table)
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
        device table (blocks allocated but never written) is simply freed.
        """
        table = self._dev.get(request_id)
        if table is None:
            raise ValueError(f"request {request_id} has no device blocks to swap out")
        keep = (
            len(table)
            if num_tokens is None
            else min(len(table), self.blocks_for_tokens(num_tokens))
        )
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

    def swap_in(self, request_id: str, reserve_blocks: int = 0) -> list[tuple[int, int]] | None:
        """Move the request's KV back to device blocks; returns (host, device) pairs or None."""
        host = self._host.get(request_id)
        if host is None:
            raise ValueError(f"request {request_id} is not swapped out")
        if len(host) + reserve_blocks > len(self._free_dev):
            return None
        del self._host[request_id]
        dev = [self._free_dev.pop() for _ in range(len(host))]
        self._dev[request_id] = dev
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

    def is_on_device(self, request_id: str) -> bool:
        return request_id in self._dev

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host

    def check_invariants(self) -> None:
        """Raise AssertionError when a block is lost, duplicated or owned twice."""
        self._check_pool("device", self.num_device_blocks, self._free_dev, self._dev, [])
        self._check_pool(
            "host", self.num_host_blocks, self._free_host, self._host, self._host_quarantine
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
