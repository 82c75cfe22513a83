"""`alise bench engine`: offline throughput of our executor against transformers, in one run.

Workload: the first N ShareGPT test-split prompts (filtered as docs/workloads.md says) with
prompts of at most 512 tokens; each request generates its reference output length capped at 256, EOS
ignored; only requested tokens count. Systems, same weights and thread count:
  ours      - Engine + the minimal continuous-batching driver (lab/executor/driver.py),
              once per dtype in --dtypes (fp32, bf16); `ours_tok_s` and the ratios are fp32,
              as the baselines; `best_dtype` / `ours_best_dtype_tok_s` name the fastest
  hf_static - transformers `generate` in fp32, static batches of 32 (left padding, greedy)
  hf_cb     - transformers continuous batching in fp32 (the manager behind `generate_batch`,
              with per-request max_new_tokens)
Also, per dtype: our decode step at batch 32 with 512 tokens of context and the time of the
model's linear layers alone for those 32 tokens (a lower bound for that step); for fp32 a
decode step of 48 requests with contexts spread over 20-600 tokens, attention split by context
vs one group.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _workload(n: int, max_prompt: int, max_output: int):
    from services.common.models import load_tokenizer
    from services.common.settings import CommonSettings
    from services.predictor.sharegpt import load_split

    settings = CommonSettings()
    tok = load_tokenizer(settings.model, settings.data_dir)
    samples = [s for s in load_split("test") if s.prompt_len <= max_prompt][:n]
    prompts = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
    return [p[:max_prompt] for p in prompts], [min(s.output_len, max_output) for s in samples]


def run_ours(engine, prompts, lens, budget: int, max_batch: int) -> float:
    from lab.executor.driver import Driver

    start = time.perf_counter()
    seqs = Driver(engine, token_budget=budget, max_batch=max_batch).generate(prompts, lens)
    elapsed = time.perf_counter() - start
    assert [len(s.output) for s in seqs] == lens
    return elapsed


def structured_cost(engine, prompts, lens, schema: str, budget: int, max_batch: int) -> dict:
    """Structured decoding's cost, side by side: every request under the JSON schema (EOS
    honoured: a finished guide allows only EOS), then the same prompts unguided, each run to
    exactly the length its guided answer had (EOS ignored), so both runs decode the same
    tokens in the same batches; twice, alternating, to even out a noisy machine."""
    from lab.executor.driver import Driver
    from services.common.sampling import SamplingParams

    guided_params = SamplingParams(guide_kind="json_schema", guide_spec=schema)
    eos = engine.spec.eos_token_ids
    times: dict[str, list[float]] = {"guided": [], "unguided": []}
    lengths: list[int] = []
    for _ in range(2):
        start = time.perf_counter()
        seqs = Driver(engine, budget, max_batch).generate(prompts, lens, guided_params, eos)
        times["guided"].append(time.perf_counter() - start)
        lengths = [len(s.output) for s in seqs]
        start = time.perf_counter()
        Driver(engine, budget, max_batch).generate(prompts, lengths)
        times["unguided"].append(time.perf_counter() - start)
    tokens = sum(lengths)
    guided, unguided = min(times["guided"]), min(times["unguided"])
    return {
        "tokens": tokens,
        "guided_tok_s": tokens / guided,
        "unguided_tok_s": tokens / unguided,
        "throughput_cost": 1 - unguided / guided,
        "runs_s": times,
    }


def run_hf_static(model, tok, prompts, lens, batch: int) -> float:
    import torch

    tok.padding_side = "left"
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tok.pad({"input_ids": prompts[i : i + batch]}, return_tensors="pt")
        with torch.inference_mode():
            model.generate(
                **enc,
                max_new_tokens=max(lens[i : i + batch]),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
    return time.perf_counter() - start


def run_hf_cb(model, prompts, lens, kv_memory_gb: float, budget: int) -> float:
    """Sized like ours: the same KV memory and tokens per step (its default sizes the cache
    from free memory, which on CPU means most of the host RAM)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = model.config
    page = 256
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page_bytes = page * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    cb = ContinuousBatchingConfig(
        page_size=page,
        max_batch_tokens=budget,
        num_blocks=max(8, int(kv_memory_gb * 2**30 // page_bytes)),
    )
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(lens))
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb
    )
    start = time.perf_counter()
    manager.start()
    for i, (p, n) in enumerate(zip(prompts, lens)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
    done = 0
    while done < len(prompts):
        result = manager.get_result(timeout=5)
        if result is not None and result.is_finished():
            done += 1
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return elapsed


def decode_step_ms(engine, batch: int = 32, context: int = 512, reps: int = 5) -> float:
    from services.executor.profiler import StepTimer

    with engine.exclusive():
        return 1e3 * StepTimer(engine).time(0, batch, context, reps)["time_s"]


def mixed_context_decode_ms(engine, batch: int = 48, reps: int = 5, seed: int = 0) -> dict:
    """A decode step of `batch` requests whose contexts are spread over 20-600 tokens (as live
    traffic), attention split into groups of similar context vs one padded group."""
    import random

    from services.executor.profiler import StepTimer

    rng = random.Random(seed)
    contexts = [rng.randint(20, 600) for _ in range(batch)]
    keep = engine.attention_group_cost

    def use(cost):
        return lambda e: setattr(e, "attention_group_cost", cost)

    try:
        with engine.exclusive():
            variants = {"split": use(keep), "one_group": use(None)}
            t = StepTimer(engine).time_decodes(contexts, variants, reps)
    finally:
        engine.attention_group_cost = keep
    return {
        "batch": batch,
        "context_tokens": sum(contexts),
        "max_context": max(contexts),
        "split_ms": 1e3 * t["split"],
        "one_group_ms": 1e3 * t["one_group"],
        "speedup": t["one_group"] / t["split"],
    }


def linear_only_ms(engine, tokens: int = 32, reps: int = 5) -> float:
    """Every weight matmul of one forward pass over `tokens` rows, plus the LM head."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    weights = [
        w
        for layer in engine.runner.layers
        for f in dataclasses.fields(layer)
        if (w := getattr(layer, f.name)) is not None and w.dim() == 2
    ]
    weights.append(engine.runner.lm_head)
    inputs = [torch.randn(tokens, w.shape[1], dtype=w.dtype) for w in weights]
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            start = time.perf_counter()
            for x, w in zip(inputs, weights):
                F.linear(x, w)
            times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[1:])[len(times[1:]) // 2]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _engine(model_dir, args: argparse.Namespace, dtype: str, attention_backend: str = "auto"):
    from services.executor.engine import Engine

    return Engine(
        model_dir,
        device="cpu",
        dtype=dtype,
        kv_dtype=args.kv_dtype,
        kv_memory_gb=args.kv_memory_gb,
        num_host_blocks=1,
        attention_backend=attention_backend,
    )


def run_ours_in(model_dir, args: argparse.Namespace, dtype: str, prompts, lens) -> dict:
    """Our throughput and decode-step figures with the model in `dtype` (one engine at a
    time: each holds its own KV pool)."""
    engine = _engine(model_dir, args, dtype)
    elapsed = run_ours(engine, prompts, lens, args.token_budget, args.max_batch)
    _progress(f"ours {dtype}: {elapsed:.1f} s")
    step, linear = decode_step_ms(engine), linear_only_ms(engine)
    out = {
        "tok_s": sum(lens) / elapsed,
        "elapsed_s": elapsed,
        "decode_step_ms_b32": step,
        "linear_only_ms_b32": linear,
        "step_over_linear": step / linear,
    }
    if dtype == "fp32" and engine.attn.split_decodes:  # the torch path splits decode groups
        out["mixed_context_decode"] = mixed_context_decode_ms(engine)
    engine.close()
    return out


def compare_dtypes(model_dir, args: argparse.Namespace, prompts, lens) -> dict:
    """Ours in each candidate dtype (fp32 first: the baselines run in fp32); the fp32 figures
    keep their old top-level keys, the best dtype is named with its throughput."""
    by_dtype = {d: run_ours_in(model_dir, args, d, prompts, lens) for d in args.dtypes}
    best = max(by_dtype, key=lambda d: by_dtype[d]["tok_s"])
    base = by_dtype.get("fp32", by_dtype[best])
    result = {
        "ours_tok_s": base["tok_s"],
        "best_dtype": best,
        "ours_best_dtype_tok_s": by_dtype[best]["tok_s"],
        "best_dtype_speedup_vs_fp32": by_dtype[best]["tok_s"] / base["tok_s"],
        "decode_step_ms_b32": base["decode_step_ms_b32"],
        "linear_only_ms_b32": base["linear_only_ms_b32"],
        "ours_by_dtype": by_dtype,
    }
    if "mixed_context_decode" in base:
        result["mixed_context_decode"] = base["mixed_context_decode"]
    return result


def _run(args: argparse.Namespace) -> int:
    if args.device == "cuda" or args.against:
        from bench.bench_engine_gpu import run_gpu

        return run_gpu(args)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.models import weights_dir
    from services.common.settings import ExecutorSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    settings = ExecutorSettings()
    model_dir = weights_dir(settings.model, settings.data_dir)
    prompts, lens = _workload(args.num_prompts, args.max_prompt, args.max_output)
    tokens = sum(lens)
    result = {
        "num_prompts": len(prompts),
        "requested_tokens": tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "threads": torch.get_num_threads(),
        "kv_dtype": args.kv_dtype,
        "token_budget": args.token_budget,
        "max_batch": args.max_batch,
        "dtypes": args.dtypes,
    }
    if args.json_schema:
        engine = _engine(model_dir, args, args.dtypes[0])
        schema = open(args.json_schema).read()
        result["structured"] = structured_cost(
            engine, prompts, lens, schema, args.token_budget, args.max_batch
        )
        return _emit(result, args.json)
    result.update(compare_dtypes(model_dir, args, prompts, lens))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    t_static = run_hf_static(hf, tok, prompts, lens, args.hf_batch)
    _progress(f"hf static: {t_static:.1f} s")
    t_cb = run_hf_cb(hf, prompts, lens, args.kv_memory_gb, args.token_budget)
    _progress(f"hf cb: {t_cb:.1f} s")
    t_ours = tokens / result["ours_tok_s"]
    t_best = tokens / result["ours_best_dtype_tok_s"]
    result.update(
        hf_static_tok_s=tokens / t_static,
        hf_cb_tok_s=tokens / t_cb,
        ratio_vs_hf_static=t_static / t_ours,
        ratio_vs_hf_cb=t_cb / t_ours,
        best_dtype_ratio_vs_hf_static=t_static / t_best,
        best_dtype_ratio_vs_hf_cb=t_cb / t_best,
    )
    return _emit(result, args.json)


def _emit(result: dict, path: str | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("engine", help="executor throughput vs transformers (static, CB)")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--num-prompts", type=int, default=128, help="ShareGPT prompts (128)")
    p.add_argument("--max-prompt", type=int, default=512, help="longest prompt kept (512)")
    p.add_argument("--max-output", type=int, default=256, help="output length cap (256)")
    p.add_argument("--hf-batch", type=int, default=32, help="static batch size for HF (32)")
    p.add_argument("--token-budget", type=int, default=512, help="our tokens per step (512)")
    p.add_argument("--max-batch", type=int, default=64, help="our concurrent requests (64)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--kv-memory-gb", type=float, default=2.0, help="our KV pool (2 GiB)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="our model dtypes to run, comma-separated (fp32,bf16); the first also serves "
        "--json-schema",
    )
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="instead: structured decoding's cost, every request under this JSON schema vs none",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: GPU bench")
    p.add_argument(
        "--model", help="GPU bench: a model directory or shape preset (default ALISE_MODEL)"
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="GPU bench: dummy = random weights of the model's shapes",
    )
    p.add_argument("--against", choices=["vllm"], help="GPU bench: also run vLLM")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU bench (0.9)")
    p.set_defaults(func=_run)
