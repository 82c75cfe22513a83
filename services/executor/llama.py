"""Llama-family runner (Llama 2/3, SmolLM2, Mistral, Qwen2 with its QKV bias).

One forward pass over a packed ragged batch: every projection is one matmul over all T tokens
of all requests; only attention looks at per-request structure (through the batch groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.executor import cpu_kernels
from services.executor.config import ModelSpec
from services.executor.lm_head import LmHead
from services.executor.ragged_batch import StepBatch
from services.executor.weights import cat_rows, take

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
    from services.executor.kv_pool import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalize in fp32, scale in the model dtype (torch's
    fused kernel, one op instead of six)."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, N, D], with sin_signed = (-sin, sin) halves:
    rotate_half(x) * sin = (x2, x1) * (-sin, sin), the halves swapped by one flip."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the cos/sin scaling, via transformers' RoPE init."""
    config = spec.hf_config
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = spec.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"RoPE type {rope_type!r} depends on sequence length: not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


@dataclass
class LlamaLayer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # [Q + 2KV, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, Q]
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [2I, hidden]
    down: torch.Tensor  # [hidden, I]


class LlamaRunner:
    def __init__(
        self,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.eps = spec.hf_config.rms_norm_eps
        embed = take(state, "embed_tokens.weight", required=False)
        lm_head = take(state, "lm_head.weight", required=False)
        if embed is None and spec.hf_config.tie_word_embeddings:
            embed = lm_head  # a tied checkpoint may store only one of the two
        self.embed = take(
            {"embed_tokens.weight": embed} if embed is not None else {}, "embed_tokens.weight"
        )
        self.lm_head = self.embed if lm_head is None else lm_head
        self.head = LmHead(self.lm_head)
        self.norm = take(state, "norm.weight")
        self.layers = [self._layer(state, i) for i in range(spec.num_layers)]
        inv_freq, self.rope_scale = rope_inv_freq(spec)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        # CUDA: the fused Triton kernels (triton_fused.py) for residual add + RMSNorm, RoPE
        # with contiguous q/k/v, SiLU-and-multiply; tests set it under the interpreter
        self.fused = device.type == "cuda"
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.linear = F.linear  # batch_invariant.tiled_linear in deterministic mode

    @staticmethod
    def _layer(state, i: int) -> LlamaLayer:
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        return LlamaLayer(
            take(state, p + "input_layernorm.weight"),
            cat_rows(*(take(state, f"{a}{n}_proj.weight") for n in "qkv")),
            cat_rows(*(take(state, f"{a}{n}_proj.bias", required=False) for n in "qkv")),
            take(state, a + "o_proj.weight"),
            take(state, p + "post_attention_layernorm.weight"),
            cat_rows(take(state, m + "gate_proj.weight"), take(state, m + "up_proj.weight")),
            take(state, m + "down_proj.weight"),
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed [T, 1, D] in the model dtype (see apply_rope)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        cos = (torch.cat((freqs, freqs), dim=-1).cos() * self.rope_scale).to(self.dtype)
        sin = freqs.sin() * self.rope_scale
        sin_signed = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin_signed[:, None, :]

    def forward(self, batch: StepBatch, cache: KVCache, attn: Attention) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = F.embedding(batch.token_ids, self.embed)  # [T, hidden]
        if self.fused:
            return self._fused_forward(x, batch, cache, attn)
        rope = self.rope(batch.positions)
        for i, layer in enumerate(self.layers):
            x = self._layer_forward(i, layer, x, rope, batch, cache, attn)
        return rms_norm(x, self.norm, self.eps)

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
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [T, Q+2KV]
            q, k, v = tf.rope_qkv(
                qkv, batch.positions, self._rope_table, s.num_heads, s.num_kv_heads, s.head_dim
            )
            o = attn.forward(i, q, k, v, cache, batch)  # [T, H*D]
            x, h = tf.add_rms_norm(x, F.linear(o, layer.o), layer.ln2, self.eps)
            act = tf.silu_and_mul(F.linear(h, layer.gate_up))  # [T, I]
            x, h = tf.add_rms_norm(x, F.linear(act, layer.down), next_norm, self.eps)
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
        s, t = self.spec, x.shape[0]
        h = rms_norm(x, layer.ln1, self.eps)
        qkv = self.linear(h, layer.qkv, layer.qkv_bias)  # [T, Q+2KV]
        heads = s.num_heads + s.num_kv_heads
        qk = apply_rope(qkv[:, : heads * s.head_dim].view(t, heads, s.head_dim), *rope)
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, heads * s.head_dim :].view(t, s.num_kv_heads, s.head_dim)
        o = attn.forward(i, q, k, v, cache, batch)  # [T, H*D]
        x = x + self.linear(o, layer.o)
        h = rms_norm(x, layer.ln2, self.eps)
        act = cpu_kernels.silu_and_mul(self.linear(h, layer.gate_up))  # [T, 2I] -> [T, I]
        return x + self.linear(act, layer.down)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, V]."""
        return self.head(hidden)
