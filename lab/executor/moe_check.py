"""The fused Triton experts (services/executor/triton_moe.py) against a per-expert reference.

    TRITON_INTERPRET=1 python -m lab.executor.moe_check     # CPU, the Triton interpreter
    python -m lab.executor.moe_check --device cuda          # GPU
    ... [--engine TINY_MOE_MODEL_DIR]   # also whole engines, fused experts on and off

Each case routes a few tokens of hidden 48 (inner 24) through moe.moe_forward with the fused
path on (moe.TRITON), and compares with a loop over experts that rounds where moe.py's grouped
path does (each product and the activation in the model dtype, the weighted sum in fp32), and
with the same loop in float64 on the same weights (the exact answer). Prints {"cases": {case: {"fused":
max |fused - exact|, "reference": max |reference - exact| (the reference's own rounding),
"vs_reference": max |fused - reference|, "planted": max |fused - exact| with each expert's
gate-up weights moved to the next expert (a wrong-expert error the bound must catch),
"empty_experts": experts no token chose}}, "engine": {dtype: max |logits diff| of a tiny
MoE engine with the fused experts on and off} with --engine}; tests/unit/test_triton_moe.py
bounds them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.executor import moe
from services.executor.cpu_kernels import silu_and_mul
from services.executor.moe import MoeWeights, moe_forward, route
from services.executor.moe_layout import MoeTiles

HIDDEN, INNER = 48, 24


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    experts: int
    top_k: int
    renormalize: bool
    tokens: int = 7
    tiles: int = 0  # > 0: every tile side (BLOCK_M, BLOCK_N, BLOCK_K) this size, not moe_tiles


CASES = (
    Case("fp32-e4-k2-renorm", torch.float32, 4, 2, True),
    Case("fp32-e16-k1", torch.float32, 16, 1, False),
    Case("bf16-e8-k2", torch.bfloat16, 8, 2, False),
    Case("bf16-e16-k1-renorm", torch.bfloat16, 16, 1, True),
    # 80 rows on 4 experts in blocks of 16: several blocks per expert, column tiles, K steps
    Case("bf16-e4-k2-renorm-tiles16", torch.bfloat16, 4, 2, True, tokens=40, tiles=16),
)


def make_weights(case: Case, device: str, seed: int = 0) -> MoeWeights:
    gen = torch.Generator().manual_seed(seed)
    e = case.experts

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, case.dtype)

    router = rand(e, HIDDEN)
    gate_up, down = rand(e, 2 * INNER, HIDDEN, scale=0.2), rand(e, HIDDEN, INNER, scale=0.2)
    return MoeWeights(router, gate_up, down, case.top_k, case.renormalize)


def per_expert(x: torch.Tensor, w: MoeWeights, dtype: torch.dtype) -> torch.Tensor:
    """Each expert's tokens through its projections in `dtype` (float64: exact), weighted by
    the router's fp32 choice (moe.route on the model-dtype inputs) and summed in fp32 (in
    float64 for the exact answer)."""
    top, chosen = route(x, w)
    xs, gate_up, down = (t.to(dtype) for t in (x, w.gate_up, w.down))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in range(w.num_experts):
        tok, slot = torch.where(chosen == e)
        if tok.numel():
            hidden = silu_and_mul(F.linear(xs[tok], gate_up[e]))
            y = F.linear(hidden, down[e]).to(acc) * top[tok, slot, None].to(acc)
            out.index_add_(0, tok, y)
    return out


def compare_case(case: Case, device: str = "cpu") -> dict[str, float]:
    w = make_weights(case, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.tokens, HIDDEN, generator=gen).to(device, case.dtype)
    exact = per_expert(x, w, torch.float64)
    reference = per_expert(x, w, case.dtype).to(case.dtype)
    fused = _fused(x, w, case)
    rolled = torch.roll(w.gate_up, 1, dims=0).contiguous()
    planted = _fused(x, MoeWeights(w.router, rolled, w.down, w.top_k, w.renormalize), case)
    _, chosen = route(x, w)
    return {
        "fused": _err(fused, exact),
        "reference": _err(reference, exact),
        "vs_reference": _err(fused, reference),
        "planted": _err(planted, exact),
        "empty_experts": float(case.experts - chosen.unique().numel()),
    }


def _fused(x: torch.Tensor, w: MoeWeights, case: Case) -> torch.Tensor:
    """moe_forward with the fused experts forced on (or fused_moe with the case's tiles)."""
    from services.executor import triton_moe

    if case.tiles:
        top, chosen = route(x, w)
        tiles = MoeTiles(case.tiles, case.tiles, case.tiles)
        return triton_moe.fused_moe(x, w.gate_up, w.down, top, chosen, (tiles, tiles))
    saved, moe.TRITON = moe.TRITON, True
    try:
        return moe_forward(x, w, silu_and_mul)
    finally:
        moe.TRITON = saved


def engine_diff(model_dir: str, dtype: str) -> float:
    """Max |logits| difference of one Engine (torch attention) with the fused experts on and
    off: prompts of 1, 9 and 23 tokens fed in chunks of 5 (prefill chunks and decodes)."""
    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    engine = Engine(model_dir, device="cpu", dtype=dtype, num_device_blocks=64, num_host_blocks=1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (1, 9, 23)]
    runs = []
    saved = moe.TRITON
    try:
        for fused in (False, True):
            moe.TRITON = fused
            runs.append(teacher_forced_logits(engine, prompts, [5, 5, 5]))
    finally:
        moe.TRITON = saved
    return max((a - b).abs().max().item() for a, b in zip(*runs, strict=True))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", metavar="MODEL_DIR", help="also a whole MoE engine, on/off")
    parser.add_argument("--engine-dtypes", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args(argv)
    result: dict = {"cases": {c.name: compare_case(c, args.device) for c in CASES}}
    if args.engine:
        result["engine"] = {d: engine_diff(args.engine, d) for d in args.engine_dtypes}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
