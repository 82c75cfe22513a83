"""Compile the Triton kernels for a CUDA target without a GPU (Triton's own compiler and the
ptxas its wheel ships), so a CPU-only CI catches what the interpreter cannot: constexpr misuse,
dtype mismatches in tl.dot, shapes a GPU tl.dot refuses, resources ptxas rejects. Variants
use the tile sizes and launch configuration the backend picks (triton_plan.py).

    python -m lab.executor.triton_compile [--arch 90]      # 90: H100; TRITON_INTERPRET unset
Prints {variant: {"shared": bytes of shared memory}}; exits 1 listing the failures.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch

from services.executor import triton_plan as plan
from services.executor.moe_layout import moe_tiles

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: str  # attribute of triton_kernels
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, int]
    aligned: tuple[str, ...] = ()  # arguments a launch specialises as multiples of 16


def _sig(
    pointers: dict[str, str], scalars: dict[str, str], consts: dict[str, Any]
) -> dict[str, str]:
    return {
        **{k: "*" + v for k, v in pointers.items()},
        **scalars,
        **dict.fromkeys(consts, "constexpr"),
    }


def attention(
    dtype: torch.dtype,
    int8: bool,
    splits: int,
    d: int,
    g: int,
    bs: int,
    chunks: bool,
    softcap: float = 0.0,
) -> Variant:
    """paged_attention as TritonAttention launches it for this shape (softcap: a Gemma 2
    model's attention soft-cap; sliding windows are a run-time argument)."""
    t = TYPES[dtype]
    block_m, _ = plan.query_tile(g, chunks)
    kv, scale = ("u8", "fp16") if int8 else (t, t)
    pointers = {"Q": t, "OUT": t, "PART_ACC": "fp32", "PART_ML": "fp32"}
    pointers |= dict.fromkeys(("TILES", "TABLES", "REQ_CTX", "REQ_SLOT"), "i32")
    pointers |= {"K": kv, "V": kv, "KS": scale, "KO": scale, "VS": scale, "VO": scale}
    pointers |= {"KST": t, "VST": t}
    scalars = {"qk_scale": "fp32"} | dict.fromkeys(
        ("n_tiles", "n_tokens", "nb_total", "n_slots", "nb_max", "window"), "i32"
    )
    consts: dict[str, Any] = {"H": 2 * g, "G": g, "D": d, "BS": bs, "BLOCK_M": block_m}
    consts |= {
        "BLOCK_N": plan.kv_tile(bs, d, dtype == torch.float32),
        "INT8": int8,
        "SPLITS": splits,
    }
    consts |= {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "EMULATE": False}
    consts["SOFTCAP"] = softcap
    name = f"attention-{t}-{'int8' if int8 else 'fp'}-d{d}-g{g}-bs{bs}-split{splits}"
    name += ("-chunks" if chunks else "-decodes") + (f"-softcap{softcap:g}" if softcap else "")
    sig = _sig(pointers, scalars, consts)
    return Variant(name, "paged_attention", sig, consts, plan.launch_config(dtype))


def reduce(dtype: torch.dtype, d: int, g: int, splits: int) -> Variant:
    t = TYPES[dtype]
    consts = {"H": 2 * g, "G": g, "BLOCK_G": plan.next_pow2(g), "D": d, "SPLITS": splits}
    consts["EMULATE"] = False
    sig = _sig({"PART_ACC": "fp32", "PART_ML": "fp32", "OUT": t}, {"n_tokens": "i32"}, consts)
    return Variant(f"reduce-{t}-d{d}-g{g}-split{splits}", "reduce_splits", sig, consts, {})


def write(dtype: torch.dtype, d: int) -> Variant:
    t = TYPES[dtype]
    consts = {"HKV": 8, "D": d}
    pointers = {"KN": t, "VN": t, "SLOTS": "i32", "KC": t, "VC": t}
    sig = _sig(pointers, {"total_slots": "i32"}, consts)
    return Variant(f"write-{t}-d{d}", "write_kv", sig, consts, {})


def quantize(dtype: torch.dtype, d: int, bs: int, keys: bool) -> Variant:
    t = TYPES[dtype]
    consts = {"BS": bs, "D": d, "PER_CHANNEL": keys}
    pointers = {"SRC": t, "SRC_IDX": "i32", "DST": "i32", "CODES": "u8"}
    pointers |= {"SCALE": "fp16", "OFFSET": "fp16"}
    sig = _sig(pointers, {"n_src": "i32", "nb_total": "i32"}, consts)
    name = f"quantize-{t}-d{d}-bs{bs}-{'keys' if keys else 'values'}"
    return Variant(name, "quantize_blocks", sig, consts, {})


def fused(dtype: torch.dtype) -> list[Variant]:
    """The fused layer kernels (triton_fused.py) at Llama-3-8B's sizes."""
    t = TYPES[dtype]
    norm = {"BLOCK": 4096, "ADD": True, "EMULATE": False}
    sig = _sig(dict.fromkeys(("X", "DELTA", "W", "X_OUT", "H_OUT"), t),
               {"n_cols": "i32", "eps": "fp32"}, norm)  # fmt: skip
    silu = {"BLOCK": 1024, "EMULATE": False}
    rope = {"H": 32, "HKV": 8, "D": 128, "EMULATE": False}
    rope_ptrs = {"QKV": t, "POS": "i32", "COS": t, "SIN": t, "Q": t, "K": t, "V": t}
    return [
        Variant(f"add-rms-norm-{t}", "add_rms_norm_kernel", sig, norm, {"num_warps": 8}),
        Variant(
            f"silu-mul-{t}",
            "silu_mul_kernel",
            _sig({"GU": t, "OUT": t}, {"n_inner": "i32"}, silu),
            silu,
            {},
        ),
        Variant(f"rope-qkv-{t}", "rope_qkv_kernel", _sig(rope_ptrs, {}, rope), rope, {}),
    ]


def moe(dtype: torch.dtype, tokens: int, top_k: int, experts: int, inner: int,
        hidden: int) -> list[Variant]:  # fmt: skip
    """The fused MoE kernels (triton_moe.py) with the tiles moe_tiles picks for a step of
    `tokens` tokens of this model."""
    t = TYPES[dtype]
    up, down = moe_tiles(tokens * top_k, experts, inner, hidden, dtype)
    scalars = dict.fromkeys(("n_rows", "n_experts", "hidden", "inner"), "i32")
    rows = {"IDS": "i32", "BLOCK_EXPERTS": "i32"}
    out = []
    for kernel, tiles, pointers, top in (
        ("moe_gate_up_kernel", up, {"X": t, "W": t} | rows | {"OUT": t}, {"TOP_K": top_k}),
        ("moe_down_kernel", down, {"A": t, "W": t} | rows | {"ROUTE": "fp32", "OUT": "fp32"}, {}),
    ):
        consts: dict[str, Any] = {
            **top,
            "BLOCK_M": tiles.block_m,
            "BLOCK_N": tiles.block_n,
            "BLOCK_K": tiles.block_k,
        }
        consts |= {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "EMULATE": False}
        name = (
            f"{kernel.removesuffix('_kernel').replace('_', '-')}-{t}-e{experts}-bm{tiles.block_m}"
        )
        options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        sig = _sig(pointers, scalars, consts)
        # as launched: torch's pointers and these models' sizes are multiples of 16 (without
        # it a bf16 row has no known 4-byte alignment and nothing is pipelined)
        aligned = (*pointers, "hidden", "inner")
        out.append(Variant(name, kernel, sig, consts, options, aligned))
    return out


def variants() -> list[Variant]:
    """Both head dims, INT8 and not, decodes with split-KV and prefill chunks, GQA 1/7/8,
    blocks 8 (the tiny test models, D 16), 16 and 32, in bf16 (the GPU default), fp16, fp32."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = [
        attention(bf16, int8, splits, d, g, 16, chunks)
        for d in (64, 128)
        for int8 in (False, True)
        for splits, g, chunks in ((4, 8, False), (1, 7, True))
    ]
    out += [
        attention(bf16, False, 1, 128, 4, 32, True),
        attention(bf16, False, 1, 16, 2, 8, True),
        attention(fp16, False, 2, 128, 4, 16, False),
        attention(fp32, True, 1, 128, 7, 16, True),
        attention(fp32, False, 2, 64, 1, 16, False),
        attention(fp32, False, 1, 128, 4, 32, True),
        attention(bf16, False, 2, 256, 2, 16, False),  # Gemma 3 12B's heads
        attention(bf16, False, 1, 256, 2, 16, True),
        attention(bf16, False, 1, 128, 2, 16, True, softcap=50.0),  # Gemma 2
        reduce(bf16, 128, 7, 4),
        reduce(bf16, 256, 2, 2),
        reduce(fp32, 64, 1, 16),
        write(bf16, 128),
        quantize(bf16, 128, 16, True),
        quantize(bf16, 64, 32, False),
        *fused(bf16),
        *fused(fp32),
        # every row of triton_moe's tile table: Mixtral 8x7B decodes and a long prefill,
        # Qwen3-30B-A3B (128 experts of inner 768) at 32 and 128 rows per expert
        *moe(bf16, 8, 2, 8, 14336, 4096),
        *moe(bf16, 512, 8, 128, 768, 2048),
        *moe(bf16, 2048, 8, 128, 768, 2048),
        *moe(bf16, 8192, 2, 8, 14336, 4096),
        *moe(fp32, 16, 2, 4, 96, 64),
    ]
    return out


def compile_all(
    arch: int = 90, shard: int = 0, shards: int = 1
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Compile every variant (every `shards`-th from `shard`: processes can split the list)
    for sm_<arch>: ({name: {"shared": bytes}}, {name: error})."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.executor import triton_fused, triton_kernels, triton_moe

    target = GPUTarget("cuda", arch, 32)
    done, failed = {}, {}
    for v in variants()[shard::shards]:
        module = next(m for m in (triton_fused, triton_moe, triton_kernels) if hasattr(m, v.kernel))
        fn = getattr(module, v.kernel)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in v.aligned}
        src = ASTSource(fn, v.signature, v.constexprs, attrs)
        try:
            compiled = triton.compile(src, target=target, options=v.options)
        except Exception as e:  # report every failing variant, not only the first
            failed[v.name] = f"{type(e).__name__}: {e}"[-2000:]
            continue
        done[v.name] = {"shared": int(compiled.metadata.shared)}
    return done, failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th variant from the I-th")
    args = parser.parse_args(argv)
    shard, shards = map(int, args.shard.split("/"))
    done, failed = compile_all(args.arch, shard, shards)
    print(json.dumps({"compiled": done, "failed": failed}))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
