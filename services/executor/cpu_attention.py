"""Attention on CPU with the compiled paged decode kernel (cpu_kernels.py).

Decode groups (one query per request) call the kernel, which reads each request's keys and
values straight from the pool, full precision or INT8, so K is never gathered into a copy
and nothing is padded to the group's longest context. Prefill chunks, whose many queries per
key make them compute-bound, keep the torch path (attention.py: one SDPA call per group).
"""

from __future__ import annotations

import torch

from services.executor import cpu_kernels
from services.executor.attention import TorchAttention
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.ragged_batch import Group, StepBatch

HEAD_DIMS = (64, 128)  # the head sizes the kernel is built for


def supported(head_dim: int, device: torch.device) -> bool:
    """Whether the compiled kernels serve this model here (building them the first time)."""
    return device.type == "cpu" and head_dim in HEAD_DIMS and cpu_kernels.load()


class CpuAttention(TorchAttention):
    name = "cpu"
    # the kernel pads nothing: all decodes in one group (48 decodes of 20-600 tokens of context,
    # fp32, 2 threads: 160 ms as one group against 168 ms split, mixed_context_decode in
    # bench/results/history/engine_kernel_split_decodes.json); prefill chunks still split by context
    split_decodes = False
    # deterministic mode (batch_invariant.py): prefill chunk queries run the decode kernel too
    deterministic = False

    def prepare(self, batch: StepBatch) -> None:
        if not self.deterministic:
            super().prepare(batch)
            return
        for g in batch.groups:
            if g.q_max > 1:  # each chunk query a "decode" over the keys up to its position
                valid = g.q_valid
                g.extra["q_rows"] = g.q_rows[valid]
                g.extra["q_tables"] = g.tables.repeat_interleave(valid.sum(1), dim=0)
                g.extra["q_lens"] = g.q_pos[valid] + 1

    def _chunks(
        self, layer: int, q: torch.Tensor, cache: PagedKV | Int8PagedKV, g: Group
    ) -> torch.Tensor:
        """Prefill chunks: SDPA over the padded group, or (deterministic) the decode kernel per
        query, [Tg, H*D]."""
        if not self.deterministic:
            return super()._chunks(layer, q, cache, g)
        assert isinstance(cache, PagedKV)
        qg = q.index_select(0, g.extra["q_rows"])  # [Tg, H, D]
        k, v = cache.tensors["k"][layer], cache.tensors["v"][layer]
        o = cpu_kernels.paged_decode(
            qg, k, v, g.extra["q_tables"], g.extra["q_lens"], self.scale, *self._bends(layer)
        )
        return o.view(qg.shape[0], self.h * self.d)

    def _prepare_decodes(self, g: Group) -> None:
        """The kernel reads each request's own context length: no mask to build."""

    def _decode(
        self, layer: int, q: torch.Tensor, cache: PagedKV | Int8PagedKV, g: Group
    ) -> torch.Tensor:
        """One query per request: [B, H*D]."""
        b = g.size
        qg = q[g.row_start : g.row_start + b].contiguous()  # [B, H, D]
        if isinstance(cache, Int8PagedKV):
            pools = {name: t[layer] for name, t in cache.tensors.items()}
            o = cpu_kernels.paged_decode_int8(
                qg,
                pools,
                cache.k_stage[layer],
                cache.v_stage[layer],
                g.tables,
                g.extra["slots"],
                g.ctx_after,
                self.scale,
                *self._bends(layer),
            )
        else:
            k, v = cache.tensors["k"][layer], cache.tensors["v"][layer]
            o = cpu_kernels.paged_decode(
                qg, k, v, g.tables, g.ctx_after, self.scale, *self._bends(layer)
            )
        return o.view(b, self.h * self.d)

    def _bends(self, layer: int) -> tuple[int, float]:
        """The kernel's window and soft-cap arguments for `layer`."""
        return self.window(layer), self.softcap
