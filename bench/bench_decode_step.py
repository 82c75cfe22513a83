"""`alise bench decode-step`: one decode step of 32 requests at 512 tokens of context, per
attention backend, model dtype and KV dtype, against the linear layers alone.

The backends run side by side in one process, interleaved round by round so the machine's
drift hits them alike: `torch` (the reference path: keys gathered, one matmul, values read by
`embedding_bag`) and `cpu` (the compiled kernel reading the pool in place), the kernel once
per ISA level named in `--isa` (its builds side by side: `cpu@x86-64-v3`, `cpu@x86-64-v4`).
Each figure is the median over rounds of the step's median over its repetitions
(bench_engine.decode_step_ms).
"""

from __future__ import annotations

import argparse
import statistics
from itertools import product

from bench.bench_engine import _emit, _engine, decode_step_ms, linear_only_ms


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = ExecutorSettings()
    model_dir = weights_dir(settings.model, settings.data_dir)
    backends = [
        f"cpu@{level}" if b == "cpu" and level else b
        for b in _split(args.attention)
        for level in (_split(args.isa) or [""] if b == "cpu" else [""])
    ]
    configs = list(product(_split(args.dtypes), _split(args.kv_dtypes), backends))
    samples: dict[tuple[str, str, str], list[tuple[float, float]]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for dtype, kv, backend in configs:
            opts = argparse.Namespace(kv_dtype=kv, kv_memory_gb=args.kv_memory_gb)
            engine = _engine(model_dir, opts, dtype, attention_backend=_use_build(backend))
            samples[(dtype, kv, backend)].append(
                (decode_step_ms(engine, args.batch, args.context), linear_only_ms(engine))
            )
            engine.close()
    rows = []
    for (dtype, kv, backend), got in samples.items():
        step = statistics.median(s for s, _ in got)
        linear = statistics.median(x for _, x in got)
        rows.append(
            {
                "dtype": dtype,
                "kv_dtype": kv,
                "attention": backend.partition("@")[0],
                "isa": _isa(backend),
                "step_ms": step,
                "linear_only_ms": linear,
                "step_over_linear": step / linear,
            }
        )
    return {
        "batch": args.batch,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "rows": rows,
    }


def _isa(backend: str) -> str | None:
    """The kernel build a `cpu` backend ran on (None for torch)."""
    from services.executor import cpu_kernels

    if not backend.startswith("cpu"):
        return None
    return backend.partition("@")[2] or cpu_kernels.requested_level()


def _use_build(backend: str) -> str:
    """`cpu@LEVEL`: that build of the kernels in use; returns the backend's name."""
    from services.executor import cpu_kernels

    name, _, level = backend.partition("@")
    if level and not cpu_kernels.use(level):
        raise SystemExit(f"the {level} build of the CPU kernels failed")
    return name


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode-step", help="decode step vs linear layers, per backend")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--batch", type=int, default=32, help="decodes in the step (32)")
    p.add_argument("--context", type=int, default=512, help="tokens of context each (512)")
    p.add_argument("--dtypes", default="fp32,bf16", help="model dtypes (fp32,bf16)")
    p.add_argument("--kv-dtypes", default="auto,int8", help="KV dtypes (auto,int8)")
    p.add_argument("--attention", default="torch,cpu", help="attention backends (torch,cpu)")
    p.add_argument("--isa", default="", help="ISA levels of the kernel to compare (the default)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (2)")
    p.add_argument("--kv-memory-gb", type=float, default=2.0, help="KV pool per engine (2 GiB)")
    p.set_defaults(func=lambda a: _emit(measure(a), a.json))
