"""Analytical roofline cost profiles for named GPU/model pairs (at-scale simulation).

Public specs used (dense FP16/BF16 tensor-core peak, HBM bandwidth, capacity):
  V100-SXM2-32GB  125 TFLOP/s   900 GB/s   32 GiB   (NVIDIA V100 datasheet)
  A100-SXM4-80GB  312 TFLOP/s  2039 GB/s   80 GiB   (NVIDIA A100 datasheet)
  H100-SXM5-80GB  989 TFLOP/s  3350 GB/s   80 GiB   (NVIDIA H100 datasheet, dense BF16)
Models (parameters, layers, hidden size, KV heads x head dim), FP16 weights and KV:
  OPT-13B     12.9e9 params, 40 layers, d=5120, 40 KV heads x 128 -> KV 819,200 B/token
  Llama-2-7B   6.74e9 params, 32 layers, d=4096, 32 KV heads x 128 -> KV 524,288 B/token
  Llama-3-8B   8.03e9 params, 32 layers, d=4096,  8 KV heads x 128 -> KV 131,072 B/token
  (KV bytes/token = 2 (K and V) * layers * kv_heads * head_dim * 2 bytes)
Assumed efficiencies: 60% of peak FLOP/s (MFU) for the linear layers, 80% of peak bandwidth,
3 ms fixed per-iteration overhead (launches, sampling, host work).

Linear model (a sum, which over-estimates near the knee where real time is a max):
  c0        = overhead + weight_bytes / (0.8 * bandwidth)     weights stream once per iteration
  c_prefill = c_decode = 2 * params / (0.6 * peak)            matmul FLOPs per token
  c_context = kv_bytes_per_token / (0.8 * bandwidth)          KV read per token of context
Pools: 90% of device memory minus weights minus 1 GiB activations, in 16-token blocks;
32 GiB of host swap space.
"""

from __future__ import annotations

from typing import Any

GIB = 1024**3
GPUS = {  # name: (peak FLOP/s, bandwidth B/s, memory bytes)
    "v100-32g": (125e12, 900e9, 32 * GIB),
    "a100-80g": (312e12, 2039e9, 80 * GIB),
    "h100-80g": (989e12, 3350e9, 80 * GIB),
}
MODELS = {  # name: (params, layers, kv_heads, head_dim)
    "opt-13b": (12.9e9, 40, 40, 128),
    "llama-2-7b": (6.74e9, 32, 32, 128),
    "llama-3-8b": (8.03e9, 32, 8, 128),
}
PROFILES = ("v100-32g/opt-13b", "a100-80g/llama-2-7b", "h100-80g/llama-3-8b")
MFU, MBU, OVERHEAD_S = 0.6, 0.8, 0.003
BLOCK_SIZE, GPU_MEM_UTIL, ACTIVATION_BYTES, HOST_SWAP_BYTES = 16, 0.9, 1 * GIB, 32 * GIB


def roofline_profile(name: str) -> dict[str, Any]:
    """Profile JSON (same schema as `alise executor profile`) for 'gpu/model'."""
    try:
        gpu, model = name.lower().split("/")
        peak, bw, mem = GPUS[gpu]
        params, layers, kv_heads, head_dim = MODELS[model]
    except (ValueError, KeyError):
        raise ValueError(
            f"unknown roofline profile {name!r}; known: {list(PROFILES)} "
            f"(any of GPUs {sorted(GPUS)} with models {sorted(MODELS)})"
        ) from None
    weight_bytes = 2 * params
    kv_bytes = 2 * layers * kv_heads * head_dim * 2
    c0 = OVERHEAD_S + weight_bytes / (MBU * bw)
    c_tok = 2 * params / (MFU * peak)
    c_ctx = kv_bytes / (MBU * bw)
    free = GPU_MEM_UTIL * mem - weight_bytes - ACTIVATION_BYTES
    if free <= 0:
        raise ValueError(f"{model} does not fit on {gpu}")
    pivot = max(1, round((c0 - OVERHEAD_S) / c_tok))
    return {
        "device": gpu,
        "model": model,
        "source": "roofline",
        "coefficients": {"c0": c0, "c_prefill": c_tok, "c_decode": c_tok, "c_context": c_ctx},
        "pivot_tokens": pivot,
        "pivot_time_s": c0 + (c_tok + c_ctx) * pivot,
        "fit_error": None,
        "samples": [],
        "block_size": BLOCK_SIZE,
        "num_device_blocks": int(free // (BLOCK_SIZE * kv_bytes)),
        "num_host_blocks": int(HOST_SWAP_BYTES // (BLOCK_SIZE * kv_bytes)),
        "kv_bytes_per_token": kv_bytes,
        "weight_bytes": weight_bytes,
        "peak_flops": peak,
        "bandwidth_bytes_s": bw,
    }
