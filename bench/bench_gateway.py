"""`alise bench gateway --json FILE`: what the gateway and its gRPC hops cost.

1. Added per-token overhead: `--streams` (64) concurrent streaming completions with
   `ignore_eos` and `return_token_times`; for consecutive chunks of one stream the gap the
   HTTP client sees minus the gap between the scheduler's token times (TokenEvent.time,
   carried in each chunk), p50/p99 over every gap (`added_p50_ms`, `added_p99_ms`). Also the
   one-way hop latency (client arrival - scheduler token time; same clock, same machine).
   The same streams are also run straight against the scheduler over gRPC (no gateway), in
   ABBA rounds on the same stack, so `gateway_hop_added_*` isolates what the gateway adds.
2. Idle streams: a gateway process whose scheduler has no executor holds `--idle` (1000)
   streaming requests that wait in the queue; `max_streams` counts those that got their
   response headers and first SSE event and are all open at once; `bytes_per_stream` is the
   growth of the gateway's anonymous RSS per stream over the second half of them (the first
   half absorbs memory the allocator kept from start-up).

Every service runs as its own process (`alise executor|scheduler|gateway serve`), as in
production; the gateway's memory is read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from lab.workload.report import emit_json


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _one_stream(client, model: str, prompt: str, tokens: int) -> list[tuple[float, float]]:
    """(client arrival time, scheduler token time) per text chunk of one request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
        "return_token_times": True,
        "temperature": 0,
    }
    points = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            now = time.time()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            ext = chunk.get("alise") or {}
            if "time" in ext:
                points.append((now, ext["time"]))
    return points


async def _grpc_stream(stub, i: int, prompt_ids: list[int], tokens: int):
    """(arrival time, scheduler token time) per token of one Generate call, no gateway."""
    from services.common.pb import common_pb2, scheduler_pb2

    request = scheduler_pb2.GenerateRequest(
        request_id=f"bench-grpc-{time.time_ns()}-{i}",
        prompt_token_ids=prompt_ids,
        max_tokens=tokens,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0),
    )
    points = []
    async for event in stub.Generate(request, timeout=600):
        if not event.finished:
            points.append((time.time(), event.time))
    return points


async def _http_round(url: str, model: str, streams: int, tokens: int):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await _one_stream(client, model, "warm up", 4)
        prompts = [
            f"Request {i}: tell me a long story about the number {i}." for i in range(streams)
        ]
        return await asyncio.gather(*[_one_stream(client, model, p, tokens) for p in prompts])


async def _grpc_round(address: str, prompt_ids: list[int], streams: int, tokens: int):
    from services.common.grpc_client import aio_channel
    from services.common.pb import scheduler_pb2_grpc

    async with aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        await _grpc_stream(stub, -1, prompt_ids, 4)
        return await asyncio.gather(
            *[_grpc_stream(stub, i, prompt_ids, tokens) for i in range(streams)]
        )


def _gaps(results) -> tuple[list[float], list[float]]:
    """Per consecutive pair: client gap - scheduler gap (ms); per point: client - scheduler."""
    added, hops = [], []
    for points in results:
        hops += [(c - s) * 1000 for c, s in points]
        added += [((c1 - c0) - (s1 - s0)) * 1000 for (c0, s0), (c1, s1) in pairwise(points)]
    return added, hops


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_overhead(
    url: str, model: str, scheduler: str, gateway_pid: int, streams: int, tokens: int, rounds: int
) -> dict:
    """ABBA rounds of gRPC-direct and through-the-gateway runs on the same stack."""
    prompt_ids = list(range(100, 116))
    http, grpc_, gateway_cpu = [], [], 0.0
    for r in range(rounds):
        order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
        for kind in order:
            if kind == "http":
                before = cpu_seconds(gateway_pid)
                http += asyncio.run(_http_round(url, model, streams, tokens))
                gateway_cpu += cpu_seconds(gateway_pid) - before
            else:
                grpc_ += asyncio.run(_grpc_round(scheduler, prompt_ids, streams, tokens))
    added, hops = _gaps(http)
    g_added, g_hops = _gaps(grpc_)
    q = _percentile
    return {
        "added_p50_ms": q(added, 0.5),
        "added_p99_ms": q(added, 0.99),
        "added_mean_ms": statistics.fmean(added),
        "hop_latency_p50_ms": q(hops, 0.5),
        "hop_latency_p99_ms": q(hops, 0.99),
        "grpc_direct_added_p50_ms": q(g_added, 0.5),
        "grpc_direct_added_p99_ms": q(g_added, 0.99),
        "grpc_direct_hop_p50_ms": q(g_hops, 0.5),
        "grpc_direct_hop_p99_ms": q(g_hops, 0.99),
        "gateway_hop_added_p50_ms": q(hops, 0.5) - q(g_hops, 0.5),
        "gateway_hop_added_p99_ms": q(hops, 0.99) - q(g_hops, 0.99),
        "gateway_cpu_us_per_token": gateway_cpu / max(1, sum(map(len, http))) * 1e6,
        "gaps_measured": len(added),
        "streams": streams,
        "tokens_per_stream": tokens,
        "rounds": rounds,
    }


def rss_bytes(pid: int) -> int:
    """Anonymous resident memory (heap, stacks): what streams cost. File-backed pages
    (shared libraries) come and go with the page cache of a shared machine."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


async def _hold_stream(client, model: str, i: int, held: list[int], release: asyncio.Event) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": 8,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):  # the role chunk: the stream is open
                break
        held[0] += 1
        await release.wait()


async def _open_wave(
    client,
    model: str,
    first: int,
    n: int,
    held: list[int],
    release: asyncio.Event,
    timeout_s: float,
) -> list[asyncio.Task]:
    target = held[0] + n
    tasks = [
        asyncio.create_task(_hold_stream(client, model, first + i, held, release)) for i in range(n)
    ]
    deadline = time.perf_counter() + timeout_s
    while held[0] < target and time.perf_counter() < deadline and not all(t.done() for t in tasks):
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    return tasks


async def measure_idle(url: str, model: str, pid: int, n: int, timeout_s: float) -> dict:
    """Two waves of n/2 streams: the first warms the allocator's free lists (memory freed
    after start-up), the second's RSS growth per stream is the figure."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await client.get("/v1/models")
        held, release = [0], asyncio.Event()
        start = time.perf_counter()
        tasks = await _open_wave(client, model, 0, n // 2, held, release, timeout_s)
        mid, held_mid = rss_bytes(pid), held[0]
        tasks += await _open_wave(client, model, n // 2, n - n // 2, held, release, timeout_s)
        open_s = time.perf_counter() - start - 2.0
        end, held_end = rss_bytes(pid), held[0]
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    grown = held_end - held_mid
    return {
        "max_streams": held_end,
        "streams_asked": n,
        "bytes_per_stream": int((end - mid) / grown) if grown > 0 else None,
        "open_s": round(open_s, 2),
        "gateway_anon_rss_mid_mb": round(mid / 2**20, 1),
        "gateway_anon_rss_end_mb": round(end / 2**20, 1),
    }


def _run(args: argparse.Namespace) -> int:
    from lab.gateway.testing import ProcessStack

    with tempfile.TemporaryDirectory(prefix="alise-bench-gw-") as tmp:
        out: dict = {}
        with ProcessStack(Path(tmp), args.model, with_executor=True) as stack:
            out.update(
                measure_overhead(
                    stack.url,
                    stack.model_id,
                    stack.scheduler_address,
                    stack.gateway_pid,
                    args.streams,
                    args.tokens,
                    args.rounds,
                )
            )
        with ProcessStack(Path(tmp) / "idle", args.model, with_executor=False) as stack:
            out.update(
                asyncio.run(
                    measure_idle(
                        stack.url, stack.model_id, stack.gateway_pid, args.idle, args.idle_timeout
                    )
                )
            )
    out["model"] = args.model
    emit_json(out, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="gateway per-token overhead and idle stream capacity")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (overhead)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (overhead)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="ABBA rounds of gRPC-direct vs gateway runs (overhead)",
    )
    p.add_argument("--idle", type=int, default=1000, help="idle streams to open")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for the idle streams to open",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="`tiny` (random weights, SmolLM2 tokenizer) or a model setting",
    )
    p.set_defaults(func=_run)
