"""Triton attention backend: KV write (+ INT8 block quantization) and paged attention kernels.

Selected automatically on CUDA. On CPU tensors the same kernels run under Triton's
interpreter (slow; used to check correctness against the torch reference backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.executor import triton_kernels as kern
from services.executor.int8_kv import Int8PagedKV
from services.executor.ragged_batch import StepBatch

if TYPE_CHECKING:
    from services.executor.runner import KVCache


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonAttention:
    name = "triton"
    group_cost: int | None = None  # ragged kernels pad nothing: one group per kind suffices

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, device: torch.device
    ) -> None:
        if not _pow2(head_dim):
            raise ValueError(f"the Triton backend needs a power-of-two head_dim, not {head_dim}")
        if device.type != "cuda" and not kern.INTERPRETED:
            raise ValueError(
                "the Triton backend on CPU needs TRITON_INTERPRET=1 in the "
                "environment (set before start); use attention_backend=torch"
            )
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.g = num_heads // num_kv_heads
        self.meta: dict[str, torch.Tensor] = {}

    def prepare(self, batch: StepBatch) -> None:
        """Per-step metadata (int32), shared by every layer's kernels."""
        if not _pow2(batch.block_size):
            raise ValueError("the Triton backend needs a power-of-two block size")
        dev = batch.token_ids.device
        runs = batch.runs
        nb_max = max(len(r.block_table) for r in runs)
        tables = torch.zeros((len(runs), nb_max), dtype=torch.int32)
        for i, r in enumerate(runs):
            tables[i, : len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
        req = torch.repeat_interleave(
            torch.arange(len(runs)), torch.tensor([r.q_len for r in runs])
        )
        i32 = dict(dtype=torch.int32, device=dev)
        self.meta = {
            "tok_req": req.to(**i32),
            "tok_pos": batch.positions.to(torch.int32),
            "tables": tables.to(dev),
            "slots": batch.slot_mapping.to(torch.int32),
            "req_ctx": torch.tensor([r.ctx_after for r in runs], **i32),
            "req_slot": torch.tensor([max(r.staging_slot, 0) for r in runs], **i32),
        }

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch: StepBatch,
    ) -> torch.Tensor:
        """q [T, H, D], new k/v [T, Hkv, D] -> attention output [T, H*D]."""
        int8 = isinstance(cache, Int8PagedKV)
        if int8:
            cache.write(layer, k, v, batch, block_writer=_quantize_blocks)
        else:
            self._write_fp(layer, k.contiguous(), v.contiguous(), cache)
        out = torch.empty_like(q)
        self._attend(layer, q.contiguous(), out, cache, int8)
        return out.view(q.shape[0], self.h * self.d)

    def _write_fp(self, layer: int, k, v, cache) -> None:
        kc, vc = cache.tensors["k"][layer], cache.tensors["v"][layer]  # [Hkv, NB, BS, D]
        kern.write_kv[(k.shape[0], self.hkv)](
            k, v, self.meta["slots"], kc, vc, kc.shape[1] * kc.shape[2], HKV=self.hkv, D=self.d
        )

    def _attend(self, layer: int, q, out, cache, int8: bool) -> None:
        t = cache.tensors
        if int8:
            kc, vc = t["kq"][layer], t["vq"][layer]
            scales = (t["ks"][layer], t["ko"][layer], t["vs"][layer], t["vo"][layer])
            stage = (cache.k_stage[layer], cache.v_stage[layer])
            n_slots = stage[0].shape[1]
        else:
            kc, vc = t["k"][layer], t["v"][layer]
            scales, stage, n_slots = (kc, kc, kc, kc), (kc, kc), 1
        m = self.meta
        kern.paged_attention[(q.shape[0], self.hkv)](
            q,
            out,
            m["tok_req"],
            m["tok_pos"],
            m["tables"],
            m["req_ctx"],
            m["req_slot"],
            kc,
            vc,
            *scales,
            *stage,
            self.scale,
            kc.shape[1],
            n_slots,
            m["tables"].shape[1],
            H=self.h,
            G=self.g,
            BLOCK_G=triton_next_pow2(self.g),
            D=self.d,
            BS=kc.shape[2],
            INT8=int8,
        )


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _quantize_blocks(
    cache, layer: int, name: str, combined: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor
) -> None:
    """INT8 block writer: quantize blocks combined[:, src_idx[f]] into pool blocks dst[f]."""
    codes, scale, offset = (cache.tensors[name + x][layer] for x in "qso")
    kern.quantize_blocks[(dst.numel(), cache.kv_heads)](
        combined.contiguous(),
        src_idx.to(torch.int32).contiguous(),
        dst.to(torch.int32),
        codes,
        scale,
        offset,
        combined.shape[1],
        codes.shape[1],
        BS=cache.block_size,
        D=cache.head_dim,
        PER_CHANNEL=name == "k",
    )
