"""Host swap pool, with copies overlapped with compute.

A single worker thread runs one copy job per step, in submission order, so a swap-in of a
host block always sees the swap-out that filled it. A step waits only for jobs touching the
device blocks it computes on. The host pool is allocated pinned on CUDA (one allocation).

On CPU a job copies directly (torch releases the GIL). On CUDA it runs on a side stream,
ordered with CUDA events rather than device-wide synchronisation: the job's stream waits for an
event recorded when the step queued it (the forward passes so far), gathers the leaving
blocks on the device and copies them asynchronously into pinned staging buffers, gathers the
arriving host blocks into pinned staging and copies them up, scatters them into the pool, and
records a `done` event. A step that needs those blocks makes its own stream wait for `done`
(the host waits only until the job has been issued); the worker then waits for `done` and
scatters the staged blocks into the host pool.

With `compress`, full-precision blocks are stored on the host as INT8 (keys per channel over
the block, values per token; quant.py) and dequantized on the way back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from services.executor import quant
from services.executor.int8_kv import int8_layout
from services.executor.kv_cache import allocate, layout_bytes

if TYPE_CHECKING:
    from services.executor.kv_pool import KVCache

Blocks = dict[str, torch.Tensor]  # tensor name -> blocks [L, Hkv, n, ...]


class PinnedStaging:
    """One reusable pinned host buffer per tensor name, grown on demand. Swap jobs run one at
    a time and finish only after their copies, so one set serves them all."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = self.buffers[name] = torch.empty(size, dtype=dtype, pin_memory=True)
        return buf[:numel].view(shape)


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
        # device block -> its latest job (CUDA: the job's `issued` future, whose result is the
        # event after its copies; CPU: the job itself, result None)
        self.pending: dict[int, Future] = {}
        self.last: Future | None = None  # the latest job: all before it are done when it is
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.staging = (PinnedStaging(), PinnedStaging()) if self.stream is not None else None
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
        pin = self.stream is not None  # index tensors copied up asynchronously
        ids = [
            torch.tensor([p[i] for p in pairs], dtype=torch.long, pin_memory=pin)
            for pairs in (swap_out, swap_in)
            for i in (0, 1)
        ]
        if self.stream is None:
            handle = self.last = self.pool.submit(self._copy, *ids)
        else:  # the copies must see the forward passes queued so far
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            handle = Future()
            self.last = self.pool.submit(self._job, ready, handle, *ids)
        for b in [src for src, _ in swap_out] + [dst for _, dst in swap_in]:
            self.pending[b] = handle

    def _job(self, ready, issued: Future, out_src, out_dst, in_src, in_dst) -> None:
        """CUDA: issue the copies on the swap stream, publish `done`, then land the leaving
        blocks in the host pool."""
        try:
            with torch.cuda.device(self.device):
                arriving = self._gather_host(in_src)  # every source is read before any write
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    leaving = self._device_to_staging(out_src)
                    self._staging_to_device(arriving, in_dst)
                    done = torch.cuda.Event()
                    done.record(self.stream)
        except BaseException as exc:
            issued.set_exception(exc)
            raise
        issued.set_result(done)
        done.synchronize()  # the leaving blocks are in pinned staging
        for name, data in leaving.items():
            self.host[name][:, :, out_dst] = data

    def _gather_host(self, in_src: torch.Tensor) -> Blocks:
        if not in_src.numel():
            return {}
        out = {}
        for name, t in self.host.items():
            shape = (t.shape[0], t.shape[1], in_src.numel(), *t.shape[3:])
            buf = self.staging[1].view(name, shape, t.dtype)
            torch.index_select(t, 2, in_src, out=buf)
            out[name] = buf
        return out

    def _device_to_staging(self, out_src: torch.Tensor) -> Blocks:
        if not out_src.numel():
            return {}
        idx = out_src.to(self.device, non_blocking=True)
        leaving = {n: t[:, :, idx] for n, t in self.cache.tensors.items()}
        if self.compress:
            leaving = self._compress(leaving)
        out = {}
        for name, data in leaving.items():
            out[name] = self.staging[0].view(name, tuple(data.shape), data.dtype)
            out[name].copy_(data, non_blocking=True)
        return out

    def _staging_to_device(self, arriving: Blocks, in_dst: torch.Tensor) -> None:
        if not arriving:
            return
        idx = in_dst.to(self.device, non_blocking=True)
        up = {n: h.to(self.device, non_blocking=True) for n, h in arriving.items()}
        if self.compress:
            up = self._decompress(up)
        for name, data in up.items():
            self.cache.tensors[name][:, :, idx] = data

    # tensors are [L, Hkv, NB, ...]: the block axis is 2
    def _copy(self, out_src, out_dst, in_src, in_dst) -> None:
        """CPU: the whole job, synchronously on the worker."""
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
        """Order this step after the copies touching these device blocks; returns seconds
        the host waited (CPU: for the copies; CUDA: until they were issued)."""
        handles = {id(h): h for b in device_blocks if (h := self.pending.get(b)) is not None}
        start = time.perf_counter()
        for h in handles.values():
            done = h.result()
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
        self._forget_done(set(handles))
        return time.perf_counter() - start

    def _forget_done(self, waited: set[int]) -> None:
        """Drop jobs this stream is ordered after (waited for) or whose copies completed."""
        for b in [b for b, h in self.pending.items() if id(h) in waited or self._complete(h)]:
            del self.pending[b]

    @staticmethod
    def _complete(h: Future) -> bool:
        if not h.done() or h.exception() is not None:
            return h.done()
        done = h.result()
        return done is None or bool(done.query())

    def synchronize(self) -> None:
        """Wait for every job, its host-side work included."""
        self.wait_for(list(self.pending))
        if self.last is not None:
            self.last.result()

    def close(self) -> None:
        self.synchronize()
        self.pool.shutdown(wait=True)
