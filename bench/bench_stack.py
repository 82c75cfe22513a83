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

With `--device cpu|cuda` (device mode), one configuration instead: the model `--model`
(`--load-format dummy`: random weights of its shapes) on that device, the engine alone (built
as the executor builds it, warmed up, in a child process freed before the stack starts) at
the step shape the stack's scheduler serves with, then one `alise serve` replaying the trace
at each of `--rates` (the highest is the saturation point: the stack's CPU per service and
stack / engine there). The JSON file is rewritten after each phase, so a run cut short by
its caller's timeout still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
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

    from services.common.models import weights_dir
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
    figures = drive(engine, settings, items, args, args.token_budget, args.max_batch)
    return {"threads": threads, "weights": engine.weight_format, **figures}


def drive(engine, settings, items, args: argparse.Namespace, budget: int, batch: int) -> dict:
    """`items` through `engine` by the continuous-batching driver (token `budget`, `batch`
    requests at most), chat template, `max_tokens` cap, EOS and temperature as the stack
    serves them: output tokens and tokens per second."""
    from lab.executor.driver import Driver
    from services.common.models import load_tokenizer
    from services.common.sampling import SamplingParams

    tok = load_tokenizer(settings.model, settings.data_dir)
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": i.prompt}],
                                     add_generation_prompt=True, return_dict=False))
        for i in items
    ]  # fmt: skip
    sampling = SamplingParams(temperature=args.temperature)
    start = time.perf_counter()
    seqs = Driver(engine, budget, batch).generate(
        prompts, args.max_tokens, sampling, engine.spec.eos_token_ids
    )
    wall = time.perf_counter() - start
    tokens = sum(len(s.output) for s in seqs)
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
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
    cpu, per_token = cpu_figures(before, after, summary)
    return {
        "throughput_tok_s": round(summary["throughput_tok_s"], 1),
        "p99_tbt_s": round(summary["p99_tbt"], 4),
        "mean_normalized_latency": round(summary["mean_normalized_latency"], 4),
        "median_ttft_s": round(summary["median_ttft"], 3),
        "num_errors": summary["num_errors"],
        "duration_s": round(summary["duration_s"], 1),
        "cpu_s": cpu,
        "cpu_ms_per_token": per_token,
    }


def cpu_figures(
    before: dict[str, float], after: dict[str, float], summary: dict
) -> tuple[dict[str, float], dict[str, float]]:
    """Each service's CPU seconds between `before` and `after`, and per output token."""
    tokens = max(1, round((summary["throughput_tok_s"] or 0.0) * summary["duration_s"]))
    cpu = {k: round(after[k] - before.get(k, 0.0), 2) for k in sorted(after)}
    return cpu, {k: round(1e3 * v / tokens, 2) for k, v in cpu.items()}


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` on top for the block (a spawned child takes it at its start)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn(pool: ProcessPoolExecutor, env: dict[str, str], fn: Callable, *fn_args) -> Future:
    """`fn(*fn_args)` in `pool`'s fresh process, started under `env`."""
    with _environ(env):
        return pool.submit(fn, *fn_args)  # starts the worker process now, under `env`


def _die_with_parent(parent: int) -> None:
    """In a child: SIGTERM when `parent` dies, however it dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)


@contextmanager
def _child_pool() -> Iterator[ProcessPoolExecutor]:
    """A pool of one spawned process; interrupted (SIGTERM from the caller's timeout, Ctrl-C)
    or failing, its process is ended instead of waited for (it may hold the GPU the stack
    needs next)."""
    from multiprocessing import get_context

    ctx = get_context("spawn")
    with ProcessPoolExecutor(1, ctx, _die_with_parent, (os.getpid(),)) as pool:
        try:
            yield pool
        except BaseException:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            raise


def _executor_plan_env(env: dict[str, str]) -> tuple[dict[str, str], int]:
    """The environment and threads the launcher's CPU plan gives one executor under `env`."""
    from services.launcher import cpu_plan

    plan = cpu_plan.plan(1, int(env.get("ALISE_NUM_THREADS", "0")), 0)
    return {**plan.executor_env({**os.environ, **env}), **env}, plan.executor_threads


def engine_in_child(args: argparse.Namespace, items, env: dict[str, str]) -> dict:
    """engine_alone in a fresh process with the executor's environment under `env` (OpenMP
    reads its wait policy once, at start), as the launcher would start the executor."""
    child_env, threads = _executor_plan_env(env)
    picklable = argparse.Namespace(**{k: getattr(args, k) for k in ENGINE_ARGS})
    with _child_pool() as pool:
        return _spawn(pool, child_env, engine_alone, picklable, items, threads).result()


# -- device mode (--device): one model on one device, the engine alone and the stack at rates


def _plain(args: argparse.Namespace) -> argparse.Namespace:
    """The command line's plain values (what a spawned child can take)."""
    keep = (str, int, float, bool, type(None))
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if isinstance(v, keep)})


def parse_rates(text: str | None, default: float) -> list[float]:
    """`--rates` (comma-separated) in ascending order; the last is the saturation point."""
    rates = sorted({float(r) for r in (text or "").split(",") if r.strip()})
    if any(r <= 0 for r in rates):
        raise SystemExit(f"--rates {text!r}: rates must be positive")
    return rates or [default]


def parse_env(text: str | None) -> dict[str, str]:
    """`--extra-env KEY=VAL,...` -> {KEY: VAL}."""
    env = {}
    for part in (text or "").split(","):
        if part.strip():
            key, sep, value = part.strip().partition("=")
            if not sep or not key:
                raise SystemExit(f"--extra-env {part!r}: expected KEY=VALUE")
            env[key] = value
    return env


def device_envs(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """(the engine alone's environment, `alise serve`'s): the model, its load format and the
    device; the stack with one executor and the prior-only predictor, each with its own
    share of GPU memory; `--extra-env` on top of both."""
    from services.common.settings import CommonSettings

    model = args.model or CommonSettings().model
    base = {"ALISE_DEVICE": args.device, "ALISE_MODEL": model,
            "ALISE_LOAD_FORMAT": args.load_format}  # fmt: skip
    extra = parse_env(args.extra_env)
    engine, stack = dict(base), base | {"ALISE_NUM_EXECUTORS": "1", "ALISE_EMBEDDER": "none"}
    if args.device == "cuda":
        engine["ALISE_GPU_MEMORY_UTILIZATION"] = str(args.engine_gpu_memory_utilization)
        stack["ALISE_GPU_MEMORY_UTILIZATION"] = str(args.stack_gpu_memory_utilization)
    return engine | extra, stack | extra


def served_shape(args: argparse.Namespace, engine) -> tuple[int, int, str]:
    """(token budget, batch, where from) the stack's scheduler serves `engine` with: hybrid's
    defaults on the cost model the scheduler builds from what this executor describes (its
    profile, else the scheduler's defaults); other policies: --token-budget, --max-batch."""
    if args.policy != "hybrid":
        return args.token_budget, args.max_batch, "--token-budget, --max-batch"
    from services.common.pb.executor_pb2 import ExecutorInfo
    from services.scheduler.core.policies.hybrid import HybridKnobs, curve_defaults
    from services.scheduler.loop.executors import cost_model_for

    profile = engine.profile_json()
    info = ExecutorInfo(
        block_size=engine.block_size,
        num_device_blocks=engine.num_device_blocks,
        num_host_blocks=engine.num_host_blocks,
        profile_json=profile,
    )
    knobs = HybridKnobs(**json.loads(os.environ.get("ALISE_POLICY_CONFIG") or "{}"))
    budget, limit = curve_defaults(knobs, cost_model_for(info))
    source = "hybrid defaults on the " + ("executor's profile" if profile else "default costs")
    return budget, limit or knobs.max_num_seqs, source


def device_name(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


_CHILD: dict = {}  # the engine child's engine and settings, from one task to the next


def device_engine_load(args: argparse.Namespace) -> dict:
    """In a child: the executor's engine (ExecutorSettings from this environment), warmed up
    as the executor warms it, kept for device_engine_run."""
    from services.common.settings import ExecutorSettings
    from services.executor.engine import Engine

    start = time.perf_counter()
    settings = ExecutorSettings()
    engine = Engine.from_settings(settings)
    engine.warm_up()
    _CHILD.update(engine=engine, settings=settings)
    info = engine.describe()
    return {
        "device_name": device_name(engine.device.type),
        "dtype": info["dtype"],
        "weights": info["weights"],
        "num_device_blocks": info["num_device_blocks"],
        "ready_s": round(time.perf_counter() - start, 1),
    }


def device_engine_run(args: argparse.Namespace, items) -> dict:
    """In the same child, after device_engine_load: `items` at the stack's step shape."""
    engine, settings = _CHILD["engine"], _CHILD["settings"]
    budget, batch, source = served_shape(args, engine)
    figures = drive(engine, settings, items, args, budget, batch)
    shape = {"token_budget": budget, "max_batch": batch, "step_shape_from": source}
    return shape | {"num_requests": len(items)} | figures


def _progress(message: str) -> None:
    print(f"[bench stack {time.strftime('%H:%M:%S')}] {message}", flush=True)


def engine_phase(args: argparse.Namespace, rate: float, env: dict[str, str]) -> dict:
    """The engine alone in a child process (the launcher's CPU plan on a CPU; none on a GPU)
    loading while this process makes the trace (tokenized once, then cached on disk for the
    stack's rates); a failure is recorded, not raised."""
    child_env = env if args.device == "cuda" else _executor_plan_env(env)[0]
    _progress(f"engine alone on {args.device}: loading, warming up, then the trace at {rate}")
    try:
        with _child_pool() as pool:  # one process: the load, then the run
            loaded = _spawn(pool, child_env, device_engine_load, _plain(args))
            items = trace_for(args, rate)  # meanwhile
            run = pool.submit(device_engine_run, _plain(args), items)
            figures = loaded.result() | run.result()
    except Exception as exc:
        figures = {"error": f"{type(exc).__name__}: {exc}"}
        if exc.__cause__ is not None:  # the child's traceback, as text
            figures["traceback"] = str(exc.__cause__)[-3000:]
    _progress(f"engine alone: {json.dumps(figures)}")
    return figures


def point_figures(summary: dict) -> dict:
    """One rate's figures from run_point's summary."""

    def r(key: str, digits: int) -> float | None:
        return None if summary.get(key) is None else round(summary[key], digits)

    return {
        "throughput_tok_s": r("throughput_tok_s", 1),
        "num_requests": summary["num_requests"],
        "completed": summary["completed"],
        "median_ttft_s": r("median_ttft", 3),
        "p99_ttft_s": r("p99_ttft", 3),
        "mean_tbt_s": r("mean_tbt", 4),
        "p99_tbt_s": r("p99_tbt", 4),
        "mean_normalized_latency": r("mean_normalized_latency", 4),
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "duration_s": r("duration_s", 1),
        "prefix_cache_hit_rate": r("prefix_cache_hit_rate", 3),
    }


WARM_UP = (4, 16)  # requests and max_tokens each sent to the stack before the first rate


def prompt_offset(index: int, num_prompts: int) -> int:
    """Where the prompts of the `index`th rate run start in the trace: the first (the
    saturation rate) gets the engine alone's, each other rate the next ones of its own, so no
    rate finds another's prompts in the prefix cache."""
    return index * num_prompts


def warm_up_stack(args: argparse.Namespace, url: str, num_rates: int) -> dict:
    """A few short requests (prompts no rate sends) before the first rate, so the stack's
    first-request costs stay out of the saturation point."""
    start = time.perf_counter()
    few = argparse.Namespace(**vars(args) | dict(zip(("num_prompts", "max_tokens"), WARM_UP)))
    items = trace_for(few, 1000.0, num_rates * args.num_prompts)
    summary = run_point(url, items, False, None, temperature=args.temperature)
    return {"s": round(time.perf_counter() - start, 1), "num_errors": summary["num_errors"]}


def stack_at_rates(
    args: argparse.Namespace, rates: list[float], env: dict[str, str], result: dict, save
) -> None:
    """One `alise serve` under `env`, warmed up; the trace replayed at each rate in turn, the
    saturation rate (the highest) first, each point (with each service's CPU seconds while
    it ran) added to `result` and saved."""
    log_dir = Path(tempfile.mkdtemp(prefix="alise-bench-stack-"))
    start = time.perf_counter()
    _progress(f"stack: starting alise serve (logs in {log_dir})")
    # the launcher stops the stack when this process dies, even by SIGKILL (a timeout's)
    die_with_us = {"ALISE_DIE_WITH_PARENT": str(os.getpid())}
    stack = LiveStack(args.policy, log_dir, name=args.device, env=env | die_with_us)
    result["stack_logs"] = str(log_dir)
    try:
        stack.wait_ready()
        result["stack_ready_s"] = round(time.perf_counter() - start, 1)
        _progress(f"stack ready in {result['stack_ready_s']} s; warming up")
        result["stack_warm_up"] = warm_up_stack(args, stack.url, len(rates))
        save()
        for i, rate in enumerate(reversed(rates)):
            offset = prompt_offset(i, args.num_prompts)
            items = trace_for(args, rate, offset)
            _progress(f"stack at {rate} req/s: {len(items)} requests")
            before = service_cpu(stack.proc.pid)
            summary = run_point(stack.url, items, False, None, temperature=args.temperature)
            cpu, per_token = cpu_figures(before, service_cpu(stack.proc.pid), summary)
            point = {"rate": rate, "prompt_offset": offset, **point_figures(summary)}
            point |= {"service_cpu_s": cpu, "service_cpu_ms_per_token": per_token}
            result["points"].append(point)
            save()
            _progress(json.dumps(point))
    finally:
        stack.stop()


def _log_tail(log_dir: str | None, chars: int = 3000) -> dict[str, str]:
    """The end of each log of the stack's run (where a failed start says why)."""
    if not log_dir:
        return {}
    logs = sorted(Path(log_dir).glob("*.log")) + sorted(Path(log_dir).glob("run-*/*.log"))
    return {p.name: p.read_text(errors="replace")[-chars:] for p in logs}


def prediction_source(env: dict[str, str]) -> str:
    embedder = env.get("ALISE_EMBEDDER")
    if embedder == "none":
        return "prior-only predictor (ALISE_EMBEDDER=none)"
    return f"retrieval predictor (embedder {embedder or 'default'})"


def _save(result: dict, path: str | None) -> None:
    """`result` to `path` whole (written aside, then renamed: never a half-written file)."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)


def device_result(args: argparse.Namespace, rates: list[float], engine_env, stack_env) -> dict:
    """The device run's JSON before anything ran: what is measured, and how."""
    return {
        "command": command_line("stack"),
        "device": args.device,
        "device_name": None,
        "cores": len(os.sched_getaffinity(0)),
        "model": stack_env["ALISE_MODEL"],
        "load_format": args.load_format,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "max_tokens_mode": "fixed (EOS honoured)",
        "temperature": args.temperature,
        "policy": args.policy,
        "prediction": prediction_source(stack_env),
        "rates": rates,
        "saturation_rate": rates[-1],
        "prompts": "the saturation rate's are the engine alone's; each other rate has its own",
        "points_order": "as run: the saturation rate first",
        "engine_env": engine_env,
        "stack_env": stack_env,
        "engine_alone": None,
        "points": [],
        "stack_over_engine": None,
    }


def save_device(result: dict, path: str | None) -> None:
    """`result` saved, with stack / engine alone at the saturation rate once both ran."""
    engine = result["engine_alone"] or {}
    top = [p for p in result["points"] if p["rate"] == result["saturation_rate"]]
    if top and top[0]["throughput_tok_s"] and engine.get("throughput_tok_s"):
        ratio = top[0]["throughput_tok_s"] / engine["throughput_tok_s"]
        result["stack_over_engine"] = round(ratio, 3)
    _save(result, path)


def _run_device(args: argparse.Namespace) -> int:
    if args.max_tokens_mode != "fixed":
        raise SystemExit("--device: the fixed max_tokens mode only (EOS honoured)")
    rates = parse_rates(args.rates, args.request_rate)
    engine_env, stack_env = device_envs(args)
    result = device_result(args, rates, engine_env, stack_env)
    save = lambda: save_device(result, args.json)  # noqa: E731
    save()
    try:
        engine = result["engine_alone"] = engine_phase(args, rates[-1], engine_env)
        result["device_name"] = engine.get("device_name")
        save()
        stack_at_rates(args, rates, stack_env, result, save)
    except (SystemExit, KeyboardInterrupt) as exc:  # the caller's timeout: say where it hit
        result["interrupted"] = f"{type(exc).__name__} after {len(result['points'])} rate(s)"
        save()
        raise
    except Exception as exc:
        result["stack_error"] = f"{type(exc).__name__}: {exc}"
        result["stack_log_tails"] = _log_tail(result.get("stack_logs"))
        _progress(f"stack failed: {result['stack_error']}; logs in {result.get('stack_logs')}")
    save()
    print(json.dumps(result, indent=2), flush=True)
    failed = "error" in engine or "stack_error" in result or result["stack_over_engine"] is None
    return 1 if failed or any(p["num_errors"] for p in result["points"]) else 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a timeout's) as an exit: `finally` blocks stop the stack and the child."""
    raise SystemExit(128 + signum)


def _run(args: argparse.Namespace) -> int:
    if args.device is not None:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return _run_device(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
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
    device = p.add_argument_group(
        "device mode", "one model on one device: the engine alone, then the stack at --rates"
    )
    device.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="run the device mode on this device (default: the CPU configurations above)",
    )
    device.add_argument("--model", default=None, help="model or preset (default: ALISE_MODEL's)")
    device.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    device.add_argument(
        "--rates", default=None, help="request rates, comma-separated; the highest saturates "
        "(default: --request-rate)"
    )  # fmt: skip
    device.add_argument(
        "--extra-env", default=None, help="KEY=VAL,... for the engine alone and the stack"
    )
    device.add_argument("--engine-gpu-memory-utilization", type=float, default=0.35)
    device.add_argument("--stack-gpu-memory-utilization", type=float, default=0.5)
    p.set_defaults(func=_run)
