"""OPT runner (the ALISE/Sarathi papers' model family): learned positions, LayerNorm, ReLU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from services.executor import wquant
from services.executor.config import ModelSpec
from services.executor.lm_head import LmHead
from services.executor.ragged_batch import StepBatch
from services.executor.weights import cat_rows, take
from services.executor.wquant import Weight

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
    from services.executor.kv_pool import KVCache

POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


@dataclass
class OptLayer:
    ln1_w: torch.Tensor | None
    ln1_b: torch.Tensor | None
    qkv: Weight  # [3E, E] (full precision, or packed: wquant.py)
    qkv_bias: torch.Tensor | None
    out: Weight
    out_bias: torch.Tensor | None
    ln2_w: torch.Tensor | None
    ln2_b: torch.Tensor | None
    fc1: Weight
    fc1_bias: torch.Tensor | None
    fc2: Weight
    fc2_bias: torch.Tensor | None


class OptRunner:
    def __init__(
        self,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        cfg = spec.hf_config
        self.pre_norm = cfg.do_layer_norm_before
        self.act = ACT2FN[cfg.activation_function]
        d = "decoder."
        self.embed = take(state, d + "embed_tokens.weight")
        self.pos_embed = take(state, d + "embed_positions.weight")
        self.project_in = take(state, d + "project_in.weight", required=False)
        self.project_out = take(state, d + "project_out.weight", required=False)
        self.final_w = take(state, d + "final_layer_norm.weight", required=False)
        self.final_b = take(state, d + "final_layer_norm.bias", required=False)
        lm_head = take(state, "lm_head.weight", required=False)
        self.lm_head = self.embed if lm_head is None else lm_head
        self.head = LmHead(self.lm_head)
        # wquant.linear takes packed INT4/INT8 weights too; batch_invariant.tiled_linear
        # in deterministic mode
        self.linear: Callable[..., torch.Tensor] = wquant.linear
        self.layers = [self._layer(state, f"{d}layers.{i}.") for i in range(spec.num_layers)]

    @staticmethod
    def _layer(state, p: str) -> OptLayer:
        a = p + "self_attn."

        def opt(name):
            return take(state, name, required=False)

        return OptLayer(
            opt(p + "self_attn_layer_norm.weight"),
            opt(p + "self_attn_layer_norm.bias"),
            cat_rows(*(take(state, f"{a}{n}_proj.weight") for n in "qkv")),
            cat_rows(*(opt(f"{a}{n}_proj.bias") for n in "qkv")),
            take(state, a + "out_proj.weight"),
            opt(a + "out_proj.bias"),
            opt(p + "final_layer_norm.weight"),
            opt(p + "final_layer_norm.bias"),
            take(state, p + "fc1.weight"),
            opt(p + "fc1.bias"),
            take(state, p + "fc2.weight"),
            opt(p + "fc2.bias"),
        )

    def _ln(self, x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)

    def forward(self, batch: StepBatch, cache: KVCache, attn: Attention) -> torch.Tensor:
        s = self.spec
        x = F.embedding(batch.token_ids, self.embed)  # [T, E_in]
        if self.project_in is not None:
            x = self.linear(x, self.project_in)
        x = x + F.embedding(batch.positions + POSITION_OFFSET, self.pos_embed)  # [T, E]
        t = x.shape[0]
        for i, ly in enumerate(self.layers):
            h = self._ln(x, ly.ln1_w, ly.ln1_b) if self.pre_norm else x
            q, k, v = self.linear(h, ly.qkv, ly.qkv_bias).chunk(3, dim=-1)  # [T, E] each
            o = attn.forward(
                i,
                q.view(t, s.num_heads, s.head_dim),
                k.reshape(t, s.num_heads, s.head_dim),
                v.reshape(t, s.num_heads, s.head_dim),
                cache,
                batch,
            )
            x = x + self.linear(o, ly.out, ly.out_bias)
            if not self.pre_norm:
                x = self._ln(x, ly.ln1_w, ly.ln1_b)
            h = self._ln(x, ly.ln2_w, ly.ln2_b) if self.pre_norm else x
            h = self.linear(self.act(self.linear(h, ly.fc1, ly.fc1_bias)), ly.fc2, ly.fc2_bias)
            x = x + h
            if not self.pre_norm:
                x = self._ln(x, ly.ln2_w, ly.ln2_b)
        if self.final_w is not None:
            x = self._ln(x, self.final_w, self.final_b)
        if self.project_out is not None:
            x = self.linear(x, self.project_out)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, V]."""
        return self.head(hidden)
