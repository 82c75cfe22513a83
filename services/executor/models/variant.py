"""What one model family changes over the shared decoder layers (`Variant`), and what the
registry knows of a family (`Family`). Imports nothing of the executor: config.py and the
runners read these types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# model_type values whose weights follow Llama's names and layer shape exactly
DECODER, OPT = "decoder", "opt"


@dataclass(frozen=True)
class Rope:
    """One RoPE table's parameters: transformers' rope_parameters entry (rope_type,
    rope_theta, scaling keys) and the dimensions it rotates."""

    params: dict[str, Any]
    rotary_dim: int
    layer_type: str | None = None  # the key of per-layer-type rope_parameters (Gemma 3)


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts MLP: which layers have one, and how the checkpoint names it."""

    num_experts: int
    top_k: int
    renormalize: bool  # top-k weights divided by their sum
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    prefixes: tuple[str, ...] = ("mlp.",)  # where a layer's router and experts live
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert tensors


@dataclass(frozen=True)
class Variant:
    """The differences of a decoder family from Llama's layer (the defaults are Llama's)."""

    norm_offset: bool = False  # Gemma: x_normed * (1 + w), scaled in fp32 before the cast
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    sandwich_norms: bool = False  # Gemma 3: norms after attention and after the MLP too
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), in the dtype
    activation: str = "silu"  # the MLP's gate activation (gelu_pytorch_tanh: Gemma)
    query_scale: float | None = None  # attention scale (None: head_dim ** -0.5)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before softmax (0: off)
    final_softcap: float = 0.0  # the same on the output logits
    fused_weights: bool = False  # Phi-3: one qkv_proj and one gate_up_proj per layer
    windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = global
    ropes: tuple[Rope, ...] = ()  # distinct RoPE tables (empty: one from the config)
    rope_of_layer: tuple[int, ...] = ()  # per layer: index into ropes (empty: all 0)
    moe: Moe | None = None  # Mixtral, Qwen3-MoE: routed experts (services/executor/moe.py)

    @property
    def plain(self) -> bool:
        """Llama's layer exactly, one full-width RoPE table and no window: what the fused
        CUDA kernels (triton_fused.py) compute (`ropes` set: a family's own tables)."""
        llama_layer = (
            not (self.norm_offset or self.qk_norm or self.sandwich_norms)
            and self.embed_scale is None
            and self.activation == "silu"
            and not (self.attn_softcap or self.final_softcap)
            and self.moe is None
        )
        return llama_layer and not any(self.windows) and not self.ropes

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def rope_index(self, layer: int) -> int:
        return self.rope_of_layer[layer] if self.rope_of_layer else 0


@dataclass(frozen=True)
class Family:
    """A registered family: the model_type values it serves, which runner builds it, and
    its hooks (each takes the transformers config of the language model)."""

    name: str
    model_types: tuple[str, ...]
    runner: str = DECODER
    variant: Callable[[Any], Variant] = lambda config: Variant()
    # the language model's config inside a checkpoint's config (Gemma 3 image-text models)
    text_config: Callable[[Any], Any] = lambda config: config
    # the longest context served; None: the config's max_position_embeddings
    max_len: Callable[[Any], int | None] = lambda config: None
    # a checkpoint tensor's name (leading `model.` removed) -> ours; None: not used
    rename: Callable[[str], str | None] = lambda name: name


def layer_windows(config: Any) -> tuple[int, ...]:
    """Per layer, the sliding window of transformers' `layer_types` ("sliding_attention"
    layers see the last `sliding_window` keys; transformers' mask: key > query - window);
    empty where the config names no layer types or no window."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not types or not window:
        return ()
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as transformers 5 standardizes them (rope_theta inside)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params
