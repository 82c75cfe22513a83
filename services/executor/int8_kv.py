"""INT8 paged KV cache (ALISE asymmetric scale + zero-point, see quant.py).

Granularity: keys per channel over each full block, values per token. A block is quantized
once, when its last token is written; until then the request's open block lives exactly (model
dtype) in a per-request staging buffer [bs, Hkv, D] per layer. So every key block's per-channel
statistics cover exactly the tokens it holds, and the most recent tokens (which attention
weighs most in decoding) are never rounded.

Attention context of a request = its full blocks followed by its staging buffer. Decode groups
read the full blocks as codes (`read_codes`: scales folded into the attention, see
decode_attention.py); prefill groups dequantize them into a reused buffer (`gather`).
Attention does not depend on key order, only on the mask, so key positions are carried
explicitly for the causal mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.executor import quant
from services.executor.decode_attention import Int8Context
from services.executor.kv_cache import allocate, layout_bytes
from services.executor.paged_read import Workspace, gather_blocks
from services.executor.ragged_batch import Group, StepBatch

# (cache, layer, "k" | "v", combined rows, source rows per block, target blocks): quantizes
# completed blocks into the pool
BlockWriter = Callable[["Int8PagedKV", int, str, torch.Tensor, torch.Tensor, torch.Tensor], None]


def int8_layout(block_size: int, kv_heads: int, head_dim: int) -> dict:
    """Per block and KV head: codes [bs, D], key scale/offset [D], value scale/offset [bs]."""
    codes = ((block_size, head_dim), torch.uint8)
    per_channel, per_token = ((head_dim,), quant.SCALE_DTYPE), ((block_size,), quant.SCALE_DTYPE)
    return {
        "kq": codes,
        "ks": per_channel,
        "ko": per_channel,
        "vq": codes,
        "vs": per_token,
        "vo": per_token,
    }


class Int8PagedKV:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        staging_slots: int = 8,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.layout = int8_layout(block_size, kv_heads, head_dim)
        self.tensors = allocate(num_layers, kv_heads, num_blocks, self.layout, device)
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []
        self._grow(staging_slots)
        self._plan: dict[str, torch.Tensor] = {}

    @property
    def bytes_per_block(self) -> int:
        return layout_bytes(self.num_layers, self.kv_heads, self.layout)

    @property
    def staging_bytes_per_request(self) -> int:
        return (
            2
            * self.num_layers
            * self.block_size
            * self.kv_heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )

    # -- staging slots --------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        shape = (self.num_layers, self.kv_heads, capacity, self.block_size, self.head_dim)
        new_k = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, Hkv, S, bs, D]
        new_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        old = getattr(self, "k_stage", None)
        start = 0 if old is None else old.shape[2]
        if old is not None:
            new_k[:, :, :start] = old
            new_v[:, :, :start] = self.v_stage
        self.k_stage, self.v_stage = new_k, new_v
        self.free_slots.extend(range(capacity - 1, start - 1, -1))

    def open_request(self, request_id: str) -> int:
        if not self.free_slots:
            self._grow(2 * self.k_stage.shape[2])
        slot = self.free_slots.pop()
        self.slots[request_id] = slot
        return slot

    def close_request(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # -- per step -------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        self._plan = self._write_plan(batch)
        for g in batch.groups:
            self._prepare_group(g)

    def _write_plan(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        bs, r = self.block_size, len(batch.runs)
        fq_src, fq_dst, st_src, row = [], [], [], 0
        for i, c in enumerate(batch.runs):
            staged = c.ctx_before % bs
            seq = [i * bs + j for j in range(staged)] + [r * bs + row + j for j in range(c.q_len)]
            first = c.ctx_before // bs
            n_full = c.ctx_after // bs - first
            for m in range(n_full):
                fq_src.append(seq[m * bs : (m + 1) * bs])
                fq_dst.append(c.block_table[first + m])
            tail = seq[n_full * bs :]
            st_src.append(tail + [0] * (bs - len(tail)))
            row += c.q_len

        def t(values, shape=None):
            out = torch.tensor(values, dtype=torch.long, device=self.device)
            return out.view(shape) if shape else out

        return {
            "slots": t([c.staging_slot for c in batch.runs]),
            "fq_src": t(fq_src, (-1, bs)),
            "fq_dst": t(fq_dst),
            "st_src": t(st_src, (-1, bs)),
        }

    def _prepare_group(self, g: Group) -> None:
        bs = self.block_size
        n_full = g.ctx_after // bs  # [B]
        nf_max = int(n_full.max())
        full_pos = torch.arange(nf_max * bs, device=self.device).expand(g.size, -1)
        tail_pos = n_full[:, None] * bs + torch.arange(bs, device=self.device)  # [B, bs]
        g.extra["full_tables"] = g.tables[:, :nf_max]
        g.extra["slots"] = torch.tensor([c.staging_slot for c in g.runs], device=self.device)
        g.extra["key_pos"] = torch.cat([full_pos, tail_pos], dim=1)  # [B, Lk]
        g.extra["key_valid"] = torch.cat(
            [full_pos < (n_full * bs)[:, None], tail_pos < g.ctx_after[:, None]], dim=1
        )

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: StepBatch,
        block_writer: BlockWriter | None = None,
    ) -> None:
        """Complete blocks are quantized into the pool; the open remainder goes to staging.
        block_writer(cache, layer, "k"|"v", combined, src_idx, dst) quantizes the completed
        blocks (default: torch; the Triton backend passes its kernel)."""
        p = self._plan
        writer = block_writer or torch_block_writer
        self._write_one(layer, k, self.k_stage, p, "k", writer)
        self._write_one(layer, v, self.v_stage, p, "v", writer)

    def _write_one(self, layer, new, stage, p, name, writer) -> None:
        hkv, d = self.kv_heads, self.head_dim
        staged = stage[layer][:, p["slots"]].view(hkv, -1, d)  # [Hkv, R*bs, D]
        combined = torch.cat([staged, new.transpose(0, 1)], dim=1)  # [Hkv, R*bs+T, D]
        if p["fq_dst"].numel():
            writer(self, layer, name, combined, p["fq_src"], p["fq_dst"])
        stage[layer][:, p["slots"]] = combined[:, p["st_src"]]  # [Hkv, R, bs, D]

    def gather(
        self, layer: int, g: Group, ws: Workspace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, B, NFmax*bs + bs, D]: dequantized full blocks, then the staging buffer
        (in `ws` when given; prefill chunks, whose many queries amortise the dequantization)."""
        ws = ws or Workspace(self.device)
        ft, slots = g.extra["full_tables"], g.extra["slots"]
        b, nf = ft.shape
        hkv, bs, d = self.kv_heads, self.block_size, self.head_dim
        out = []
        for name, deq in (("k", quant.dequantize_keys), ("v", quant.dequantize_values)):
            full = ws.get(name, (hkv, b, nf + 1, bs, d), self.dtype)
            codes = self._codes(layer, name, ft, ws).view(hkv, b, nf, bs, d)
            scale, offset = (
                self.tensors[name + x][layer].index_select(1, ft.reshape(-1)) for x in "so"
            )
            side = (hkv, b, nf, scale.shape[-1])  # per channel (D) or per token (bs)
            deq(codes, scale.view(side), offset.view(side), self.dtype, out=full[:, :, :nf])
            stage = self.k_stage if name == "k" else self.v_stage
            full[:, :, nf] = stage[layer].index_select(1, slots)
            out.append(full.view(hkv, b, (nf + 1) * bs, d))
        return out[0], out[1]

    def _codes(
        self, layer: int, name: str, full_tables: torch.Tensor, ws: Workspace
    ) -> torch.Tensor:
        """uint8 codes of the group's full blocks, [Hkv, B*NF, bs, D] (in `ws`)."""
        ids = full_tables.reshape(-1)
        shape = (self.kv_heads, ids.numel(), self.block_size, self.head_dim)
        out = ws.get(name + "q", shape, torch.uint8)
        return gather_blocks(self.tensors[name + "q"][layer], ids, out)

    def read_codes(self, layer: int, g: Group, ws: Workspace) -> Int8Context:
        """A decode group's context as codes (converted to the model dtype in `ws`), fp32
        scales and offsets, and the exact staging blocks (decode_attention.py folds them)."""
        ft, slots = g.extra["full_tables"], g.extra["slots"]
        b, nf = ft.shape
        hkv, bs, d = self.kv_heads, self.block_size, self.head_dim
        ids, t = ft.reshape(-1), self.tensors

        def side(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return t[name][layer].index_select(1, ids).float().view(shape)

        k_codes = ws.get("kc", (hkv, b, nf, bs, d), self.dtype)
        k_codes.view(hkv, b * nf, bs, d).copy_(self._codes(layer, "k", ft, ws))
        v_codes = ws.get("vc", (hkv, b, nf * bs, d), self.dtype)
        v_codes.view(hkv, b * nf, bs, d).copy_(self._codes(layer, "v", ft, ws))
        return Int8Context(
            k_codes,
            side("ks", (hkv, b, nf, d)),
            side("ko", (hkv, b, nf, d)),
            v_codes,
            side("vs", (hkv, b, nf * bs)),
            side("vo", (hkv, b, nf * bs)),
            self.k_stage[layer].index_select(1, slots),
            self.v_stage[layer].index_select(1, slots),
        )


def torch_block_writer(
    cache: Int8PagedKV,
    layer: int,
    name: str,
    combined: torch.Tensor,
    src_idx: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Quantize blocks combined[:, src_idx[f]] ([Hkv, Nf, bs, D]) into pool blocks dst[f]."""
    quantize = quant.quantize_keys if name == "k" else quant.quantize_values
    codes, scale, offset = quantize(combined[:, src_idx])
    cache.tensors[name + "q"][layer][:, dst] = codes
    cache.tensors[name + "s"][layer][:, dst] = scale
    cache.tensors[name + "o"][layer][:, dst] = offset
