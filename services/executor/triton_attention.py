"""Triton attention backend: KV write (+ INT8 block quantization), unified paged attention over
the packed ragged batch and, for decode steps with few programs and long contexts, split-KV
with a reduce (triton_plan.py chooses tiles and splits once per step).

Selected automatically on CUDA. On CPU tensors the same kernels run under Triton's
interpreter (slow; used to check correctness against the torch reference backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.executor import triton_kernels as kern
from services.executor import triton_plan as plan
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.ragged_batch import RunArrays, StepBatch, TokenRun

if TYPE_CHECKING:
    from services.executor.kv_pool import KVCache


LOG2E = 1.4426950408889634  # the kernels exponentiate in base 2


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonAttention:
    name = "triton"
    group_cost: int | None = None  # ragged kernels pad nothing: one group per kind suffices
    split_decodes = False
    # deterministic mode (batch_invariant.py): every query tile takes the decode tile's shape
    deterministic = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        device: torch.device,
        kv_splits: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        windows: tuple[int, ...] = (),
        softcap: float = 0.0,
    ) -> None:
        """kv_splits: force a split-KV factor (a power of two; None: plan.num_kv_splits);
        dtype: the model's compute dtype (fp32 takes smaller KV tiles: plan.kv_tile);
        windows: per layer, a sliding window in keys (0: global); softcap: attention
        soft-capping (0: off)."""
        if not _pow2(head_dim) or head_dim < 16:
            raise ValueError(
                f"the Triton backend needs a power-of-two head_dim >= 16, not {head_dim}"
            )
        if device.type != "cuda" and not kern.INTERPRETED:
            raise ValueError(
                "the Triton backend on CPU needs TRITON_INTERPRET=1 in the "
                "environment (set before start); use attention_backend=torch"
            )
        if kv_splits is not None and not _pow2(kv_splits):
            raise ValueError(f"kv_splits must be a power of two, not {kv_splits}")
        self.h, self.hkv, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.g = num_heads // num_kv_heads
        self.windows, self.softcap = tuple(windows), softcap
        self.kv_splits = kv_splits
        # set by the CUDA runtime (graph_split_kv): decode-only steps split by their graph
        # bucket up to this context length (plan.bucket_splits); None: by their contexts
        self.bucket_split_len: int | None = None
        self.fp32 = dtype == torch.float32
        self.device = device
        self._sm_count = 0  # read from the device at the first step (not at construction)
        self.step: plan.StepPlan | None = None
        self.meta: dict[str, torch.Tensor] = {}

    def sm_count(self) -> int:
        """Streaming multiprocessors the split-KV rule aims to fill (CPU: an H100's)."""
        if not self._sm_count:
            self._sm_count = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else plan.NOMINAL_SMS
            )
        return self._sm_count

    def plan_runs(
        self,
        runs: list[TokenRun],
        block_size: int,
        splits: int | None = None,
        arrays: RunArrays | None = None,
    ) -> plan.StepPlan:
        """Tiles and split factor of a step over `runs` (packed order); `splits` forces one
        (CUDA graphs capture decode steps with 1); `arrays`: the runs' RunArrays."""
        if not _pow2(block_size):
            raise ValueError("the Triton backend needs a power-of-two block size")
        forced = self.kv_splits if splits is None else splits
        if forced is None and self.bucket_split_len and all(len(r.token_ids) == 1 for r in runs):
            forced = plan.bucket_splits(len(runs), self.hkv, self.sm_count(), self.bucket_split_len)
        return plan.plan_step(
            runs, self.g, self.hkv, block_size, self.d, self.sm_count(), forced, self.fp32, arrays,
            uniform_tiles=self.deterministic,
        )  # fmt: skip

    def prepare(self, batch: StepBatch) -> None:
        """Per-step tiles, split factor and metadata (int32), shared by every layer."""
        dev = batch.token_ids.device
        runs = batch.runs
        step = self.plan_runs(runs, batch.block_size)
        nb_max = max(len(r.block_table) for r in runs)
        tables = torch.zeros((len(runs), nb_max), dtype=torch.int32)
        for i, r in enumerate(runs):
            tables[i, : len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
        meta = {
            "tiles": step.tiles.to(dev),
            "tables": tables.to(dev),
            "slots": batch.slot_mapping.to(torch.int32),
            "req_ctx": torch.tensor([r.ctx_after for r in runs], dtype=torch.int32, device=dev),
            "req_slot": torch.tensor(
                [max(r.staging_slot, 0) for r in runs], dtype=torch.int32, device=dev
            ),
        }
        self.use(step, meta, batch.num_tokens)

    def use(self, step: plan.StepPlan, meta: dict[str, torch.Tensor], num_tokens: int) -> None:
        """Take a step's plan and device metadata (`prepare`'s, or the CUDA runtime's packed
        buffer: step_buffers.StepMeta.triton); split-KV partial states are allocated here."""
        self.step, self.meta = step, dict(meta)
        if step.splits > 1:  # partial states, reused by every layer
            dev = meta["tiles"].device
            shape = (step.splits, num_tokens, self.h)
            self.meta["part_acc"] = torch.empty((*shape, self.d), dtype=torch.float32, device=dev)
            self.meta["part_ml"] = torch.empty((*shape, 2), dtype=torch.float32, device=dev)

    def warm_splits(self, cache: KVCache, dtype: torch.dtype, max_context: int) -> list[int]:
        """Compile the split-KV variants (paged_attention with SPLITS > 1 and reduce_splits)
        a decode-only step can take with contexts up to max_context: one decode over block 0
        of layer 0 of `cache` per factor, writing scratch buffers only (the pool is read)."""
        factors = plan.split_factors(max_context, self.kv_splits)
        dev, saved = self.device, (self.step, self.meta)
        q = torch.zeros((1, self.h, self.d), dtype=dtype, device=dev)
        run = TokenRun("", [0], 0, [0])
        one = torch.ones(1, dtype=torch.int32, device=dev)
        for s in factors:
            step = self.plan_runs([run], cache.block_size, splits=s)
            tables = torch.zeros((1, 1), dtype=torch.int32, device=dev)
            meta = {"tiles": step.tiles.to(dev), "tables": tables, "slots": one - 1}
            self.use(step, meta | {"req_ctx": one, "req_slot": one - 1}, 1)
            self._attend(0, q, torch.empty_like(q), cache)
        self.step, self.meta = saved
        return factors

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
        if isinstance(cache, Int8PagedKV):
            cache.write(layer, k, v, batch, block_writer=_quantize_blocks)
        else:
            self._write_fp(layer, k.contiguous(), v.contiguous(), cache)
        out = torch.empty_like(q)
        self._attend(layer, q.contiguous(), out, cache)
        return out.view(q.shape[0], self.h * self.d)

    def _write_fp(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache: PagedKV) -> None:
        kc, vc = cache.tensors["k"][layer], cache.tensors["v"][layer]  # [Hkv, NB, BS, D]
        kern.write_kv[(k.shape[0], self.hkv)](
            k, v, self.meta["slots"], kc, vc, kc.shape[1] * kc.shape[2], HKV=self.hkv, D=self.d
        )

    def _attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, cache: KVCache) -> None:
        step, m = self.step, self.meta
        assert step is not None, "prepare() before forward()"
        kv = _kv_args(cache, layer)
        parts = (m["part_acc"], m["part_ml"]) if step.splits > 1 else (out, out)
        fp32 = q.dtype == torch.float32
        emulate = kern.INTERPRETED and q.dtype == torch.bfloat16
        kern.paged_attention[(step.num_tiles, self.hkv, step.splits)](
            q,
            out,
            *parts,
            m["tiles"],
            m["tables"],
            m["req_ctx"],
            m["req_slot"],
            *kv,
            self.scale * LOG2E,
            step.num_tiles,
            q.shape[0],
            kv[0].shape[1],
            kv[6].shape[1],
            m["tables"].shape[1],
            self.windows[layer] if self.windows else 0,
            H=self.h,
            G=self.g,
            D=self.d,
            BS=kv[0].shape[2],
            BLOCK_M=step.block_m,
            BLOCK_N=step.block_n,
            INT8=isinstance(cache, Int8PagedKV),
            SPLITS=step.splits,
            PRECISION="ieee" if fp32 else "tf32",
            EMULATE=emulate,
            SOFTCAP=self.softcap,
            **plan.launch_config(q.dtype),
        )
        if step.splits > 1:
            kern.reduce_splits[(q.shape[0], self.hkv)](
                *parts,
                out,
                q.shape[0],
                H=self.h,
                G=self.g,
                BLOCK_G=plan.next_pow2(self.g),
                D=self.d,
                SPLITS=step.splits,
                EMULATE=emulate,
            )


def _kv_args(cache: KVCache, layer: int) -> tuple[torch.Tensor, ...]:
    """K, V, key scale/offset, value scale/offset, K/V staging of one layer (the
    full-precision pool passes K in the INT8-only places; the kernel never reads them)."""
    t = cache.tensors
    if isinstance(cache, Int8PagedKV):
        return (
            t["kq"][layer],
            t["vq"][layer],
            t["ks"][layer],
            t["ko"][layer],
            t["vs"][layer],
            t["vo"][layer],
            cache.k_stage[layer],
            cache.v_stage[layer],
        )
    kc = t["k"][layer]
    return (kc, t["v"][layer], kc, kc, kc, kc, kc, kc)


def _quantize_blocks(
    cache: Int8PagedKV,
    layer: int,
    name: str,
    combined: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
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
