"""`alise bench soak`: the `alise serve` stack under a steady load for `--minutes`; does anything grow?

Poisson arrivals at `--rate` requests/s (streaming chat, varied prompts, `--max-tokens`, half
greedy and half sampled) run against the exact one-command stack (lab/launcher/serve_stack.py).
Every `--sample-s` seconds a sampler records each process's resident memory and open file
descriptors (the launcher and every child in its `pids.json`: Redis, predictor, executor,
scheduler, gateway), the KV blocks in use and the requests queued or running (the scheduler's
Stats), and Redis's memory and number of keys. Per series the result gives the first, last,
min and max samples and the growth per hour of a least-squares line through the samples after
`--warmup-s` (start-up allocations, the first retention window), beside the residuals' spread,
so a slope can be read against the noise. Finished requests stay in Redis for
`ALISE_RETENTION_S`, so Redis's keys reach their steady state one retention window
(`--retention-s`) after the load starts; the warm-up should cover it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx

from lab.workload.report import emit_json

TOPICS = ("rivers", "prime numbers", "bread", "volcanoes", "chess", "bees", "tides", "maps")


def request_body(model: str, i: int, max_tokens: int) -> dict:
    sampled = i % 2 == 1
    return {
        "model": model,
        "messages": [
            {"role": "user", "content": f"Tell me something about {TOPICS[i % len(TOPICS)]} ({i})."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.8 if sampled else 0,
        "seed": i if sampled else None,
        "stream": True,
    }


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> str | None:
    """One streamed chat completion read to its end; None when it completed, else the error."""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}"
            done = False
            async for line in reply.aiter_lines():
                if line.startswith('data: {"error"'):
                    return line[:200]
                done = done or line == "data: [DONE]"
            return None if done else "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


async def steady_load(url: str, model: str, args: argparse.Namespace, stop_at: float) -> dict:
    """Poisson arrivals at args.rate until `stop_at` (monotonic); waits for every answer."""
    rng = random.Random(args.seed)
    tasks: list[asyncio.Task[str | None]] = []
    sent_at: list[str] = []  # wall-clock time of each request, to find it in the logs
    async with httpx.AsyncClient(timeout=300) as client:
        i = 0
        while time.monotonic() < stop_at:
            body = request_body(model, i, args.max_tokens)
            tasks.append(asyncio.create_task(one_request(client, url, body)))
            sent_at.append(time.strftime("%H:%M:%S"))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
    errors = [f"request {i} sent {sent_at[i]}: {e}" for i, e in enumerate(results) if e]
    return {"sent": len(tasks), "completed": len(tasks) - len(errors), "errors": errors[:5]}


def process_sample(pid: int) -> tuple[int, int, int] | None:
    """(resident set in KiB, its anonymous part in KiB, open file descriptors) of a process,
    None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rows = {p[0]: p[1] for p in map(str.split, status.splitlines()) if len(p) >= 2}
    return int(rows["VmRSS:"]), int(rows.get("RssAnon:", 0)), fds


def stack_sample(stack) -> dict[str, float]:
    """One sample of every series: per process `<name>.rss_mib`, its anonymous part
    `<name>.anon_mib` (the rest is file pages: mapped weights, stores) and `<name>.open_fds`, then
    `kv_blocks_used`, `kv_blocks_cached`, `requests_in_scheduler`, `redis.used_memory_mib`, `redis.keys`."""
    import redis

    from services.common.grpc_client import sync_channel
    from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

    out: dict[str, float] = {}
    for name, pid in {"launcher": stack.process.pid, **stack.pids()}.items():
        got = process_sample(pid)
        if got is not None:
            out[f"{name}.rss_mib"] = round(got[0] / 1024, 2)
            out[f"{name}.anon_mib"] = round(got[1] / 1024, 2)
            out[f"{name}.open_fds"] = got[2]
    with sync_channel(stack.scheduler_address_of(stack.leader())) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats(
            scheduler_pb2.StatsRequest(), timeout=5
        )
    out["kv_blocks_used"] = sum(e.num_device_blocks - e.free_device_blocks for e in stats.executors)
    out["kv_blocks_cached"] = sum(e.cached_device_blocks for e in stats.executors)
    out["requests_in_scheduler"] = stats.waiting + stats.running + stats.swapped
    client = redis.Redis.from_url(stack.redis_url(), socket_timeout=5)
    try:
        out["redis.used_memory_mib"] = round(client.info("memory")["used_memory"] / 2**20, 3)
        out["redis.keys"] = client.dbsize()
    finally:
        client.close()
    return out


class Sampler:
    """Samples the stack every `every_s` seconds in a thread until stopped."""

    def __init__(self, stack, every_s: float) -> None:
        self.stack = stack
        self.every_s = every_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.pids: list[dict[str, int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self.t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic() - self.t0
            try:
                self.samples.append((at, stack_sample(self.stack)))
                self.pids.append(self.stack.pids())
            except Exception as exc:  # a sample that failed is reported, not fatal
                self.errors.append(f"{at:.0f}s: {type(exc).__name__}: {exc}")
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def restarts(self) -> dict[str, int]:
        """Per service, how many times its process id changed during the run."""
        out: dict[str, int] = {}
        for before, after in zip(self.pids, self.pids[1:]):
            for name, pid in after.items():
                if before.get(name) not in (None, pid):
                    out[name] = out.get(name, 0) + 1
        return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope (per second) and the residuals' standard deviation."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0
    resid = [v - (mv + slope * (t - mt)) for t, v in points]
    return slope, (sum(r * r for r in resid) / max(1, n - 2)) ** 0.5


def series_growth(
    samples: list[tuple[float, dict[str, float]]], warmup_s: float
) -> dict[str, dict[str, float]]:
    """Per series: first/last/min/max, and after the warm-up the fitted growth per hour, the
    residuals' spread and the growth over the fitted window (to read against the spread)."""
    names = sorted({k for _, s in samples for k in s})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        points = [(t, s[name]) for t, s in samples if name in s]
        steady = [(t, v) for t, v in points if t >= warmup_s]
        values = [v for _, v in points]
        row = {"first": values[0], "last": values[-1], "min": min(values), "max": max(values)}
        if len(steady) >= 3:
            slope, noise = fit(steady)
            span_s = steady[-1][0] - steady[0][0]
            row.update(
                growth_per_hour=round(slope * 3600, 3),
                residual_sd=round(noise, 3),
                growth_over_window=round(slope * span_s, 3),
                samples_fitted=len(steady),
            )
        out[name] = row
    return out


def beyond_noise(series: dict[str, dict[str, float]]) -> list[str]:
    """Series whose fitted growth over the window exceeds three residual spreads and 1% of
    their size: growth that the samples' own noise does not explain."""
    out = []
    for name, row in series.items():
        grown = row.get("growth_over_window")
        if grown is None:
            continue
        size = max(abs(row["max"]), 1.0)
        if grown > 3 * row["residual_sd"] and grown > 0.01 * size:
            out.append(name)
    return out


def soak(args: argparse.Namespace, run_dir: Path) -> dict:
    from lab.launcher.serve_stack import ServeStack

    env = {"ALISE_RETENTION_S": str(args.retention_s), **dict(args.env)}
    with ServeStack(run_dir, args.model, env=env) as stack:
        warm = asyncio.run(warm_up(stack.url, stack.model_id, args.max_tokens))
        with Sampler(stack, args.sample_s) as sampler:
            stop_at = time.monotonic() + args.minutes * 60
            load = asyncio.run(steady_load(stack.url, stack.model_id, args, stop_at))
            time.sleep(min(args.sample_s, 5.0))  # one more sample once the answers are in
    series = series_growth(sampler.samples, args.warmup_s)
    return {
        "model": args.model,
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "max_tokens": args.max_tokens,
        "sample_s": args.sample_s,
        "warmup_s": args.warmup_s,
        "retention_s": args.retention_s,
        "env": dict(args.env),
        "seed": args.seed,
        "warm_up_error": warm,
        "load": load,
        "restarts": sampler.restarts(),
        "sample_errors": sampler.errors[:10],
        "samples_taken": len(sampler.samples),
        "beyond_noise": beyond_noise(series),
        "series": series,
        "samples": [[round(t, 1), s] for t, s in sampler.samples],
    }


async def warm_up(url: str, model: str, max_tokens: int) -> str | None:
    """One request before the measured load (first-call costs); its error, if any."""
    async with httpx.AsyncClient(timeout=300) as client:
        return await one_request(client, url, request_body(model, 0, max_tokens))


def _run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="alise-bench-soak-") as tmp:
        try:
            out = soak(args, Path(tmp))
        finally:
            if args.logs is not None:  # the services' logs outlive the run's directory
                shutil.copytree(Path(tmp) / "logs", args.logs, dirs_exist_ok=True)
    emit_json(out, args.json)
    print(f"sent {out['load']['sent']}, completed {out['load']['completed']}")
    print(f"growth beyond noise: {out['beyond_noise'] or 'none'}")
    return 0 if out["load"]["sent"] == out["load"]["completed"] else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "soak", help="steady load on `alise serve`: memory, files, KV, Redis over time"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--model", default="smollm2-135m-instruct", help="served model ('tiny' = fast)")
    p.add_argument("--minutes", type=float, default=20.0, help="how long the load runs")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument(
        "--warmup-s", type=float, default=90.0, help="samples before this are not fitted"
    )
    p.add_argument(
        "--retention-s",
        type=float,
        default=60.0,
        help="ALISE_RETENTION_S: finished requests' Redis keys expire after this",
    )
    p.add_argument("--seed", type=int, default=0, help="arrival times")
    p.add_argument("--logs", type=Path, default=None, help="copy the services' logs here")
    p.add_argument(
        "--env",
        type=env_pair,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the stack's processes, e.g. ALISE_PREDICTOR_CAPACITY=1000 so the "
        "store reaches its bound within the run (repeatable)",
    )
    p.set_defaults(func=_run)


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("ALISE_"):
        raise argparse.ArgumentTypeError(f"expected ALISE_NAME=VALUE, got {text!r}")
    return name, value
