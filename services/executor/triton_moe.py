"""Fused mixture-of-experts experts for CUDA: the routed tokens' two expert projections as two
grouped-GEMM Triton launches, the activation and the routing weights in their epilogues.

Per step (the router's top-k comes from moe.route):
- align (moe_layout.py, in torch): the T x k (token, expert) assignments sorted by expert (one stable argsort) and laid
  out in row blocks of BLOCK_M, each expert's rows padded to a whole number of blocks; `ids`
  holds, per padded row, the assignment a = t * k + j it carries (T * k for a padding row) and
  `block_experts` each block's expert (E for the blocks past the last one used);
- gate-up, grid (blocks, I / BLOCK_N): each program multiplies its block's rows of x (token
  a // k) by its expert's gate and up rows [BLOCK_N, H] (two fp32 accumulators), then writes
  silu(gate) * up to row a of [T * k, I], rounding where moe.moe_forward does (the product to
  the model dtype, silu to the model dtype, the product of the two);
- down, grid (blocks, H / BLOCK_N): those rows times the expert's down projection, rounded to
  the model dtype, times the assignment's routing weight in fp32, written to row a of an fp32
  [T * k, H]; the k rows of each token are then summed in fp32 and rounded once.
Block sizes come from moe_layout.moe_tiles (a small table keyed by the rows an expert gets on
average; lab/executor/triton_compile.py compiles every row of it for sm_90).

No host synchronisation: every size is a function of the shapes alone. The padded rows are
bounded by T * k + E * (BLOCK_M - 1) (each expert wastes under one block), so the grids cover
that bound and the blocks past the last used one return at once; no `.item()`, no Python
branch on device values. The step can therefore be captured in a CUDA graph.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (lab/executor/moe_check.py compares
them with moe.py's grouped path; tests/unit/test_triton_moe.py bounds the errors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.executor.moe_layout import MoeTiles, align
from services.executor.triton_kernels import INTERPRETED, _round


@triton.jit
def _block_rows(IDS, BLOCK_EXPERTS, n_rows, BLOCK_M: tl.constexpr):
    """The program's row block: (its expert, int64; the assignment of each row [BLOCK_M],
    int64; which rows are real)."""
    b = tl.program_id(0)
    e = tl.load(BLOCK_EXPERTS + b).to(tl.int64)
    ids = tl.load(IDS + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return e, ids, ids < n_rows


@triton.jit
def _load(ptrs, mask, EMULATE: tl.constexpr):
    """A masked operand tile; the interpreter's bf16 stand-in is fp32 (exact, _round)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if EMULATE:
        x = x.to(tl.float32)
    return x


@triton.jit(do_not_specialize=("n_rows",))
def moe_gate_up_kernel(X, W, IDS, BLOCK_EXPERTS, OUT, n_rows, n_experts, hidden, inner,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       EMULATE: tl.constexpr):  # fmt: skip
    """Grid (blocks, cdiv(I, BLOCK_N)). X [T, H]; W [E, 2I, H] (gate rows, then up rows);
    OUT [T * k, I]: OUT[a] = silu(X[a // k] W[e, :I]^T) * (X[a // k] W[e, I:]^T)."""
    e, ids, ok = _block_rows(IDS, BLOCK_EXPERTS, n_rows, BLOCK_M)
    if e >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inner
    rows = X + (ids // TOP_K)[:, None] * hidden
    gate_w = W + e * 2 * inner * hidden + cols.to(tl.int64)[None, :] * hidden
    up_w = gate_w + inner * hidden
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = _load(rows + kk[None, :], ok[:, None] & (kk < hidden)[None, :], EMULATE)
        w_ok = (kk < hidden)[:, None] & col_ok[None, :]
        g = _load(gate_w + kk[:, None], w_ok, EMULATE)
        gate = tl.dot(a, g, gate, input_precision=PRECISION)
        u = _load(up_w + kk[:, None], w_ok, EMULATE)
        up = tl.dot(a, u, up, input_precision=PRECISION)
    dt = OUT.dtype.element_ty
    gate = _round(gate, dt, EMULATE).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dt, EMULATE).to(tl.float32)
    out = _round(act * _round(up, dt, EMULATE).to(tl.float32), dt, EMULATE).to(dt)
    tl.store(OUT + ids[:, None] * inner + cols[None, :], out, mask=ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=("n_rows",))
def moe_down_kernel(A, W, IDS, BLOCK_EXPERTS, ROUTE, OUT, n_rows, n_experts, hidden, inner,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
    """Grid (blocks, cdiv(H, BLOCK_N)). A [T * k, I]; W [E, H, I]; ROUTE [T * k] fp32;
    OUT [T * k, H] fp32: OUT[a] = (A[a] W[e]^T rounded to the model dtype) * ROUTE[a]."""
    e, ids, ok = _block_rows(IDS, BLOCK_EXPERTS, n_rows, BLOCK_M)
    if e >= n_experts:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    rows = A + ids[:, None] * inner
    w = W + e * hidden * inner + cols.to(tl.int64)[None, :] * inner
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = _load(rows + kk[None, :], ok[:, None] & (kk < inner)[None, :], EMULATE)
        b = _load(w + kk[:, None], (kk < inner)[:, None] & col_ok[None, :], EMULATE)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    route = tl.load(ROUTE + ids, mask=ok, other=0.0)
    out = _round(acc, A.dtype.element_ty, EMULATE).to(tl.float32) * route[:, None]
    tl.store(OUT + ids[:, None] * hidden + cols[None, :], out, mask=ok[:, None] & col_ok[None, :])


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    tiles: tuple[MoeTiles, MoeTiles],
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H], down [E, H, I] (contiguous, x's dtype); the router's
    weights [T, k] (fp32) and experts [T, k] -> sum_j weights[t, j] * expert_j(x[t]) [T, H] in
    x's dtype, SiLU gating; `tiles`: (gate-up, down) with one BLOCK_M (moe_layout.moe_tiles)."""
    x = x.contiguous()
    t, hidden = x.shape
    n_experts, two_inner, _ = gate_up.shape
    inner, k = two_inner // 2, experts.shape[1]
    n = t * k
    if n == 0:
        return x.new_zeros((t, hidden))
    up_tiles, down_tiles = tiles
    assert up_tiles.block_m == down_tiles.block_m
    ids, block_experts = align(experts.flatten(), n_experts, up_tiles.block_m)
    emulate = INTERPRETED and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(PRECISION=precision, EMULATE=emulate)
    act = torch.empty((n, inner), dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(block_experts.numel(), triton.cdiv(inner, up_tiles.block_n))](
        x, gate_up, ids, block_experts, act, n, n_experts, hidden, inner, TOP_K=k,
        **_launch(up_tiles), **common,
    )  # fmt: skip
    rows = torch.empty((n, hidden), dtype=torch.float32, device=x.device)
    route = weights.to(torch.float32).flatten().contiguous()
    moe_down_kernel[(block_experts.numel(), triton.cdiv(hidden, down_tiles.block_n))](
        act, down, ids, block_experts, route, rows, n, n_experts, hidden, inner,
        **_launch(down_tiles), **common,
    )  # fmt: skip
    return rows.view(t, k, hidden).sum(dim=1).to(x.dtype)


def _launch(tiles: MoeTiles) -> dict[str, int]:
    return {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
