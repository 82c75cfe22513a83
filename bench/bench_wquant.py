"""`alise bench wquant`: the CPU weight formats side by side on the served model: accuracy
against the checkpoint as stored and decode/prefill step times.

Formats: `none` (the weights as stored, in the model dtype: for the bundled GGUF, dequantized),
`int8` and `auto` (what `alise serve` runs: the bundled GGUF's own 4-bit weights as INT4; see
services/executor/wquant.py). Accuracy: perplexity of a fixed 512-token ShareGPT passage fed
16 tokens a step (so the packed products compute it: wider steps use the dense copy) and greedy
agreement with `none` over 8 chat prompts x 64 tokens (lab/executor/quality.py). Speed:
each step's median time (profiler.StepTimer), the formats interleaved round by round so the
machine's drift hits all alike, at each thread count; decodes at 128 tokens of context.
"""

from __future__ import annotations

import argparse
import statistics

FORMATS = ("none", "int8", "auto")


def _engines(args: argparse.Namespace) -> dict:
    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    settings = ExecutorSettings()
    model_dir = weights_dir(settings.model, settings.data_dir)
    return {
        q: Engine(model_dir, device="cpu", dtype=args.dtype, kv_memory_gb=0.5,
                  num_host_blocks=1, quantization=q)
        for q in FORMATS
    }  # fmt: skip


def accuracy(engines: dict) -> dict:
    from lab.executor.quality import ppl_and_agreement
    from services.common.models import load_tokenizer
    from services.common.settings import ExecutorSettings

    settings = ExecutorSettings()
    tok = load_tokenizer(settings.model, settings.data_dir)
    out = {}
    for q in FORMATS[1:]:
        # 16 tokens a step: the packed weights' products (wquant.PACKED_MAX_ROWS)
        base, ppl, agree = ppl_and_agreement(engines["none"], engines[q], tok, chunk=16)
        out[q] = {"ppl_none": round(base, 4), "ppl": round(ppl, 4),
                  "ppl_rel_diff": round(ppl / base - 1, 4), "greedy_agreement": round(agree, 3)}  # fmt: skip
    return out


def speed(engines: dict, args: argparse.Namespace) -> list[dict]:
    import torch

    from services.executor.profiler import StepTimer

    shapes = [(f"decode_b{b}", 0, int(b)) for b in args.batches.split(",")]
    shapes.append((f"prefill_{args.prefill}", args.prefill, 0))
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        times: dict = {(q, s[0]): [] for q in FORMATS for s in shapes}
        for _ in range(args.rounds):
            for label, prefill, decodes in shapes:
                for q, engine in engines.items():
                    with engine.exclusive():
                        t = StepTimer(engine).time(prefill, decodes, 128, args.reps)
                    times[(q, label)].append(t["time_s"])
        for label, _, _ in shapes:
            med = {q: statistics.median(times[(q, label)]) for q in FORMATS}
            rows.append({"threads": threads, "step": label,
                         **{f"{q}_ms": round(1e3 * med[q], 2) for q in FORMATS},
                         **{f"{q}_speedup": round(med["none"] / med[q], 3) for q in FORMATS[1:]}})  # fmt: skip
    return rows


def _run(args: argparse.Namespace) -> int:
    from bench.bench_engine import _emit

    engines = _engines(args)
    result = {
        "command": "alise bench wquant",
        "model": engines["none"].model_name,
        "dtype": str(engines["none"].dtype).removeprefix("torch."),
        "weights": {q: e.weight_format for q, e in engines.items()},
        "accuracy": accuracy(engines),
        "steps": speed(engines, args),
    }
    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wquant", help="CPU weight formats: accuracy and step times")
    p.add_argument("--dtype", default="auto", help="activation dtype (auto)")
    p.add_argument("--batches", default="1,4,16,64", help="decode batch sizes")
    p.add_argument("--prefill", type=int, default=256, help="prefill tokens (256)")
    p.add_argument("--threads", default="1,2", help="thread counts (1,2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run)
