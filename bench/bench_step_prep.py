"""`alise bench step-prep`: the host-side preparation of a decode step on the CUDA path, timed
on this CPU (no GPU needed): what DeviceRuntime.stage_replay does before a CUDA-graph replay of
B decodes (order, pad to the bucket, plan the attention tiles, fill the packed int32 metadata
and issue its copy), for B = 1, 32, 256 decodes at 512 tokens of context (Llama-3-8B's heads,
block size 16, a 8,192-token table width). The device is the CPU here, so the metadata copy is
a real memcpy, on one thread (on CUDA it is an asynchronous copy from pinned memory; torch's
multi-threaded CPU copy stalls on a busy machine).

Figures: median and p90 ms over --reps preparations after a warm-up, per B; `b256_ms` is the
median at B = 256.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.bench_engine import _emit

CONTEXT, BLOCK, MAX_LEN = 512, 16, 8192


def _runtime(bucket: int) -> Any:
    """A DeviceRuntime on the CPU with its graph buffers (the Triton backend object only
    plans here: nothing is launched)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # TritonAttention on CPU tensors
    import torch

    torch.set_num_threads(1)
    from services.executor.cuda_runtime import DeviceRuntime
    from services.executor.kv_cache import PagedKV
    from services.executor.step_buffers import StepBuffers
    from services.executor.triton_attention import TritonAttention

    cpu = torch.device("cpu")
    cache = PagedKV(1, 4, BLOCK, 8, 128, torch.bfloat16, cpu)
    attn = TritonAttention(32, 8, 128, 128**-0.5, cpu)
    rt = DeviceRuntime(None, cache, attn, BLOCK, MAX_LEN, bucket, True, 0)  # type: ignore[arg-type]
    layout = rt._graph_layout(bucket)
    rt.graph_buffers = StepBuffers(layout.size, cpu, pin=False, growable=False)
    return rt


def _decodes(n: int) -> list:
    """n decodes as the engine hands them over (Engine._runs: each table with its int64 array,
    converted when the table last changed, not per step)."""
    import numpy as np

    from services.common.arith import ceil_div
    from services.executor.ragged_batch import TokenRun

    blocks = ceil_div(CONTEXT + 8, BLOCK)
    runs = []
    for i in range(n):
        table = list(range(i * blocks, (i + 1) * blocks))
        arr = np.asarray(table, dtype=np.int64)
        runs.append(TokenRun(f"r{i}", [100 + i], CONTEXT - 1, table, -1, True, arr))
    return runs


def time_prep(batch: int, reps: int) -> dict[str, float]:
    from services.executor.step_buffers import order_runs

    rt, runs = _runtime(batch), _decodes(batch)
    times = []
    for i in range(reps + reps // 5):  # the first fifth warms up
        start = time.perf_counter()
        rt.stage_replay(order_runs(runs), batch)
        if i >= reps // 5:
            times.append(time.perf_counter() - start)
    times.sort()
    return {
        "median_ms": round(1e3 * statistics.median(times), 4),
        "p90_ms": round(1e3 * times[int(0.9 * len(times))], 4),
    }


def _run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"context": CONTEXT, "block_size": BLOCK, "table_width": MAX_LEN}
    result["batches"] = {b: time_prep(b, args.reps) for b in (1, 32, 256)}
    result["b256_ms"] = result["batches"][256]["median_ms"]
    result["cpu"] = os.cpu_count()
    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("step-prep", help="host-side preparation of a CUDA decode step")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--reps", type=int, default=2000, help="timed preparations per batch size")
    p.set_defaults(func=_run)
