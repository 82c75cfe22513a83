"""Where FP8 decode time goes on the Llama-3-8B linear shapes (a GPU with FP8 units):

    python -m lab.executor.fp8_probe > bench/results/fp8_linear_probe.json

Per shape (qkv, o, gate_up, down) and rows M = 1 / 32 / 256, microseconds per product
(triton.testing.do_bench): bf16 F.linear, the served FP8 path (fp8.Fp8Weight.matmul:
per-token activation quantization in torch ops, then torch._scaled_mm), torch._scaled_mm alone
on activations quantized beforehand, and a Triton weight-only FP8 product (codes dequantized
in registers, bf16 MMA, split-K) over a few tile configurations (`w8_best`: the fastest
within 2% of the dequantized product, with its configuration and error).
"""

import json

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from services.executor.fp8 import pack


@triton.jit(do_not_specialize=("M",))
def w8(
    X,
    W,
    S,
    OUT,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pk = tl.program_id(2)
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pk * per, tl.minimum((pk + 1) * per, K), BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            X + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        w = tl.load(
            W + rn[:, None] * K + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0
        )
        acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(OUT + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=mask)
    else:
        tl.atomic_add(OUT + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")


def w8_linear(x, codes, scales, bn, bk, split, warps, stages):
    m, k = x.shape
    n = codes.shape[0]
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    if split == 1:
        out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    else:
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    w8[grid](
        x,
        codes,
        scales,
        out,
        m,
        n,
        k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        num_warps=warps,
        num_stages=stages,
    )
    return out if split == 1 else out.to(torch.bfloat16)


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CONFIGS = [(bn, bk, s, 4, 4) for bn in (32, 64) for bk in (128, 256) for s in (1, 4)]


def _us(fn) -> float:
    return round(do_bench(fn) * 1e3, 2)


def _weight_only(x, p, ref) -> dict:
    """The Triton weight-only product at each configuration, and the fastest accurate one."""
    codes, scales = p.codes, p.scales.reshape(-1).contiguous()
    row: dict = {}
    best = None
    for cfg in CONFIGS:
        name = "w8_" + "_".join(map(str, cfg))
        try:
            y = w8_linear(x, codes, scales, *cfg)
            err = float((y.float() - ref).abs().max() / ref.abs().max())
            row[name] = t = _us(lambda cfg=cfg: w8_linear(x, codes, scales, *cfg))
            if err < 2e-2 and (best is None or t < best[0]):
                best = (t, cfg, err)
        except Exception as e:
            row[name] = repr(e)[:120]
    row["w8_best"] = best
    return row


def shape_row(w: torch.Tensor, m: int) -> dict:
    """Every product of `m` rows against `w` [N, K], microseconds."""
    p = pack(w)
    x = torch.randn(m, w.shape[1], device="cuda").bfloat16()
    xs = x.float().abs().amax(-1, keepdim=True) / 448
    xq = (x.float() / xs).to(torch.float8_e4m3fn)
    row = {
        "bf16": _us(lambda: torch.nn.functional.linear(x, w)),
        "served_fp8": _us(lambda: p.matmul(x)),
        "scaled_mm_only": _us(
            lambda: torch._scaled_mm(
                xq, p.codes.t(), scale_a=xs, scale_b=p.scales, out_dtype=torch.bfloat16
            )
        ),
    }
    ref = torch.nn.functional.linear(x.float(), p.dequantized())
    return row | _weight_only(x, p, ref)


def main() -> None:
    out: dict = {"device": torch.cuda.get_device_name(), "us": {}}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        for m in (1, 32, 256):
            out["us"][f"{name}_m{m}"] = shape_row(w, m)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
