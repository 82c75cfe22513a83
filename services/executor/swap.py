"""Host swap pool, with copies overlapped with compute.

On CPU a single worker thread does the copies (torch releases the GIL), on CUDA a side stream
does them. Jobs run in submission order, so a swap-in of a host block always sees the
swap-out that filled it. A step waits only for jobs touching the device blocks it computes on.

With `compress`, full-precision blocks are stored on the host as INT8 (keys per channel over
the block, values per token; quant.py) and dequantized on the way back.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.executor import quant
from services.executor.int8_kv import int8_layout
from services.executor.kv_cache import allocate, layout_bytes


class SwapManager:
    def __init__(self, cache, num_host_blocks: int, compress: bool = False) -> None:
        self.cache, self.device = cache, cache.device
        self.compress = compress and "k" in cache.tensors  # only full-precision pools compress
        layout = int8_layout(cache.block_size, cache.kv_heads, cache.head_dim) \
            if self.compress else cache.layout
        self.host_bytes_per_block = self.host_block_bytes(cache, compress)
        self.host = allocate(cache.num_layers, cache.kv_heads, num_host_blocks, layout, "cpu",
                             pin=self.device.type == "cuda")
        self.num_host_blocks = num_host_blocks
        self.pending: dict[int, object] = {}   # device block -> Future / cuda Event
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        else:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-swap")

    @staticmethod
    def host_block_bytes(cache, compress: bool) -> int:
        compress = compress and "k" in cache.tensors
        layout = int8_layout(cache.block_size, cache.kv_heads, cache.head_dim) \
            if compress else cache.layout
        return layout_bytes(cache.num_layers, cache.kv_heads, layout)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._submit(self._copy_out, pairs, [src for src, _ in pairs])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._submit(self._copy_in, pairs, [dst for _, dst in pairs])

    def _submit(self, fn, pairs, device_blocks: list[int]) -> None:
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
        if self.device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                fn(src, dst)
                handle = torch.cuda.Event()
                handle.record(self.stream)
        else:
            handle = self.pool.submit(fn, src, dst)
        for b in device_blocks:
            self.pending[b] = handle

    # tensors are [L, Hkv, NB, ...]: the block axis is 2
    def _copy_out(self, dev_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        dev, ids = self.cache.tensors, dev_ids.to(self.device)
        if not self.compress:
            for name, t in dev.items():
                self.host[name][:, :, host_ids] = t[:, :, ids].to("cpu", non_blocking=True)
            return
        for name, q in (("k", quant.quantize_keys), ("v", quant.quantize_values)):
            codes, scale, offset = q(dev[name][:, :, ids])                   # [L, Hkv, N, bs, D]
            for suffix, val in (("q", codes), ("s", scale), ("o", offset)):
                self.host[name + suffix][:, :, host_ids] = val.to("cpu", non_blocking=True)

    def _copy_in(self, host_ids: torch.Tensor, dev_ids: torch.Tensor) -> None:
        dev, ids = self.cache.tensors, dev_ids.to(self.device)
        if not self.compress:
            for name, t in dev.items():
                t[:, :, ids] = self.host[name][:, :, host_ids].to(self.device, non_blocking=True)
            return
        h = {n: t[:, :, host_ids].to(self.device, non_blocking=True) for n, t in self.host.items()}
        dtype = self.cache.dtype
        dev["k"][:, :, ids] = quant.dequantize_keys(h["kq"], h["ks"], h["ko"], dtype)
        dev["v"][:, :, ids] = quant.dequantize_values(h["vq"], h["vs"], h["vo"], dtype)

    def wait_for(self, device_blocks) -> float:
        """Block until copies touching these device blocks are done; returns seconds waited."""
        handles = {id(h): h for b in device_blocks if (h := self.pending.get(b)) is not None}
        start = time.perf_counter()
        for h in handles.values():
            if isinstance(h, Future):
                h.result()
            else:
                torch.cuda.current_stream(self.device).wait_event(h)
        self._forget_done()
        return time.perf_counter() - start

    def _forget_done(self) -> None:
        done = [b for b, h in self.pending.items()
                if (h.done() if isinstance(h, Future) else h.query())]
        for b in done:
            del self.pending[b]

    def synchronize(self) -> None:
        self.wait_for(list(self.pending))

    def close(self) -> None:
        self.synchronize()
        if self.device.type != "cuda":
            self.pool.shutdown(wait=True)
