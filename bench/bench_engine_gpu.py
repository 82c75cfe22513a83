"""`alise bench engine --device cuda [--model PATH] [--against vllm]`: the executor on a GPU.

Workload as the CPU benchmark (bench_engine.py): the first N ShareGPT test-split prompts of at
most `--max-prompt` tokens, each generating its reference output length capped at
`--max-output`, EOS ignored, tokenized with the model's own tokenizer. Figures:

  ours_tok_s          offline throughput of Engine (bf16, KV pool from
                      --gpu-memory-utilization, warmed up: Triton compiled, CUDA graphs
                      captured) + the continuous-batching driver, requested tokens only
  decode_step_ms      one decode step of B requests at 512 tokens of context, B = 1, 32, 256
                      (StepTimer: the engine alone, no scheduler)
  decode_per_token_ms 32 prompts of 512 tokens generating 65 tokens minus generating 1, per
                      generated position: the figure vLLM is measured with too
  vllm_*              with --against vllm (when vllm is importable): the same prompts and
                      lengths through vllm.LLM.generate (greedy, ignore_eos, the same token
                      budget, batch size and memory fraction), in a subprocess so the two
                      never share the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DIFF_PROMPTS, DIFF_LEN, DIFF_TOKENS = 32, 512, 65


def gpu_workload(model_dir: Path, n: int, max_prompt: int, max_output: int) -> tuple[list, list]:
    from transformers import AutoTokenizer

    from services.predictor.sharegpt import load_split

    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = [s for s in load_split("test") if s.prompt_len <= max_prompt][:n]
    prompts = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
    return [p[:max_prompt] for p in prompts], [min(s.output_len, max_output) for s in samples]


def diff_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(DIFF_LEN)] for _ in range(DIFF_PROMPTS)]


def build_engine(model_dir: Path, args: argparse.Namespace) -> tuple[Any, dict]:
    """A warmed-up bf16 CUDA engine and its warm-up report."""
    from services.executor.cuda_runtime import RuntimeOptions
    from services.executor.engine import Engine

    engine = Engine(
        model_dir,
        device="cuda",
        dtype="bf16",
        kv_dtype=args.kv_dtype,
        num_host_blocks=1,
        load_format=args.load_format,
        runtime=RuntimeOptions(
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=max(args.token_budget, DIFF_LEN),
            max_num_seqs=args.max_batch,
        ),
    )
    return engine, engine.warm_up()


def run_ours(engine: Any, prompts: list, lens: list, budget: int, max_batch: int) -> float:
    from lab.executor.driver import Driver

    start = time.perf_counter()
    seqs = Driver(engine, token_budget=budget, max_batch=max_batch).generate(prompts, lens)
    elapsed = time.perf_counter() - start
    assert [len(s.output) for s in seqs] == lens
    return elapsed


def decode_step_ms(engine: Any, batch: int, context: int, reps: int = 5) -> float:
    from services.executor.profiler import StepTimer

    with engine.exclusive():
        return 1e3 * StepTimer(engine).time(0, batch, context, reps)["time_s"]


def run_ours_gpu(engine: Any, prompts: list, lens: list, args: argparse.Namespace) -> dict:
    elapsed = run_ours(engine, prompts, lens, args.token_budget, args.max_batch)
    steps = {
        b: decode_step_ms(engine, b, 512)
        for b in (1, 32, 256)
        if b <= engine.num_device_blocks // 33 and b <= args.max_batch
    }
    diff = diff_prompts(engine.spec.vocab_size)
    t1 = run_ours(engine, diff, [1] * DIFF_PROMPTS, args.token_budget, args.max_batch)
    t65 = run_ours(engine, diff, [DIFF_TOKENS] * DIFF_PROMPTS, args.token_budget, args.max_batch)
    return {
        "ours_s": elapsed,
        "ours_tok_s": sum(lens) / elapsed,
        "decode_step_ms": steps,
        "decode_per_token_ms": 1e3 * (t65 - t1) / (DIFF_TOKENS - 1),
        "num_device_blocks": engine.num_device_blocks,
        "gpu_memory": engine.describe()["gpu_memory"],
    }


def vllm_run(job: dict) -> dict:
    """In the vLLM subprocess: offline throughput and the decode figure."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype="bfloat16",
        gpu_memory_utilization=job["gpu_memory_utilization"],
        max_num_batched_tokens=job["token_budget"],
        max_num_seqs=job["max_batch"],
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts: list, lens: list) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == lens
        return elapsed

    generate(job["prompts"][:8], [8] * min(8, len(job["prompts"])))  # warm-up
    elapsed = generate(job["prompts"], job["lens"])
    t1 = generate(job["diff"], [1] * DIFF_PROMPTS)
    t65 = generate(job["diff"], [DIFF_TOKENS] * DIFF_PROMPTS)
    return {
        "vllm_s": elapsed,
        "vllm_tok_s": sum(job["lens"]) / elapsed,
        "vllm_decode_per_token_ms": 1e3 * (t65 - t1) / (DIFF_TOKENS - 1),
    }


def run_vllm(
    model_dir: Path, prompts: list, lens: list, diff: list, args: argparse.Namespace
) -> dict:
    job = {
        "model": str(model_dir),
        "prompts": prompts,
        "lens": lens,
        "diff": diff,
        "token_budget": max(args.token_budget, DIFF_LEN),
        "max_batch": args.max_batch,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    code = (
        "import json, sys; from bench.bench_engine_gpu import vllm_run; "
        f"print(json.dumps(vllm_run(json.load(open({f.name!r})))))"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm run failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_gpu(args: argparse.Namespace) -> int:
    """The GPU benchmark (`alise bench engine --device cuda`, `--against vllm`)."""
    import importlib.util

    import torch

    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings

    if not torch.cuda.is_available():
        raise SystemExit("alise bench engine --device cuda needs a CUDA GPU")
    if args.against == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SystemExit("--against vllm needs vllm installed (pip install vllm)")
    settings = ExecutorSettings()
    model_dir = weights_dir(args.model or settings.model, settings.data_dir)
    prompts, lens = gpu_workload(model_dir, args.num_prompts, args.max_prompt, args.max_output)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "model": str(model_dir),
        "load_format": args.load_format,
        "num_prompts": len(prompts),
        "requested_tokens": sum(lens),
        "prompt_tokens": sum(map(len, prompts)),
        "kv_dtype": args.kv_dtype,
        "token_budget": args.token_budget,
        "max_batch": args.max_batch,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    engine, result["warmup"] = build_engine(model_dir, args)
    result.update(run_ours_gpu(engine, prompts, lens, args))
    print(f"ours: {result['ours_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    diff = diff_prompts(engine.spec.vocab_size)
    engine.close()
    del engine
    torch.cuda.empty_cache()
    if args.against == "vllm":
        result.update(run_vllm(model_dir, prompts, lens, diff, args))
        result["ratio_vs_vllm"] = result["ours_tok_s"] / result["vllm_tok_s"]
        print(f"vllm: {result['vllm_tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """No subcommand of its own: `alise bench engine --device cuda` (bench_engine.py) runs
    this module (bench/cli.py calls `register` on every bench_* module)."""
