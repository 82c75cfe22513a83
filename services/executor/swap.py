"""Host swap pool, with copies overlapped with compute.

A single worker thread runs one copy job per step (torch releases the GIL); on CUDA the job
issues its copies on a side stream after the forward passes queued so far. Jobs run in
submission order, so a swap-in of a host block always sees the swap-out that filled it. A step
waits only for jobs touching the device blocks it computes on.

With `compress`, full-precision blocks are stored on the host as INT8 (keys per channel over
the block, values per token; quant.py) and dequantized on the way back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from services.executor import quant
from services.executor.int8_kv import int8_layout
from services.executor.kv_cache import allocate, layout_bytes

if TYPE_CHECKING:
    from services.executor.runner import KVCache


class SwapManager:
    def __init__(self, cache: KVCache, num_host_blocks: int, compress: bool = False) -> None:
        self.cache, self.device = cache, cache.device
        self.compress = compress and "k" in cache.tensors  # only full-precision pools compress
        layout = (
            int8_layout(cache.block_size, cache.kv_heads, cache.head_dim)
            if self.compress
            else cache.layout
        )
        self.host_bytes_per_block = self.host_block_bytes(cache, compress)
        self.host = allocate(
            cache.num_layers,
            cache.kv_heads,
            num_host_blocks,
            layout,
            "cpu",
            pin=self.device.type == "cuda",
        )
        self.num_host_blocks = num_host_blocks
        self.pending: dict[int, Future] = {}  # device block -> its latest copy job
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-swap")

    @staticmethod
    def host_block_bytes(cache: KVCache, compress: bool) -> int:
        compress = compress and "k" in cache.tensors
        layout = (
            int8_layout(cache.block_size, cache.kv_heads, cache.head_dim)
            if compress
            else cache.layout
        )
        return layout_bytes(cache.num_layers, cache.kv_heads, layout)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Queue one step's copies. Semantics of a parallel assignment: every source is read
        before any target is written, so a step may reuse a device block it swaps out as a
        swap-in target, and a host block it swaps in from as a swap-out target."""
        if not swap_out and not swap_in:
            return
        ids = [
            torch.tensor([p[i] for p in pairs], dtype=torch.long)
            for pairs in (swap_out, swap_in)
            for i in (0, 1)
        ]
        ready = None
        if self.device.type == "cuda":  # the copies must see the forward passes queued so far
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        handle = self.pool.submit(self._job, ready, *ids)
        for b in [src for src, _ in swap_out] + [dst for _, dst in swap_in]:
            self.pending[b] = handle

    def _job(self, ready, out_src, out_dst, in_src, in_dst) -> None:
        if self.stream is None:
            self._copy(out_src, out_dst, in_src, in_dst)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self._copy(out_src, out_dst, in_src, in_dst)
            self.stream.synchronize()

    # tensors are [L, Hkv, NB, ...]: the block axis is 2
    def _copy(self, out_src, out_dst, in_src, in_dst) -> None:
        dev, dev_out, dev_in = self.cache.tensors, out_src.to(self.device), in_dst.to(self.device)
        leaving = {n: t[:, :, dev_out] for n, t in dev.items()} if out_src.numel() else {}
        if self.compress and leaving:
            leaving = self._compress(leaving)
        arriving = (
            {n: t[:, :, in_src].to(self.device, non_blocking=True) for n, t in self.host.items()}
            if in_src.numel()
            else {}
        )
        if self.compress and arriving:
            arriving = self._decompress(arriving)
        for name, data in leaving.items():
            self.host[name][:, :, out_dst] = data.to("cpu")  # waits for the gather
        for name, data in arriving.items():
            dev[name][:, :, dev_in] = data

    @staticmethod
    def _compress(blocks: dict) -> dict:
        out = {}
        for name, q in (("k", quant.quantize_keys), ("v", quant.quantize_values)):
            codes, scale, offset = q(blocks[name])  # [L, Hkv, N, bs, D]
            out.update({name + "q": codes, name + "s": scale, name + "o": offset})
        return out

    def _decompress(self, h: dict) -> dict:
        dtype = self.cache.dtype
        return {
            "k": quant.dequantize_keys(h["kq"], h["ks"], h["ko"], dtype),
            "v": quant.dequantize_values(h["vq"], h["vs"], h["vo"], dtype),
        }

    def wait_for(self, device_blocks: Iterable[int]) -> float:
        """Block until copies touching these device blocks are done; returns seconds waited."""
        handles = {id(h): h for b in device_blocks if (h := self.pending.get(b)) is not None}
        start = time.perf_counter()
        for h in handles.values():
            h.result()
        self._forget_done()
        return time.perf_counter() - start

    def _forget_done(self) -> None:
        for b in [b for b, h in self.pending.items() if h.done()]:
            del self.pending[b]

    def synchronize(self) -> None:
        self.wait_for(list(self.pending))

    def close(self) -> None:
        self.synchronize()
        self.pool.shutdown(wait=True)
