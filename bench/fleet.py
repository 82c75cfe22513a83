"""`alise bench overhead --fake-executors N,...`: how many executors one scheduler sustains, and
what scheduler shards add past that.

Per point (shards S, executors N): one process serves N stub executors (services/executor/
stub.py: the real gRPC Step contract, a fixed `--step-ms` per Step, no model), registered in
Redis; S scheduler processes (`alise scheduler serve`, shards 0..S-1, no static executor list)
share them through the shard assignment; a client process places `--per-executor` x N streaming
requests through the gateway's own shard placement (services/gateway/shards.py) and reads every
token. Once every request streams, the stubs record each Step for `--window-s` seconds:
- scheduler time per iteration: at each executor, the gap between the end of one Step and the
  start of the next (scheduler work, Redis hand-off, gRPC both ways), p50 and p99;
- iterations/s: Steps that ran tokens, summed over all executors; utilization: iterations/s
  over what the step time allows (N x 1000 / `--step-ms`): the share of time the executors ran;
- CPU per iteration of each process (scheduler, stubs, client, Redis) over the window.
"Sustained" is the largest N whose p50 gap stays within `--budget-ms` (2 ms). `--per-executor`
takes one count, or one per executor count (`--fake-executors 1,4 --per-executor 64,32`);
`--repeats R` measures every point R times (interleaved) and reports the median and range.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_TOKENS = 3000  # long enough to outlast the measurement window at any step time here


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# -- stub executors (child process) --------------------------------------------------------
def _stubs_main(count: int, step_s: float, redis_url: str, namespace: str, conn) -> None:
    from lab.executor.stub import serve_stubs
    from services.common.runner import run_coroutine

    async def main() -> None:
        fleet = await serve_stubs(count, step_s, registry_url=redis_url, namespace=namespace)
        conn.send(fleet.addresses())
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "mark":
                for engine in fleet.engines:
                    engine.marks.clear()
                conn.send(time.perf_counter())
            elif command == "report":
                conn.send([list(e.marks) for e in fleet.engines])
            else:
                await fleet.stop()
                conn.send("stopped")
                return

    run_coroutine(main())


# -- client (child process) ---------------------------------------------------------------
def _client_main(shards: list[str], n: int, conn) -> None:
    """Start n streams through the gateway's shard placement, report once all stream."""
    from lab.scheduler.testing import gen_request
    from services.common.runner import run_coroutine
    from services.common.settings import GatewaySettings
    from services.gateway.upstream import Upstream

    async def main() -> None:
        upstream = Upstream(GatewaySettings(scheduler_shards=shards))
        await upstream.stats()
        started = asyncio.Event()
        streaming = 0
        placed = [0] * len(upstream.shards)

        async def one(i: int) -> None:
            nonlocal streaming
            group = upstream.place()
            placed[group.index] += 1
            pb = gen_request(f"fleet-{i}", [(i * 31 + j) % 900 + 3 for j in range(16)], MAX_TOKENS)
            call, _ = upstream.generate(group, pb, timeout_s=600)
            first = True
            async for _event in call:
                if first:
                    first = False
                    streaming += 1
                    if streaming == n:
                        started.set()

        tasks = []
        for i in range(n):  # arriving over time: the shards' reported loads come into play
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.005)
        await started.wait()
        conn.send({"streaming": streaming, "placed": placed})
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await upstream.close()

    run_coroutine(main())


# -- schedulers (subprocesses) -------------------------------------------------------------
def spawn_cli(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`alise ARGV...` as a child process with `env` added to ours, stderr to `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *argv],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
    )


def _start_scheduler(
    redis_url: str, namespace: str, shard: int, shards: int, port: int, args, log: Path
) -> subprocess.Popen:
    env = dict(
        ALISE_REDIS_URL=redis_url,
        ALISE_REDIS_NAMESPACE=namespace,
        ALISE_SHARD=str(shard),
        ALISE_NUM_SHARDS=str(shards),
        ALISE_EXECUTORS="",
        ALISE_SCHEDULER_PORT=str(port),
        ALISE_POLICY=args.policies.split(",")[0],
        ALISE_DISCOVERY_INTERVAL_S="0.5",
        ALISE_LOG_LEVEL="WARNING",
        ALISE_METRICS_PORT="0",
    )
    return spawn_cli(["scheduler", "serve"], env, log)


async def _executors_up(addresses: list[str], want: int, timeout_s: float = 60) -> list[int]:
    """Wait until the shards together report `want` executors up; executors per shard."""
    from services.common.grpc_client import aio_channel
    from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.monotonic() + timeout_s
    per_shard: list[int] = []
    while time.monotonic() < deadline:
        per_shard = []
        for address in addresses:
            async with aio_channel(address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                try:
                    reply = await stub.Stats(scheduler_pb2.StatsRequest(), timeout=2)
                except Exception:  # not up yet (or not leading yet)
                    per_shard.append(0)
                    continue
                per_shard.append(sum(e.up for e in reply.executors))
        if sum(per_shard) >= want:
            return per_shard
        await asyncio.sleep(0.25)
    raise TimeoutError(f"only {per_shard} of {want} executors came up on the shards")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_iteration(before: dict, after: dict, iterations: float) -> dict:
    """Each role's CPU milliseconds per iteration over the window."""
    return {
        role: round((sum(after[role]) - sum(before[role])) * 1000 / max(1.0, iterations), 3)
        for role in before
    }


def _figures(marks: list[list[tuple[float, float]]], since: float, until: float) -> dict:
    gaps, steps = [], 0
    for per in marks:
        inside = [(s, e) for s, e in per if s >= since and e <= until]
        steps += len(inside)
        gaps += [(b[0] - a[1]) * 1000 for a, b in itertools.pairwise(inside)]
    return {
        "gap_p50_ms": round(_percentile(gaps, 0.5), 3),
        "gap_p99_ms": round(_percentile(gaps, 0.99), 3),
        "iterations_per_s": round(steps / (until - since), 1),
    }


def _window(stub_end, pids: dict[str, list[int]], window_s: float) -> tuple[dict, dict, dict]:
    """The stubs' step figures over one window, and each role's CPU seconds before and after."""
    cpu = {role: [_cpu_s(pid) for pid in ps] for role, ps in pids.items()}
    stub_end.send("mark")
    since = stub_end.recv()
    time.sleep(window_s)
    stub_end.send("report")
    marks = stub_end.recv()
    cpu_after = {role: [_cpu_s(pid) for pid in ps] for role, ps in pids.items()}
    return _figures(marks, since, since + window_s), cpu, cpu_after


def per_executor(args, index: int) -> int:
    """Requests per executor at the `index`-th executor count."""
    counts = [int(x) for x in str(args.per_executor).split(",")]
    return counts[index] if len(counts) > 1 else counts[0]


def _point(redis, shards: int, n: int, args, work: Path, run: int, per: int) -> dict:
    from services.common.redis_runner import free_port

    ctx = multiprocessing.get_context("spawn")
    namespace, redis_url = f"fleet-{run}-{shards}x{n}", redis.url
    stub_end, stub_conn = ctx.Pipe()
    stubs = ctx.Process(
        target=_stubs_main, args=(n, args.step_ms / 1000, redis_url, namespace, stub_conn)
    )
    stubs.start()
    stub_end.recv()  # addresses: registered
    ports = [free_port() for _ in range(shards)]
    procs = [
        _start_scheduler(redis_url, namespace, k, shards, ports[k], args, work / f"s{run}-{k}.log")
        for k in range(shards)
    ]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    client_end, client_conn = ctx.Pipe()
    client = None
    try:
        per_shard = asyncio.run(_executors_up(addresses, n))
        client = ctx.Process(target=_client_main, args=(addresses, n * per, client_conn))
        client.start()
        if not client_end.poll(120):
            raise TimeoutError("the requests did not all start streaming")
        placed = client_end.recv()
        time.sleep(args.warmup_s)
        pids = {
            "scheduler": [p.pid for p in procs],
            "stubs": [stubs.pid],
            "client": [client.pid],
            "redis": [redis.process.pid],
        }
        figures, cpu, cpu_after = _window(stub_end, pids, args.window_s)
        iterations = figures["iterations_per_s"] * args.window_s
        return {
            "shards": shards,
            "executors": n,
            "requests_per_executor": per,
            "utilization": round(figures["iterations_per_s"] * args.step_ms / 1000 / n, 3),
            "executors_per_shard": per_shard,
            "requests_per_shard": placed["placed"],
            **figures,
            "cpu_ms_per_iteration": _cpu_per_iteration(cpu, cpu_after, iterations),
            "scheduler_cpu_utilization": [
                round((b - a) / args.window_s, 2)
                for a, b in zip(cpu["scheduler"], cpu_after["scheduler"], strict=True)
            ],
        }
    finally:
        if client is not None:
            client_end.send("stop")
            client.join(30)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        stub_end.send("stop")
        stub_end.recv()
        stubs.join(30)


def run_fleet(args) -> dict:
    from services.common.redis_runner import EmbeddedRedis

    counts = [int(x) for x in args.fake_executors.split(",")]
    shard_counts = [int(x) for x in args.shards.split(",")]
    work = Path(tempfile.mkdtemp(prefix="alise-bench-fleet-"))
    points = []
    repeats = getattr(args, "repeats", None) or 1
    run = 0
    try:
        with EmbeddedRedis(work / "redis") as redis:
            for repeat in range(max(1, repeats)):
                for index, n in enumerate(counts):
                    for shards in shard_counts:  # side by side at each N
                        per = per_executor(args, index)
                        point = _point(redis, shards, n, args, work, run, per)
                        point["repeat"] = repeat
                        run += 1
                        print(point, file=sys.stderr, flush=True)
                        points.append(point)
    except BaseException:
        print(f"bench overhead failed: logs and Redis files kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)  # Redis's files and the logs: up to 64 MiB a run
    return summarize(points, args.budget_ms) | {
        "step_ms": args.step_ms,
        "requests_per_executor": str(args.per_executor),
        "repeats": max(1, repeats),
        "pipeline_depth": int(os.environ.get("ALISE_PIPELINE_DEPTH", "2")),
        "step_spin_ms": float(os.environ.get("ALISE_STEP_SPIN_MS", "0")),
        "policy": args.policies.split(",")[0],
        "window_s": args.window_s,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "executors": "stub executors (real Step contract, fixed step time, no model), one process",
    }


def _median_range(values: list[float]) -> tuple[float, list[float]]:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return round(median, 3), [round(ordered[0], 3), round(ordered[-1], 3)]


def gate_figures(points: list[dict]) -> dict:
    """One scheduler's figures per executor count (the one-shard points): executor
    utilization and scheduler CPU ms per iteration, each the median over the repeats with
    its range."""
    out: dict[str, dict] = {k: {} for k in ("utilization", "scheduler_cpu_ms_per_iteration")}
    out |= {"utilization_range": {}, "scheduler_cpu_ms_per_iteration_range": {}}
    for n in sorted({p["executors"] for p in points if p["shards"] == 1}):
        at = [p for p in points if p["shards"] == 1 and p["executors"] == n]
        util = [p["utilization"] for p in at if "utilization" in p]
        if util:
            out["utilization"][str(n)], out["utilization_range"][str(n)] = _median_range(util)
        cpu = [p["cpu_ms_per_iteration"]["scheduler"] for p in at if "cpu_ms_per_iteration" in p]
        if cpu:
            key = "scheduler_cpu_ms_per_iteration"
            out[key][str(n)], out[key + "_range"][str(n)] = _median_range(cpu)
    return out


def summarize(points: list[dict], budget_ms: float) -> dict:
    """Executors sustained per shard count (largest N within the budget), and at each N the
    iterations/s of every shard count relative to one shard; the gate figures (see
    `gate_figures`)."""
    sustained = {}
    for shards in sorted({p["shards"] for p in points}):
        ok = [
            p["executors"] for p in points if p["shards"] == shards and p["gap_p50_ms"] <= budget_ms
        ]
        sustained[str(shards)] = max(ok, default=0)
    ratios = {}
    for n in sorted({p["executors"] for p in points}):
        at = {p["shards"]: p["iterations_per_s"] for p in points if p["executors"] == n}
        if 1 in at and at[1] > 0:
            ratios[str(n)] = {str(s): round(v / at[1], 2) for s, v in sorted(at.items())}
    return {
        **gate_figures(points),
        "points": points,
        "budget_ms": budget_ms,
        "executors_sustained": sustained,
        "throughput_vs_one_shard": ratios,
    }
