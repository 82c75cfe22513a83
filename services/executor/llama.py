"""The decoder runner every Llama-shaped family shares (Llama 2/3, SmolLM2, Mistral, Qwen2,
Qwen3, Gemma 3, Phi-3/4): Llama's layer, with what a family changes read from its `Variant`
(models/variant.py: norm form and placement, QK-norm, embedding scale, activation, attention
scale, per-layer sliding windows and RoPE tables, partial rotary, soft-capping, fused
weights). The registry (models/) says which family a checkpoint is.

One forward pass over a packed ragged batch: every projection is one matmul over all T tokens
of all requests; only attention looks at per-request structure (through the batch groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.executor import cpu_kernels, wquant
from services.executor.config import ModelSpec
from services.executor.lm_head import LmHead
from services.executor.models.variant import Rope, Variant, rope_parameters
from services.executor.moe import MoeWeights, moe_forward, moe_weights
from services.executor.ragged_batch import StepBatch
from services.executor.weights import cat_rows, take
from services.executor.wquant import Weight

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
    from services.executor.kv_pool import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalize in fp32, scale in the model dtype (the
    compiled CPU kernel where loaded, else torch's fused kernel: one op instead of six)."""
    fused = cpu_kernels.rms_norm(x, weight, eps)
    if fused is not None:
        return fused
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight32: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Gemma3RMSNorm: normalize and scale by (1 + w) in fp32, then cast
    (`weight32` holds 1 + w in fp32: offset_weight)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight32, eps).to(x.dtype)


def offset_weight(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, N, D], with sin_signed = (-sin, sin) halves:
    rotate_half(x) * sin = (x2, x1) * (-sin, sin), the halves swapped by one flip."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """apply_rope over the first cos.shape[-1] dimensions of each head (partial rotary, as
    transformers' Phi-3), the rest passed through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin_signed)
    return torch.cat((apply_rope(x[..., :r], cos, sin_signed), x[..., r:]), dim=-1)


def rope_inv_freq(spec: ModelSpec, rope: Rope | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the cos/sin scaling of one RoPE table (default:
    the config's, over the whole head), via transformers' RoPE init for scaled types. LongRoPE
    gives its short factors (the family serves only their range: models/phi3.py)."""
    config = spec.hf_config
    rope = rope or Rope(rope_parameters(config), spec.head_dim)
    rope_type = rope.params.get("rope_type", "default")
    if rope_type == "default":
        base, dim = rope.params["rope_theta"], rope.rotary_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError(f"RoPE type {rope_type!r} depends on sequence length: not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=rope.layer_type)


def gate_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) * up for the fused gate/up output [T, 2I] -> [T, I]."""
    if name == "silu":
        return cpu_kernels.silu_and_mul
    from transformers.activations import ACT2FN

    act = ACT2FN[name]

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return gated


@dataclass
class LlamaLayer:
    ln1: torch.Tensor
    qkv: Weight  # [Q + 2KV, hidden] (full precision, or packed: wquant.py)
    qkv_bias: torch.Tensor | None
    o: Weight  # [hidden, Q]
    ln2: torch.Tensor
    gate_up: Weight | None  # [2I, hidden] (None: a mixture-of-experts layer)
    down: Weight | None  # [hidden, I]
    q_norm: torch.Tensor | None = None  # [D] QK-norm (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma 3): after attention
    mlp_out_norm: torch.Tensor | None = None  # and after the MLP
    moe: MoeWeights | None = None  # routed experts in place of gate_up / down (moe.py)


class LlamaRunner:
    def __init__(
        self,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.variant: Variant = spec.variant
        self.eps = spec.hf_config.rms_norm_eps
        self.norm_fn = offset_rms_norm if self.variant.norm_offset else rms_norm
        embed = take(state, "embed_tokens.weight", required=False)
        lm_head = take(state, "lm_head.weight", required=False)
        if embed is None and spec.hf_config.tie_word_embeddings:
            embed = lm_head  # a tied checkpoint may store only one of the two
        self.embed = take(
            {"embed_tokens.weight": embed} if embed is not None else {}, "embed_tokens.weight"
        )
        scale = self.variant.embed_scale
        self.embed_scale = (
            None if scale is None else torch.tensor(scale, dtype=dtype, device=device)
        )
        self.lm_head = self.embed if lm_head is None else lm_head
        self.head = LmHead(self.lm_head)
        self.norm = self._norm_weight(take(state, "norm.weight"))
        self.layers = [self._layer(state, i) for i in range(spec.num_layers)]
        self._rope_params = [
            (f.to(device=device, dtype=torch.float32), scale)
            for f, scale in (rope_inv_freq(spec, r) for r in self.variant.ropes or (None,))
        ]
        self.inv_freq, self.rope_scale = self._rope_params[0]
        self.act = gate_activation(self.variant.activation)
        # CUDA: the fused Triton kernels (triton_fused.py) for residual add + RMSNorm, RoPE
        # with contiguous q/k/v, SiLU-and-multiply, for Llama's layer exactly (Variant.plain);
        # tests set it under the interpreter
        self.fused = device.type == "cuda" and self.variant.plain
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # wquant.linear takes packed INT4/INT8 weights too; deterministic mode sets the
        # batch-invariant products (batch_invariant.make_deterministic)
        self.linear: Callable[..., torch.Tensor] = wquant.linear

    def _norm_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """A norm's weight as norm_fn takes it ((1 + w) in fp32 for the offset form)."""
        return offset_weight(w) if w is not None and self.variant.norm_offset else w

    def _layer(self, state, i: int) -> LlamaLayer:
        p, v = f"layers.{i}.", self.variant
        a = p + "self_attn."
        if v.fused_weights:
            qkv = take(state, a + "qkv_proj.weight")
            qkv_bias = take(state, a + "qkv_proj.bias", required=False)
        else:
            qkv = cat_rows(*(take(state, f"{a}{n}_proj.weight") for n in "qkv"))
            qkv_bias = cat_rows(*(take(state, f"{a}{n}_proj.bias", required=False) for n in "qkv"))

        def norm(name: str, present: bool = True) -> torch.Tensor | None:
            return self._norm_weight(take(state, p + name)) if present else None

        pre_mlp = "pre_feedforward_layernorm" if v.sandwich_norms else "post_attention_layernorm"
        return LlamaLayer(
            norm("input_layernorm.weight"),
            qkv,
            qkv_bias,
            take(state, a + "o_proj.weight"),
            norm(pre_mlp + ".weight"),
            *self._mlp(state, i),
            norm("self_attn.q_norm.weight", v.qk_norm),
            norm("self_attn.k_norm.weight", v.qk_norm),
            norm("post_attention_layernorm.weight", v.sandwich_norms),
            norm("post_feedforward_layernorm.weight", v.sandwich_norms),
            self._experts(state, i),
        )

    def _mlp(self, state, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A dense layer's fused gate/up and down projections (None, None: experts)."""
        moe, m = self.variant.moe, f"layers.{i}.mlp."
        if moe is not None and moe.sparse_layers[i]:
            return None, None
        if self.variant.fused_weights:
            return take(state, m + "gate_up_proj.weight"), take(state, m + "down_proj.weight")
        gate_up = cat_rows(take(state, m + "gate_proj.weight"), take(state, m + "up_proj.weight"))
        return gate_up, take(state, m + "down_proj.weight")

    def _experts(self, state, i: int) -> MoeWeights | None:
        """A mixture-of-experts layer's router and experts, from whichever of the family's
        prefixes holds them."""
        moe = self.variant.moe
        if moe is None or not moe.sparse_layers[i]:
            return None
        prefixes = [f"layers.{i}.{x}" for x in moe.prefixes]
        prefix = next((x for x in prefixes if x + "gate.weight" in state), prefixes[0])
        return moe_weights(state, prefix, moe.names, moe.top_k, moe.renormalize)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed [T, 1, rotary_dim] of the first RoPE table in the model dtype
        (see apply_rope)."""
        return self._rope_at(positions, self.inv_freq, self.rope_scale)

    def _rope_at(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, R/2]
        cos = (torch.cat((freqs, freqs), dim=-1).cos() * scale).to(self.dtype)
        sin = freqs.sin() * scale
        sin_signed = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin_signed[:, None, :]

    def ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every RoPE table's cos and sin_signed at `positions` (the first through `rope`)."""
        rest = [self._rope_at(positions, f, scale) for f, scale in self._rope_params[1:]]
        return [self.rope(positions), *rest]

    def forward(self, batch: StepBatch, cache: KVCache, attn: Attention) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = F.embedding(batch.token_ids, self.embed)  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.fused:
            return self._fused_forward(x, batch, cache, attn)
        ropes, v = self.ropes(batch.positions), self.variant
        for i, layer in enumerate(self.layers):
            x = self._layer_forward(i, layer, x, ropes[v.rope_index(i)], batch, cache, attn)
        return self.norm_fn(x, self.norm, self.eps)

    def _fused_forward(
        self, x: torch.Tensor, batch: StepBatch, cache: KVCache, attn: Attention
    ) -> torch.Tensor:
        """The same layers through the fused kernels: each residual add runs with the norm
        after it (the next layer's input norm, or the final one)."""
        from services.executor import triton_fused as tf

        s, t = self.spec, x.shape[0]
        if self._rope_table is None:
            self._rope_table = tf.rope_table(
                self.inv_freq, self.rope_scale, s.max_model_len, self.dtype, self.device
            )
        norms = [layer.ln1 for layer in self.layers[1:]] + [self.norm]
        x, h = tf.add_rms_norm(x, None, self.layers[0].ln1, self.eps)
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms, strict=True)):
            qkv = self.linear(h, layer.qkv, layer.qkv_bias)  # [T, Q+2KV]
            q, k, v = tf.rope_qkv(
                qkv, batch.positions, self._rope_table, s.num_heads, s.num_kv_heads, s.head_dim
            )
            o = attn.forward(i, q, k, v, cache, batch)  # [T, H*D]
            x, h = tf.add_rms_norm(x, self.linear(o, layer.o), layer.ln2, self.eps)
            act = tf.silu_and_mul(self.linear(h, layer.gate_up))  # [T, I]
            x, h = tf.add_rms_norm(x, self.linear(act, layer.down), next_norm, self.eps)
        assert t == h.shape[0]
        return h

    def _layer_forward(
        self,
        i: int,
        layer: LlamaLayer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: StepBatch,
        cache: KVCache,
        attn: Attention,
    ) -> torch.Tensor:
        s, t, norm = self.spec, x.shape[0], self.norm_fn
        h = norm(x, layer.ln1, self.eps)
        qkv = self.linear(h, layer.qkv, layer.qkv_bias)  # [T, Q+2KV]
        heads = s.num_heads + s.num_kv_heads
        qk = qkv[:, : heads * s.head_dim].view(t, heads, s.head_dim)
        if layer.q_norm is not None:
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
            qk = torch.cat((norm(q, layer.q_norm, self.eps), norm(k, layer.k_norm, self.eps)), 1)
        qk = apply_partial_rope(qk, *rope)
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, heads * s.head_dim :].view(t, s.num_kv_heads, s.head_dim)
        o = self.linear(attn.forward(i, q, k, v, cache, batch), layer.o)  # [T, hidden]
        if layer.attn_out_norm is not None:
            o = norm(o, layer.attn_out_norm, self.eps)
        x = x + o
        h = norm(x, layer.ln2, self.eps)
        if layer.moe is not None:
            mlp = moe_forward(h, layer.moe, self.act, self.linear)
        else:
            mlp = self.linear(self.act(self.linear(h, layer.gate_up)), layer.down)  # [T, hidden]
        if layer.mlp_out_norm is not None:
            mlp = norm(mlp, layer.mlp_out_norm, self.eps)
        return x + mlp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, V] (soft-capped where the family says)."""
        logits = self.head(hidden)
        cap = self.variant.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
