"""Compare the Triton backend with the torch reference backend on a matrix of mixed steps.

    TRITON_INTERPRET=1 python -m lab.executor.triton_check [--case NAME ...]   # CPU
    python -m lab.executor.triton_check --device cuda                         # GPU
    ... [--engine TINY_MODEL_DIR]   # also whole engines: torch vs Triton backend logits

Each case is one forward step of one layer over a paged pool holding a random history (shuffled
block tables): decodes and prefill chunks mixed in one packed batch, one long context per case.
Prints {"cases": {name: {"out": max |diff| of attention outputs, "cache": max |diff| of the KV
pool after the write, "tol": the case's bound, "splits": the split-KV factor used}},
"padding_write": max |change| of pool slots a padding token (slot -1) must not touch,
"engine": {kv-block: max |diff| of logits} with --engine}.
The interpreter runs every program in Python, so the matrix is small and one context per case
is long.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from services.common.arith import ceil_div
from services.executor import quant
from services.executor.int8_kv import Int8PagedKV
from services.executor.kv_cache import PagedKV
from services.executor.ragged_batch import StepBatch, TokenRun, build_batch

KVPool: TypeAlias = PagedKV | Int8PagedKV
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2, "int8": 2e-2}
MIXED = ((1, 2047), (21, 40), (1, 4))  # (q_len, ctx_before): long decode, chunk, short decode
CHUNKS = ((1, 700), (21, 0), (9, 1116))  # a whole prompt; a chunk that seals a 16/32 block


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    group: int  # query heads per KV head
    kv_heads: int
    block_size: int
    dtype: str  # model (and full-precision KV) dtype
    kv: str  # "auto" (model dtype) or "int8"
    splits: int | None  # split-KV factor; None: the backend's rule
    runs: tuple[tuple[int, int], ...] = MIXED
    window: int = 0  # sliding window in keys (0: none)
    softcap: float = 0.0  # attention soft-capping (0: none)

    @property
    def tol(self) -> float:
        return TOLERANCE["int8" if self.kv == "int8" else self.dtype]


def _matrix() -> tuple[Case, ...]:
    """D in {64, 128} x G in {1, 4, 7, 8}, each in fp32 with split-KV off and on, bf16 and
    INT8 KV; block sizes 16/32, one or two KV heads and the two batch shapes alternate; plus
    fp16 and a decode-only step whose split factor comes from the backend's rule."""
    cases = []
    for i, (d, g) in enumerate((d, g) for d in (64, 128) for g in (1, 4, 7, 8)):
        bs, hkv = (16, 32)[i % 2], 1 + (i % 3 == 0)
        runs, shape = (MIXED, "mixed") if i // 2 % 2 == 0 else (CHUNKS, "chunks")
        split = (2, 4)[i % 2]
        for dtype, kv, splits in (
            ("float32", "auto", 1),
            ("float32", "auto", split),
            ("bfloat16", "auto", (1, split)[i // 4]),
            (("float32", "bfloat16")[i % 2], "int8", (split, 1)[i // 4]),
        ):
            kind = dtype if kv == "auto" else f"int8-{dtype}"
            name = f"{kind}-d{d}-g{g}-bs{bs}-hkv{hkv}-split{splits}-{shape}"
            cases.append(Case(name, d, g, hkv, bs, dtype, kv, splits, runs))
    cases.append(Case("float16-d64-g8-bs16-hkv2-split1-mixed", 64, 8, 2, 16, "float16", "auto", 1))
    decodes = ((1, 2000), (1, 300))
    rule = Case("float32-d128-g4-bs16-decode-rule", 128, 4, 1, 16, "float32", "auto", None, decodes)
    windowed = [  # Gemma's sliding windows and soft-capping, in every kind of step
        Case(
            f"{kind}-d64-g4-bs16-split{sp}-window40-cap2", 64, 4, 2, 16, dt, kv, sp, MIXED, 40, 2.0
        )
        for kind, dt, kv, sp in (
            ("float32", "float32", "auto", 1),
            ("float32", "float32", "auto", 4),
            ("bfloat16", "bfloat16", "auto", 2),
            ("int8-float32", "float32", "int8", 1),
        )
    ]
    return (*cases, rule, *windowed)


CASES = _matrix()


def _fill(source: KVPool, others: list[KVPool], gen: torch.Generator) -> None:
    """The same random history in every pool: values ~ N(0, 1) in the pool's dtype (INT8:
    quantized per block, the staging buffers exact); the others get copies."""
    if isinstance(source, Int8PagedKV):
        t = source.tensors
        for name, quantize in (("k", quant.quantize_keys), ("v", quant.quantize_values)):
            codes, scale, offset = quantize(torch.randn(t[name + "q"].shape, generator=gen))
            for src, x in zip("qso", (codes, scale, offset), strict=True):
                t[name + src].copy_(x)
        source.k_stage.copy_(torch.randn(source.k_stage.shape, generator=gen))
        source.v_stage.copy_(torch.randn(source.v_stage.shape, generator=gen))
    else:
        for x in source.tensors.values():
            x.copy_(torch.randn(x.shape, generator=gen))
    for other in others:
        for name, x in source.tensors.items():
            other.tensors[name].copy_(x)
        if isinstance(other, Int8PagedKV) and isinstance(source, Int8PagedKV):
            other.k_stage.copy_(source.k_stage)
            other.v_stage.copy_(source.v_stage)


def _runs(case: Case, slots: list[int], gen: torch.Generator) -> tuple[list[TokenRun], int]:
    """TokenRuns with disjoint shuffled block tables, and the pool size they need."""
    need = [ceil_div(ctx + q, case.block_size) for q, ctx in case.runs]
    ids = torch.randperm(sum(need) + 3, generator=gen).tolist()
    runs, at = [], 0
    for i, ((q_len, ctx), n) in enumerate(zip(case.runs, need, strict=True)):
        runs.append(TokenRun(f"r{i}", [0] * q_len, ctx, ids[at : at + n], slots[i], True))
        at += n
    return runs, len(ids)


def _context_fp32(cache: KVPool, run: TokenRun) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's K, V [Hkv, ctx, D] as the pool holds them after the step's write, in
    fp32 (INT8: sealed blocks dequantized at the model dtype, the open block from staging)."""
    bs, n, t = cache.block_size, run.ctx_after, cache.tensors
    hkv, d = cache.kv_heads, cache.head_dim
    if not isinstance(cache, Int8PagedKV):
        blocks = torch.tensor(run.block_table[: ceil_div(n, bs)], device=cache.device)
        k, v = (t[x][0].index_select(1, blocks).reshape(hkv, -1, d)[:, :n] for x in "kv")
        return k.float(), v.float()
    sealed = torch.tensor(run.block_table[: n // bs], dtype=torch.long, device=cache.device)
    parts = []
    for name, deq, stage in (
        ("k", quant.dequantize_keys, cache.k_stage),
        ("v", quant.dequantize_values, cache.v_stage),
    ):
        codes, scale, offset = (t[name + x][0].index_select(1, sealed) for x in "qso")
        full = deq(codes, scale, offset, cache.dtype).float().reshape(hkv, -1, d)
        open_part = stage[0][:, run.staging_slot, : n % bs].float()
        parts.append(torch.cat([full, open_part], dim=1))
    return parts[0], parts[1]


def reference_attention(
    cache: KVPool,
    q: torch.Tensor,
    batch: StepBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention in fp32 of the packed queries q [T, H, D] over each request's context
    in the pool, GQA by folding the G heads of a KV head: plain torch, no backend involved.
    window > 0: each query sees its last `window` keys; softcap > 0: scores soft-capped."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for run in batch.runs:  # packed order
        k, v = _context_fp32(cache, run)  # [Hkv, ctx, D]
        hkv, n_q, d = k.shape[0], run.q_len, q.shape[2]
        g = q.shape[1] // hkv
        qr = q[row : row + n_q].float().view(n_q, hkv, g, d).permute(1, 0, 2, 3)
        scores = qr.reshape(hkv, n_q * g, d) @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = (run.ctx_before + torch.arange(n_q, device=q.device)).repeat_interleave(g)
        key = torch.arange(k.shape[1], device=q.device)[None, :]
        unseen = (key > pos[:, None]) | ((key <= pos[:, None] - window) if window else False)
        probs = torch.softmax(scores.masked_fill(unseen, float("-inf")), dim=-1)
        o = (probs @ v).view(hkv, n_q, g, d).permute(1, 0, 2, 3)
        out[row : row + n_q] = o.reshape(n_q, hkv * g, d)
        row += n_q
    return out


def compare_case(case: Case, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """One step through both backends over two copies of one pool: max |diff| of the outputs
    and of the pools after the step. The reference is the torch backend computing in fp32 over
    the same values (bf16/fp16 queries upcast exactly), so `out` is the kernel's own error
    rather than two roundings of the output."""
    from services.executor.triton_attention import TritonAttention

    dev, dtype = torch.device(device), getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(seed)
    h, d = case.kv_heads * case.group, case.head_dim
    runs, blocks = _runs(case, list(range(len(case.runs))), gen)
    cls = Int8PagedKV if case.kv == "int8" else PagedKV
    ref_cache, tri_cache = (
        cls(1, blocks, case.block_size, case.kv_heads, d, dtype, dev) for _ in "ab"
    )
    for c in (ref_cache, tri_cache):
        for r in runs:
            assert c.open_request(r.request_id) in (r.staging_slot, -1)
    _fill(tri_cache, [ref_cache], gen)
    t = sum(r.q_len for r in runs)
    q, k, v = (
        torch.randn(t, n, d, generator=gen).to(dev, dtype) for n in (h, *[case.kv_heads] * 2)
    )
    tri = TritonAttention(
        h, case.kv_heads, d, d**-0.5, dev, kv_splits=case.splits, dtype=dtype,
        windows=(case.window,), softcap=case.softcap,
    )  # fmt: skip
    batch = build_batch(runs, case.block_size, dev)
    ref_cache.prepare(batch)
    ref_cache.write(0, k, v, batch)
    ref = reference_attention(ref_cache, q, batch, d**-0.5, case.window, case.softcap)
    outs = [ref.view(t, h * d)]
    batch = build_batch(runs, case.block_size, dev)  # the same packed order, fresh metadata
    tri_cache.prepare(batch)
    tri.prepare(batch)
    outs.append(tri.forward(0, q, k, v, tri_cache, batch).float())
    cache_diff = max(
        (ref_cache.tensors[n].float() - tri_cache.tensors[n].float()).abs().max().item()
        for n in ref_cache.tensors
    )
    assert tri.step is not None
    err = (outs[0] - outs[1]).abs().view(t, h, d).amax(dim=2)  # per (token, head); NaN kept
    bad = (~(err <= case.tol)).nonzero().tolist()  # rows off by more than tol, or NaN
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "cache": cache_diff,
        "tol": case.tol,
        "splits": tri.step.splits,
        "bad_rows": len(bad),  # (token, head) rows of the output past tol
        "first_bad": bad[:6],
    }


def padding_write(device: str = "cpu") -> float:
    """write_kv with slot -1 rows: max |change| of the pool outside the real tokens' slots
    (0.0 when padding writes nothing) plus max |error| at those slots."""
    from services.executor import triton_kernels as kern

    dev = torch.device(device)
    hkv, d, nb, bs = 2, 64, 4, 16
    gen = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(hkv, nb, bs, d, generator=gen).to(dev) for _ in range(2))
    before = (kc.clone(), vc.clone())
    kn, vn = (torch.randn(4, hkv, d, generator=gen).to(dev) for _ in range(2))
    slots = torch.tensor([-1, 5, -1, 37], dtype=torch.int32, device=dev)
    kern.write_kv[(4, hkv)](kn, vn, slots, kc, vc, nb * bs, HKV=hkv, D=d)
    worst = 0.0
    for cache, old, new in ((kc, before[0], kn), (vc, before[1], vn)):
        flat, old_flat = cache.view(hkv, nb * bs, d), old.view(hkv, nb * bs, d).clone()
        old_flat[:, [5, 37]] = new[[1, 3]].transpose(0, 1)
        worst = max(worst, (flat - old_flat).abs().max().item())
    return worst


ENGINE_PROMPTS = [list(range(200, 224)), list(range(1000, 1013)), list(range(5000, 5070))]
ENGINE_CHUNKS: list[int | None] = [1, 7, None]  # decodes, 7-token chunks, a whole prompt


def engine_parity(
    model_dir: str, kv_dtype: str = "auto", block_size: int = 16, device: str = "cpu"
) -> float:
    """Max |diff| of teacher-forced logits (mixed decode / chunk / prompt steps) between an
    Engine on the torch backend and one on the Triton backend, same tiny model (fp32)."""
    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    logits = []
    for backend in ("torch", "triton"):
        engine = Engine(
            model_dir,
            device=device,
            dtype="fp32",
            kv_dtype=kv_dtype,
            block_size=block_size,
            num_device_blocks=24,
            num_host_blocks=2,
            attention_backend=backend,
        )
        logits.append(teacher_forced_logits(engine, ENGINE_PROMPTS, ENGINE_CHUNKS))
    return max(float((a - b).abs().max()) for a, b in zip(*logits, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th")
    parser.add_argument("--engine", metavar="MODEL_DIR", help="also compare whole engines")
    parser.add_argument(
        "--windowed", metavar="MODEL_DIR", help="and on a model with windows and soft-capping"
    )
    args = parser.parse_args(argv)
    shard, shards = map(int, args.shard.split("/"))
    chosen = [c for c in CASES if not args.case or c.name in args.case][shard::shards]
    results: dict[str, Any] = {
        "cases": {c.name: compare_case(c, args.device) for c in chosen},
        "padding_write": padding_write(args.device),
    }
    if args.engine:
        results["engine"] = {
            f"{kv}-bs{bs}": engine_parity(args.engine, kv, bs, args.device)
            for kv, bs in (("auto", 16), ("int8", 8))
        }
    if args.windowed:
        results["windowed_engine"] = engine_parity(args.windowed, "auto", 16, args.device)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
