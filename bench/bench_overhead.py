"""`alise bench overhead`: the live scheduler's own time per iteration.

One CPU executor (a separate process) serves a tiny random-weight model, so model time is small
and steady; the scheduler runs in this process against real Redis; a client process streams
`--requests` concurrent requests (ignore_eos, fixed length). For every pair of consecutive
Steps sent while all requests run, overhead = wall time between the two Step calls minus the
executor's reported time for the first one (gRPC transport, core schedule/update, Redis
hand-off, token streaming). Reported per policy: p50 and p99 in milliseconds, plus the part
spent in the loop's own code (`loop_code_*`) and, for scale, the round trip of an empty Step.
Each policy runs `--repeats` times, interleaved with the others; the percentiles pool all runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path

from lab.workload.report import emit_json


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _client(address: str, n: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    """Runs in a child process: n concurrent Generate streams, each read to the end."""
    from lab.scheduler.testing import gen_request, generate
    from services.common.grpc_client import aio_channel
    from services.common.pb import scheduler_pb2_grpc

    async def main() -> None:
        async with aio_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            prompts = [[(i * 97 + j) % 4000 + 3 for j in range(prompt_len)] for i in range(n)]
            results = await asyncio.gather(
                *[
                    generate(stub, gen_request(f"{tag}-{i}", p, max_tokens), timeout=600)
                    for i, p in enumerate(prompts)
                ]
            )
        assert all(r[-1].usage.completion_tokens == max_tokens for r in results)

    asyncio.run(main())


def _start_executor(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    from bench.fleet import spawn_cli

    env = dict(
        ALISE_MODEL=str(model_dir),
        ALISE_EXECUTOR_PORT=str(port),
        ALISE_DEVICE="cpu",
        ALISE_NUM_THREADS="1",
        ALISE_KV_MEMORY_GB="0.05",
        ALISE_SWAP_MEMORY_GB="0.01",
        ALISE_LOG_LEVEL="WARNING",
        HF_HUB_OFFLINE="1",
    )
    return spawn_cli(["executor", "serve"], env, log_path)


async def _wait_serving(address: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    from services.common.grpc_client import aio_channel, check_health

    async with aio_channel(address) as channel:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"executor exited with {proc.returncode}")
            if await check_health(channel, timeout=1.0):
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"executor at {address} did not come up")


async def _measure(
    policy: str, redis_url: str, executor: str, args, run: int = 0
) -> tuple[list[float], list[float]]:
    """One run of one policy: (overhead ms, loop-code ms) per iteration with all requests."""
    import multiprocessing

    from lab.scheduler.testing import running_scheduler

    async with running_scheduler(
        redis_url,
        [executor],
        policy=policy,
        redis_namespace=f"bench-{policy}-{run}",
        log_level="WARNING",
    ) as handle:
        loop = handle.service.loops[executor]
        overheads: deque[tuple[float, int, float]] = deque()
        loop.overheads = overheads  # record every Step's (a server keeps none)
        while not loop.up:
            await asyncio.sleep(0.05)
        child = multiprocessing.get_context("spawn").Process(
            target=_client,
            args=(
                handle.address,
                args.requests,
                args.prompt_len,
                args.max_tokens,
                f"{policy}-{run}",
            ),
        )
        child.start()
        while child.is_alive():
            await asyncio.sleep(0.05)
        if child.exitcode != 0:
            raise RuntimeError(f"client failed ({child.exitcode})")
        full = [(o * 1000, c * 1000) for o, batch, c in overheads if batch == args.requests]
    if len(full) < 10:
        raise RuntimeError(f"only {len(full)} iterations ran all {args.requests} requests")
    return [o for o, _ in full], [c for _, c in full]


def _stats(samples: list[float], compute: list[float]) -> dict:
    return {
        "p50_ms": round(_percentile(samples, 0.5), 3),
        "p99_ms": round(_percentile(samples, 0.99), 3),
        "mean_ms": round(statistics.fmean(samples), 3),
        "iterations": len(samples),
        "loop_code_p50_ms": round(_percentile(compute, 0.5), 3),
        "loop_code_p99_ms": round(_percentile(compute, 0.99), 3),
    }


async def _rpc_floor_ms(address: str, n: int = 200) -> float:
    """p50 round trip of an empty Step on the step stream (as the loop sends them) minus the
    executor's own time: the transport floor."""
    from services.common.pb import executor_pb2
    from services.scheduler.loop.executor_client import ExecutorClient

    client, times = ExecutorClient(address), []
    for _ in range(n):
        start = time.perf_counter()
        reply = await client.start_step(executor_pb2.StepRequest(), timeout=10)
        times.append((time.perf_counter() - start - reply.timings.total_s) * 1000)
    await client.close()
    return round(_percentile(times, 0.5), 3)


async def _run_all(args) -> dict:
    from lab.scheduler.testing import cached_tiny_model
    from services.common.redis_runner import EmbeddedRedis, free_port

    model = cached_tiny_model("llama")
    work = Path(tempfile.mkdtemp(prefix="alise-bench-overhead-"))
    port = free_port()
    proc = _start_executor(model, port, work / "executor.log")
    address = f"127.0.0.1:{port}"
    try:
        await _wait_serving(address, proc)
        floor = await _rpc_floor_ms(address)
        names = args.policies.split(",")
        pooled = {p: ([], []) for p in names}
        with EmbeddedRedis(work / "redis") as redis:
            for run in range(args.repeats or 3):  # interleaved: drift hits every policy alike
                for p in names:
                    samples, compute = await _measure(p, redis.url, address, args, run)
                    pooled[p][0].extend(samples)
                    pooled[p][1].extend(compute)
        policies = {p: _stats(*pooled[p]) for p in names}
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "policies": policies,
        "repeats": args.repeats or 3,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "empty_step_rpc_p50_ms": floor,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "executor": "cpu (1 torch thread), tiny random llama (2 layers)",
    }


def _run(args: argparse.Namespace) -> int:
    from services.common.runner import run_coroutine

    if args.fake_executors:
        from bench.fleet import run_fleet

        emit_json(run_fleet(args), args.json)
        return 0

    loops = args.event_loops.split(",")
    runs = {loop: run_coroutine(_run_all(args), loop) for loop in loops}
    result = dict(runs[loops[0]])
    if len(loops) > 1:  # side by side, each with its own executor and Redis
        result["event_loops"] = {
            loop: {"policies": r["policies"], "empty_step_rpc_p50_ms": r["empty_step_rpc_p50_ms"]}
            for loop, r in runs.items()
        }
    result["event_loop"] = loops[0]
    emit_json(result, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("overhead", help="scheduler's own time per iteration (p50/p99)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--policies", default="fcfs,hybrid", help="comma-separated policy names")
    p.add_argument("--requests", type=int, default=64, help="concurrent running requests")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per policy (default 3), interleaved; percentiles pool every run's "
        "iterations (this shared machine drifts by ±0.3 ms between runs); fleet mode: "
        "measurements of every point (default 1), median and range reported",
    )
    p.add_argument(
        "--event-loops",
        default="uvloop",
        help="comma-separated: uvloop (what the services run) and/or asyncio; "
        "the first one's figures are the headline",
    )
    fleet = p.add_argument_group(
        "fleet mode (--fake-executors): executors sustained per scheduler, and shards"
    )
    fleet.add_argument(
        "--fake-executors",
        default="",
        help="comma-separated stub executor counts to try (e.g. 8,16,32); set = fleet mode",
    )
    fleet.add_argument(
        "--shards", default="1,2", help="comma-separated scheduler shard counts per point"
    )
    fleet.add_argument("--step-ms", type=float, default=25.0, help="every stub Step's time")
    fleet.add_argument(
        "--per-executor",
        default="2",
        help="streaming requests per executor: one count, or one per executor count",
    )
    fleet.add_argument("--warmup-s", type=float, default=2.0, help="after all requests stream")
    fleet.add_argument("--window-s", type=float, default=5.0, help="measurement window")
    fleet.add_argument(
        "--budget-ms", type=float, default=2.0, help="scheduler time per iteration (p50) allowed"
    )
    p.set_defaults(func=_run)
