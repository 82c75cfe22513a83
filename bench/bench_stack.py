"""`alise bench stack`: the served stack against its engine alone, at saturation, in one run.

For each CPU configuration (the launcher's plan by default, and the ones it replaced):
- engine alone: the executor's Engine with the configuration's threads runs every request of
  the trace at once through the minimal continuous-batching driver (lab/executor/driver.py),
  with the same chat template, `max_tokens` cap, EOS and temperature the stack gets; and again
  at the token budget and batch the policy's defaults serve with (hybrid's job limit from the
  step-time curve: the stack's overhead at its own concurrency);
- stack: `alise serve` with the configuration's variables, the same trace sent by the
  project's streaming client at a rate above capacity (Poisson arrivals);
reporting output tokens/s of both and their ratio, the stack's P99 TBT, mean normalized
latency, and each service's CPU seconds (per output token) while the trace ran: where the
stack's CPU goes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.bench_serve import LiveStack, run_point, trace_for
from bench.cli import command_line

# the configurations compared: environment of `alise serve` (and the engine's threads)
CONFIGS: dict[str, dict[str, str]] = {
    "plan": {},  # the launcher's CPU plan (services/launcher/cpu_plan.py)
    "one_thread": {"ALISE_NUM_THREADS": "1", "ALISE_CONTROL_NICE": "0"},  # before the plan
    "all_cores_spinning": {"ALISE_CONTROL_NICE": "0", "OMP_WAIT_POLICY": "ACTIVE"},
    "all_cores_passive": {"ALISE_CONTROL_NICE": "0", "OMP_WAIT_POLICY": "PASSIVE"},
}


ENGINE_ARGS = ("temperature", "max_tokens", "token_budget", "max_batch")


def engine_alone(args: argparse.Namespace, items, threads: int) -> dict:
    """The trace's requests all at once through the engine: output tokens per second."""
    import torch

    from lab.executor.driver import Driver
    from services.common.models import load_tokenizer, weights_dir
    from services.common.sampling import SamplingParams
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    settings = ExecutorSettings()
    torch.set_num_threads(threads)
    engine = Engine(
        weights_dir(settings.model, settings.data_dir),
        device="cpu",
        dtype=settings.dtype,
        kv_memory_gb=settings.kv_memory_gb,
        num_host_blocks=1,
        quantization=settings.quantization,
    )
    tok = load_tokenizer(settings.model, settings.data_dir)
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": i.prompt}],
                                     add_generation_prompt=True, return_dict=False))
        for i in items
    ]  # fmt: skip
    sampling = SamplingParams(temperature=args.temperature)
    start = time.perf_counter()
    seqs = Driver(engine, args.token_budget, args.max_batch).generate(
        prompts, args.max_tokens, sampling, engine.spec.eos_token_ids
    )
    wall = time.perf_counter() - start
    tokens = sum(len(s.output) for s in seqs)
    return {
        "threads": threads,
        "weights": engine.weight_format,
        "output_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 1),
    }


def policy_shape(policy: str, max_batch: int) -> tuple[int, int] | None:
    """(token budget, batch) the policy's defaults serve with on the served CPU profile (its
    step-time-curve budget; its job limit, else `max_batch`), for an engine-alone run in the
    stack's own step shape (None: a policy whose defaults set neither)."""
    if policy != "hybrid":
        return None
    from bench.live_ceiling import served_profile
    from services.scheduler.core.cost_model import CostModel
    from services.scheduler.core.policies.hybrid import HybridKnobs, curve_defaults

    budget, limit = curve_defaults(HybridKnobs(), CostModel.from_profile(served_profile()))
    return budget, limit or max_batch


def _service_of(cmdline: list[str]) -> str | None:
    if "services" in cmdline:
        rest = cmdline[cmdline.index("services") + 1 :]
        return rest[0] if rest else None
    return "redis" if any("redis-server" in part for part in cmdline) else None


def service_cpu(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each service under the launcher `root_pid`."""
    import psutil

    from bench.bench_peer import descendants

    totals: dict[str, float] = {}
    for proc in descendants(root_pid):
        try:
            name = _service_of(proc.cmdline())
            if name is None or name == "serve":
                continue
            t = proc.cpu_times()
            totals[name] = totals.get(name, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return totals


def stack_point(args: argparse.Namespace, items, name: str, env: dict[str, str]) -> dict:
    """`alise serve` under `env`, the trace replayed, the stack's CPU per service."""
    log_dir = Path(tempfile.mkdtemp(prefix="alise-bench-stack-"))
    stack = LiveStack(args.policy, log_dir, name=name, env=env)
    try:
        stack.wait_ready()
        before = service_cpu(stack.proc.pid)
        summary = run_point(stack.url, items, False, None, temperature=args.temperature)
        after = service_cpu(stack.proc.pid)
    finally:
        stack.stop()
    tokens = max(1, round(summary["throughput_tok_s"] * summary["duration_s"]))
    cpu = {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}
    return {
        "throughput_tok_s": round(summary["throughput_tok_s"], 1),
        "p99_tbt_s": round(summary["p99_tbt"], 4),
        "mean_normalized_latency": round(summary["mean_normalized_latency"], 4),
        "median_ttft_s": round(summary["median_ttft"], 3),
        "num_errors": summary["num_errors"],
        "duration_s": round(summary["duration_s"], 1),
        "cpu_s": cpu,
        "cpu_ms_per_token": {k: round(1e3 * v / tokens, 2) for k, v in cpu.items()},
    }


def engine_in_child(args: argparse.Namespace, items, env: dict[str, str]) -> dict:
    """engine_alone in a fresh process with the executor's environment under `env` (OpenMP
    reads its wait policy once, at start), as the launcher would start the executor."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from services.launcher import cpu_plan

    plan = cpu_plan.plan(1, int(env.get("ALISE_NUM_THREADS", "0")), 0)
    child_env = {**plan.executor_env({**os.environ, **env}), **env}
    saved = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)
    try:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            picklable = argparse.Namespace(**{k: getattr(args, k) for k in ENGINE_ARGS})
            return pool.submit(engine_alone, picklable, items, plan.executor_threads).result()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(args: argparse.Namespace) -> int:
    items = trace_for(args, args.request_rate)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    shape = policy_shape(args.policy, args.max_batch)
    rows = []
    for name in names:
        env = {**CONFIGS[name]}
        print(f"{name}: engine alone", flush=True)
        engine = engine_in_child(args, items, env)
        row = {"config": name, "env": env, "engine": engine}
        if shape is not None:  # the engine at the concurrency the policy serves with
            print(f"{name}: engine alone, budget {shape[0]}, batch {shape[1]}", flush=True)
            shaped = argparse.Namespace(
                **vars(args) | dict(zip(("token_budget", "max_batch"), shape))
            )
            row["engine_at_policy_concurrency"] = engine_in_child(shaped, items, env) | {
                "token_budget": shape[0],
                "max_batch": shape[1],
            }
        print(f"{name}: stack at {args.request_rate} req/s", flush=True)
        stack = stack_point(args, items, name, env)
        row["stack"] = stack
        row["stack_over_engine"] = round(stack["throughput_tok_s"] / engine["throughput_tok_s"], 3)
        if shape is not None:
            alike = row["engine_at_policy_concurrency"]["throughput_tok_s"]
            row["stack_over_engine_at_policy_concurrency"] = round(
                stack["throughput_tok_s"] / alike, 3
            )
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": command_line("stack"),
        "cores": len(os.sched_getaffinity(0)),
        "rate": args.request_rate,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "max_tokens_mode": "fixed (EOS honoured)",
        "temperature": args.temperature,
        "policy": args.policy,
        "configs": rows,
    }
    from bench.bench_engine import _emit

    return _emit(result, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    from bench.bench_serve import _trace_args

    p = subparsers.add_parser(
        "stack", help="the served stack vs its engine alone at saturation; CPU per service"
    )
    _trace_args(p)
    p.add_argument("--request-rate", type=float, default=8.0, help="above capacity (8)")
    p.add_argument("--policy", default="hybrid")
    p.add_argument("--configs", default="plan,one_thread", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--token-budget", type=int, default=512, help="engine alone (512)")
    p.add_argument("--max-batch", type=int, default=256, help="engine alone (256)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=_run)
