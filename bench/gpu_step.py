"""The decode step against its floor on one GPU, in one process (part of `make gpu-check`):

    python -m bench.gpu_step MODEL_DIR [--load-format dummy] [--json FILE]

- decode_step_ms: one decode step of B requests at 512 tokens of context (StepTimer: the
  engine alone, warmed up, CUDA graphs on), B = 1, 32, 256;
- linear_ms: the same model's linear layers alone (every projection and the LM head, cuBLAS,
  replayed as one CUDA graph) at B rows: the weight-reading part of the floor;
- kv_read_ms: the step's KV bytes (B x 512 tokens, every layer, K and V) over the device's
  copy bandwidth measured here (a 4 GiB device-to-device copy, bytes read + written);
- floor_ms = linear_ms + kv_read_ms; ratio = decode_step_ms / floor_ms;
- decode_step_ms_no_graph_splits: the same steps with small decode batches not split by their
  graph bucket (TritonAttention.bucket_split_len None); ..._unfused: also without the fused
  kernels (triton_fused.py): the configuration before both;
- profile: one step's device time per kernel family (gemm, attention, norm, rope, activation,
  copy, other elementwise, sampling) at B = 1 and 256 from torch's profiler, and what was
  outside any kernel (step time minus the kernels' sum).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

BATCHES = (1, 32, 256)
CONTEXT = 512
FAMILIES = (  # first match wins; names as the profiler reports kernels
    ("gemm", ("gemm", "nvjet", "cutlass", "splitk", "sm90_xmma", "cublas")),
    ("attention", ("paged_attention", "reduce_splits")),
    ("kv_write", ("write_kv", "quantize_blocks", "rope_kv")),
    ("norm", ("norm",)),
    ("activation", ("silu", "act_mul")),
    ("sampling", ("softmax", "sort", "topk", "argmax", "max_kernel", "scatter", "multinomial")),
    ("copy", ("copy", "cat", "index", "flip", "fill")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other_elementwise"


def build(model_dir: Path, load_format: str) -> Any:
    from services.executor.cuda_runtime import RuntimeOptions
    from services.executor.engine import Engine

    options = RuntimeOptions(
        gpu_memory_utilization=0.8, max_num_batched_tokens=512, max_num_seqs=256
    )
    engine = Engine(
        model_dir, device="cuda", dtype="bf16", num_host_blocks=1, runtime=options,
        load_format=load_format,
    )  # fmt: skip
    engine.warm_up()
    return engine


def step_ms(engine: Any, batch: int, reps: int = 7) -> float:
    from services.executor.profiler import StepTimer

    with engine.exclusive():
        return 1e3 * StepTimer(engine).time(0, batch, CONTEXT, reps)["time_s"]


def profile_step(engine: Any, batch: int) -> dict[str, float]:
    """Device ms per step by kernel family (5 timed steps + 1 warm-up step profiled)."""
    from torch.profiler import ProfilerActivity, profile

    from services.executor.profiler import StepTimer

    reps = 5
    with engine.exclusive(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        StepTimer(engine).time(0, batch, CONTEXT, reps)
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) / 1e3 / (reps + 1)
        if t > 0:
            out[family(e.key)] = out.get(family(e.key), 0.0) + t
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def linear_ms(spec: Any, batch: int) -> float:
    """Every projection of every layer and the LM head at `batch` rows, one CUDA graph."""
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.kv_size
    shapes = [(h, spec.q_size + 2 * kv), (spec.q_size, h), (h, 2 * i), (i, h)]
    dev, bf16 = "cuda", torch.bfloat16
    sets = [[torch.randn(n, k, device=dev, dtype=bf16) for k, n in shapes] for _ in range(4)]
    head = torch.randn(spec.vocab_size, h, device=dev, dtype=bf16)
    xs = {k: torch.randn(batch, k, device=dev, dtype=bf16) for k, _ in shapes}

    def body() -> None:
        for layer in range(spec.num_layers):  # 4 weight sets in turn: more than the L2 holds
            for (k, _), w in zip(shapes, sets[layer % 4], strict=True):
                torch.nn.functional.linear(xs[k], w)
        torch.nn.functional.linear(xs[h], head)

    return _graph_ms(body)


def _graph_ms(body: Any, reps: int = 10) -> float:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth() -> float:
    """Bytes per ms of a 4 GiB device-to-device copy (read + written), median of 10."""
    n = 1 << 31  # bf16 elements: 4 GiB
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    del a, b
    return 2 * n * 2 / sorted(times[2:])[len(times[2:]) // 2]


def routed_weight_bytes(spec: Any, params: dict[str, Any], batch: int) -> float:
    """Weight bytes a decode step of `batch` tokens reads for a mixture of experts or an FP8
    checkpoint: the dense part once, the experts the batch is routed to (Experts.read), at
    the bytes per parameter of the weights as stored."""
    from services.executor.profiler import experts_of

    experts = experts_of(spec)
    size = params["bytes_per_param"]
    if experts is None:
        return params["total"] * size
    per_expert = (params["total"] - params["active_per_token"]) / (
        experts.layers * (experts.num_experts - experts.top_k)
    )
    dense = params["active_per_token"] - experts.layers * experts.top_k * per_expert
    return (dense + per_expert * experts.read(batch)) * size


def kv_bytes(spec: Any, batch: int) -> int:
    return spec.num_layers * 2 * spec.kv_size * 2 * CONTEXT * batch  # bf16 K and V


def steps_after(engine: Any, change: Any) -> dict[int, float]:
    """The decode steps again after `change(engine)`, graphs captured anew."""
    from services.executor.cuda_graphs import DecodeGraphs

    change(engine)
    engine.runtime.graphs = DecodeGraphs(engine.runtime.graphs.buckets)
    engine.runtime.capture_graphs()
    return {b: round(step_ms(engine, b), 3) for b in BATCHES}


def no_bucket_splits(engine: Any) -> None:
    engine.attn.bucket_split_len = None


def unfused(engine: Any) -> None:
    engine.runner.fused = False


def run(model_dir: Path, load_format: str) -> dict[str, Any]:
    from services.executor.profiler import parameter_counts

    engine = build(model_dir, load_format)
    spec, params = engine.spec, parameter_counts(engine)
    routed = spec.variant.moe is not None or engine.weight_format == "fp8"
    steps = {b: round(step_ms(engine, b), 3) for b in BATCHES}
    prof = {b: profile_step(engine, b) for b in (1, 256)}
    without_splits = steps_after(engine, no_bucket_splits)
    without_both = steps_after(engine, unfused)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    bw = copy_bandwidth()
    if routed:  # experts or FP8: the weight bytes actually read, at copy bandwidth
        lin = {b: round(routed_weight_bytes(spec, params, b) / bw, 3) for b in BATCHES}
    else:
        lin = {b: round(linear_ms(spec, b), 3) for b in BATCHES}
    kv = {b: round(kv_bytes(spec, b) / bw, 3) for b in BATCHES}
    floor = {b: round(lin[b] + kv[b], 3) for b in BATCHES}
    for b in (1, 256):
        prof[b]["outside_kernels"] = round(steps[b] - sum(prof[b].values()), 3)
    return {
        "device": torch.cuda.get_device_name(),
        "model": str(model_dir),
        "context": CONTEXT,
        "decode_step_ms": steps,
        "linear_ms": lin,
        "linear_floor": "weight bytes read / copy bandwidth" if routed else "cuBLAS graph",
        "params": params,
        "kv_read_ms": kv,
        "floor_ms": floor,
        "ratio": {b: round(steps[b] / floor[b], 3) for b in BATCHES},
        "decode_step_ms_no_graph_splits": without_splits,
        "decode_step_ms_no_graph_splits_unfused": without_both,
        "copy_tb_s": round(bw / 1e9, 3),
        "profile_ms": prof,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = run(args.model_dir, args.load_format)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
