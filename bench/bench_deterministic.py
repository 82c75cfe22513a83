"""`alise bench deterministic`: what deterministic mode (ALISE_DETERMINISTIC) costs.

Two engines of the same model and dtype, deterministic off and on, time the same steps side
by side, interleaved round by round so the machine's drift hits both alike: decode steps at
several batch sizes (each request at `--context` tokens of KV) and one prefill of
`--prefill` tokens. Each figure is the median over rounds of the step's median over its
repetitions (profiler.StepTimer); throughput is tokens computed per second of step time.
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench.bench_engine import _emit

MODES = {"default": False, "deterministic": True}


def _engines(args: argparse.Namespace) -> dict:
    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings
    from services.executor.cuda_runtime import RuntimeOptions
    from services.executor.engine import Engine

    settings = ExecutorSettings()
    model_dir = weights_dir(args.model or settings.model, settings.data_dir)
    largest = max(b for _, _, b in _shapes(args))
    runtime = RuntimeOptions(  # CUDA: graphs and kernels warmed for these steps only
        max_num_batched_tokens=max(args.prefill, largest),
        max_num_seqs=largest,
        graph_max_batch=largest,
    )
    engines = {
        name: Engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_memory_gb=args.kv_memory_gb,
            num_host_blocks=1,
            deterministic=on,
            load_format=args.load_format,
            runtime=runtime,
        )
        for name, on in MODES.items()
    }
    for engine in engines.values():
        if engine.device.type == "cuda":  # graphs captured, kernels compiled, as served
            engine.warm_up()
    return engines


def _shapes(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(label, prefill tokens, decodes) of each timed step."""
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    return [(f"decode_b{b}", 0, b) for b in batches] + [
        (f"prefill_{args.prefill}", args.prefill, 0)
    ]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from services.executor.profiler import StepTimer

    torch.set_num_threads(args.threads)
    engines = _engines(args)
    shapes = _shapes(args)
    times: dict[tuple[str, str], list[float]] = {(m, s[0]): [] for m in MODES for s in shapes}
    for _ in range(args.rounds):
        for label, prefill, decodes in shapes:
            for mode, engine in engines.items():
                with engine.exclusive():
                    t = StepTimer(engine).time(prefill, decodes, args.context, args.reps)
                times[(mode, label)].append(t["time_s"])
    rows = []
    for label, prefill, decodes in shapes:
        tokens = prefill + decodes
        med = {m: statistics.median(times[(m, label)]) for m in MODES}
        rows.append(
            {
                "step": label,
                "tokens": tokens,
                **{f"{m}_ms": round(1e3 * med[m], 2) for m in MODES},
                **{f"{m}_tok_s": round(tokens / med[m], 1) for m in MODES},
                "slowdown": round(med["deterministic"] / med["default"], 3),
            }
        )
    engine = engines["default"]
    return {
        "model": engine.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": _device_name(engine.device),
        "attention_backend": engine.attn.name,
        "threads": args.threads,
        "context": args.context,
        "rounds": args.rounds,
        "reps": args.reps,
        "cpu_count": os.cpu_count(),
        "steps": rows,
    }


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _run(args: argparse.Namespace) -> int:
    result = measure(args)
    result["note"] = args.note
    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "deterministic", help="decode and prefill throughput, deterministic mode off vs on"
    )
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--model", default="", help="served model (default: ALISE_MODEL's)")
    p.add_argument("--dtype", default="bf16", help="model dtype (bf16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    p.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes (1,16,64)")
    p.add_argument("--context", type=int, default=256, help="KV tokens per decode (256)")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (512)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per round (5)")
    p.add_argument("--kv-memory-gb", type=float, default=0.5, help="KV pool per engine (0.5)")
    p.add_argument("--note", default="", help="free text stored with the figures")
    p.set_defaults(func=_run)
