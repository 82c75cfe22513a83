"""`alise bench gateway --json FILE`: what the gateway and its gRPC hops cost.

1. Added per-token overhead: `--streams` (64) concurrent streaming completions with
   `ignore_eos` and `return_token_times`; for consecutive chunks of one stream the gap the
   HTTP client sees minus the gap between the scheduler's token times (TokenEvent.time,
   carried in each chunk), p50/p99 over every gap (`added_p50_ms`, `added_p99_ms`). Also the
   one-way hop latency (client arrival - scheduler token time; same clock, same machine).
2. Idle streams: a gateway process whose scheduler has no executor holds `--idle` (1000)
   streaming requests that wait in the queue; `max_streams` counts those that got their
   response headers and first SSE event and are all open at once; `bytes_per_stream` is the
   gateway's RSS growth divided by that count.

Every service runs as its own process (`alise executor|scheduler|gateway serve`), as in
production; the gateway's memory is read from /proc.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path



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
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "return_token_times": True, "temperature": 0}
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


async def measure_overhead(url: str, model: str, streams: int, tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await _one_stream(client, model, "warm up", 4)
        prompts = [f"Request {i}: tell me a long story about the number {i}." for i in
                   range(streams)]
        start = time.perf_counter()
        results = await asyncio.gather(*[_one_stream(client, model, p, tokens) for p in prompts])
        wall = time.perf_counter() - start
    added, hops, gaps = [], [], []
    for points in results:
        hops += [(c - s) * 1000 for c, s in points]
        for (c0, s0), (c1, s1) in zip(points, points[1:]):
            added.append(((c1 - c0) - (s1 - s0)) * 1000)
            gaps.append((s1 - s0) * 1000)
    return {"added_p50_ms": _percentile(added, 0.5), "added_p99_ms": _percentile(added, 0.99),
            "added_mean_ms": statistics.fmean(added) if added else float("nan"),
            "hop_latency_p50_ms": _percentile(hops, 0.5),
            "hop_latency_p99_ms": _percentile(hops, 0.99),
            "scheduler_gap_p50_ms": _percentile(gaps, 0.5), "gaps_measured": len(added),
            "streams": streams, "tokens_per_stream": tokens, "wall_s": round(wall, 3)}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _hold_stream(client, model: str, i: int, opened: asyncio.Event, counter: list[int],
                       target: int, release: asyncio.Event) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 8, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return False
        async for line in response.aiter_lines():
            if line.startswith("data: "):       # the role chunk: the stream is open
                break
        counter[0] += 1
        if counter[0] >= target:
            opened.set()
        await release.wait()
    return True


async def measure_idle(url: str, model: str, pid: int, n: int, timeout_s: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await client.get("/v1/models")
        await asyncio.sleep(1.0)
        before = rss_bytes(pid)
        opened, release, counter = asyncio.Event(), asyncio.Event(), [0]
        tasks = [asyncio.create_task(_hold_stream(client, model, i, opened, counter, n, release))
                 for i in range(n)]
        try:
            await asyncio.wait_for(opened.wait(), timeout_s)
        except TimeoutError:
            pass
        await asyncio.sleep(1.0)
        held = counter[0]
        after = rss_bytes(pid)
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"max_streams": held, "streams_asked": n,
            "bytes_per_stream": int((after - before) / held) if held else None,
            "gateway_rss_before_mb": round(before / 2**20, 1),
            "gateway_rss_after_mb": round(after / 2**20, 1)}


def _run(args: argparse.Namespace) -> int:
    from services.gateway.testing import ProcessStack

    with tempfile.TemporaryDirectory(prefix="alise-bench-gw-") as tmp:
        out: dict = {}
        with ProcessStack(Path(tmp), args.model, with_executor=True) as stack:
            out.update(asyncio.run(measure_overhead(stack.url, stack.model_id, args.streams,
                                                    args.tokens)))
        with ProcessStack(Path(tmp) / "idle", args.model, with_executor=False) as stack:
            out.update(asyncio.run(measure_idle(stack.url, stack.model_id, stack.gateway_pid,
                                                args.idle, args.idle_timeout)))
    out["model"] = args.model
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="gateway per-token overhead and idle stream "
                                              "capacity")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (overhead)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (overhead)")
    p.add_argument("--idle", type=int, default=1000, help="idle streams to open")
    p.add_argument("--idle-timeout", type=float, default=180.0,
                   help="seconds to wait for the idle streams to open")
    p.add_argument("--model", default="tiny",
                   help="`tiny` (random weights, SmolLM2 tokenizer) or a model setting")
    p.set_defaults(func=_run)

