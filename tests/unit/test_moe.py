"""The grouped mixture-of-experts MLP (services/executor/moe.py) equals a per-expert
reference (transformers' loop: each expert's tokens, weighted, added back), with
torch._grouped_mm and with the per-expert fallback, experts that receive no token included."""

from __future__ import annotations

import pytest
import torch

from services.executor import moe
from services.executor.llama import gate_activation
from services.executor.moe import MoeWeights, moe_forward, route


def _weights(experts: int, top_k: int, renormalize: bool, seed: int = 0) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)
    h, i = 32, 24
    return MoeWeights(
        torch.randn(experts, h, generator=gen),
        torch.randn(experts, 2 * i, h, generator=gen) * 0.1,
        torch.randn(experts, h, i, generator=gen) * 0.1,
        top_k,
        renormalize,
    )


def reference(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    act = gate_activation("silu")
    probs = torch.softmax(x @ w.router.t(), dim=-1)
    top, idx = torch.topk(probs, w.top_k, dim=-1)
    if w.renormalize:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(w.num_experts):
        pos, tok = torch.where(idx.t() == e)
        if tok.numel():
            y = act(x[tok] @ w.gate_up[e].t()) @ w.down[e].t()
            out.index_add_(0, tok, y * top[tok, pos, None])
    return out


@pytest.mark.parametrize("grouped_mm", [True, False])
@pytest.mark.parametrize("experts,top_k,renormalize", [(4, 2, True), (16, 3, False)])
def test_grouped_experts_equal_the_per_expert_reference(
    monkeypatch, grouped_mm, experts, top_k, renormalize
):
    monkeypatch.setattr(moe, "_grouped_mm_works", lambda device, dtype: grouped_mm)
    w = _weights(experts, top_k, renormalize)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))  # 7 x 3 < 16 experts
    _, chosen = route(x, w)
    if experts == 16:
        assert len(set(chosen.flatten().tolist())) < experts  # some expert gets no token
    got = moe_forward(x, w, gate_activation("silu"))
    assert torch.allclose(got, reference(x, w), atol=1e-5)


def test_routing_renormalises_only_where_the_family_says():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    top, _ = route(x, _weights(8, 3, True))
    assert torch.allclose(top.sum(-1), torch.ones(5))
    top, _ = route(x, _weights(8, 3, False))
    assert (top.sum(-1) < 1).all()
