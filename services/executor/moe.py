"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
and the experts run grouped by expert, never token by token.

Per step: the router's softmax (fp32) and top-k (renormalised where the family says), the
T x k assignments sorted by expert (one stable argsort), the tokens gathered in that order,
then one grouped matrix product per projection over the sorted rows (`torch._grouped_mm`
where this torch has it for the device and dtype, else one product per expert that received
tokens: a loop over experts, not tokens), the activation, and the rows weighted and summed
back onto their tokens (fp32 accumulation) with one index_add. On CUDA with Triton and SiLU
gating the experts run instead as two fused grouped-GEMM launches (triton_moe.py: the
activation and the routing weights in the kernels' epilogues, no host synchronisation).

Weights: the router [E, H], gate and up projections fused [E, 2I, H], down [E, H, I], read
from either checkpoint layout (per-expert tensors as released, or transformers 5's fused
`experts.gate_up_proj` / `experts.down_proj`: moe_weights)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from services.executor import cpu_kernels
from services.executor.moe_layout import moe_tiles
from services.executor.weights import take

Activation = Callable[[torch.Tensor], torch.Tensor]

# The fused Triton experts (triton_moe.py): None picks them for CUDA tensors where Triton
# imports; tests set True to run them on CPU under TRITON_INTERPRET=1 (False: never).
TRITON: bool | None = None


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    top_k: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen3 norm_topk_prob)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def moe_weights(
    state: dict[str, torch.Tensor],
    prefix: str,
    names: tuple[str, str, str],
    top_k: int,
    renormalize: bool,
) -> MoeWeights:
    """One layer's experts under `prefix` (e.g. `layers.3.mlp.`): the router `gate.weight`,
    then either the fused `experts.gate_up_proj` and `experts.down_proj` or per-expert
    `experts.{e}.{gate}.weight`, `{up}`, `{down}` (`names`: Mixtral's w1, w3, w2)."""
    router = take(state, prefix + "gate.weight")
    assert router is not None
    fused = take(state, prefix + "experts.gate_up_proj", required=False)
    if fused is not None:
        down = take(state, prefix + "experts.down_proj")
        assert down is not None
        return MoeWeights(router, fused, down, top_k, renormalize)
    gate, up, down_name = names
    experts = range(router.shape[0])

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([state.pop(f"{prefix}experts.{e}.{name}.weight") for e in experts])

    gate_up = torch.cat((stacked(gate), stacked(up)), dim=1).contiguous()
    return MoeWeights(router, gate_up, stacked(down_name).contiguous(), top_k, renormalize)


def route(x: torch.Tensor, w: MoeWeights, linear: Callable = F.linear) -> tuple[torch.Tensor, ...]:
    """(weights [T, k] fp32, experts [T, k]) as transformers' routers: softmax over the
    router's logits in fp32, top-k, renormalised to sum 1 where the family says."""
    probs = torch.softmax(linear(x, w.router).float(), dim=-1)
    top, experts = torch.topk(probs, w.top_k, dim=-1)
    if w.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [N, K] sorted by expert (counts[e] rows for expert e, a device tensor) times
    each expert's weight [E, M, K] transposed -> [N, M]. With torch._grouped_mm nothing
    waits for the device (the offsets stay there: CUDA graphs can hold the step); the
    fallback reads the counts on the host."""
    if _grouped_mm_works(x.device.type, x.dtype):
        ends = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            torch.mm(x[start : start + n], weight[e].t(), out=out[start : start + n])
            start += n
    return out


_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (tried once, on a tiny
    product checked against torch.mm)."""
    key = (device, dtype)
    if key not in _GROUPED:
        try:
            a = torch.arange(12, dtype=dtype, device=device).view(3, 4) / 8
            b = torch.arange(24, dtype=dtype, device=device).view(2, 4, 3) / 8
            ends = torch.tensor([1, 3], dtype=torch.int32, device=device)
            got = torch._grouped_mm(a, b, offs=ends)
            want = torch.cat((a[:1] @ b[0], a[1:] @ b[1]))
            _GROUPED[key] = bool(torch.allclose(got.float(), want.float(), rtol=1e-2))
        except (RuntimeError, AttributeError, TypeError, NotImplementedError):
            _GROUPED[key] = False
    return _GROUPED[key]


def moe_forward(
    x: torch.Tensor, w: MoeWeights, act: Activation, linear: Callable = F.linear
) -> torch.Tensor:
    """x [T, H] -> the experts' weighted sum [T, H] (act: act(gate) * up over [N, 2I])."""
    top, experts = route(x, w, linear)
    if _fused(x, w, act):
        from services.executor.triton_moe import fused_moe

        inner, hidden = w.down.shape[2], w.down.shape[1]
        tiles = moe_tiles(experts.numel(), w.num_experts, inner, hidden, x.dtype)
        return fused_moe(x, w.gate_up, w.down, top, experts, tiles)
    k = w.top_k
    flat = experts.flatten()  # [T * k], token t's j-th choice at t * k + j
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    counts = torch.zeros(w.num_experts, dtype=torch.long, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync, unlike bincount
    rows = x.index_select(0, tokens)  # [T * k, H], grouped by expert
    hidden = act(grouped_linear(rows, w.gate_up, counts))  # [T * k, I]
    out = grouped_linear(hidden, w.down, counts).float()  # [T * k, H]
    out.mul_(top.flatten().index_select(0, order)[:, None])
    summed = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    return summed.index_add_(0, tokens, out).to(x.dtype)


def _fused(x: torch.Tensor, w: MoeWeights, act: Activation) -> bool:
    """Whether the fused Triton experts take this step: SiLU gating (the kernel's epilogue),
    contiguous weights in x's dtype, and TRITON (None: a CUDA tensor and Triton importable)."""
    if act is not cpu_kernels.silu_and_mul:
        return False
    if not all(p.dtype == x.dtype and p.is_contiguous() for p in (w.gate_up, w.down)):
        return False
    if TRITON is not None:
        return TRITON
    return x.device.type == "cuda" and _triton_importable()


@cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None
