"""Live load generator: replays a trace against the gateway over HTTP SSE
(`vllm bench serve` conventions) and turns what the client saw into metric records.

Each trace item is sent at its arrival time (optionally capped by `max_concurrency`) as a
streaming chat completion with `max_tokens` = its `output_len` (`bench serve` sets it: one
fixed cap for every request with EOS honoured by default, or the reference length with
`ignore_eos` in the papers' replay mode) at `temperature`: by default the API's default, 1.0,
what users send (each request samples its own answer, so policies get the same work only in
distribution, unless `sample_seed` pairs the draws: request i then sends the seed
`sample_seed * 1_000_003 + i`, and the executor's seeded sampler gives it the same draw under
every policy, up to the numerics of the batch it ran in); 0 is greedy decoding, the same
answers for every policy. The client records the time of every streamed chunk; the usage chunk gives the
exact token counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from lab.workload.metrics import RequestRecord
from lab.workload.traces.trace import TraceItem

DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default, what a client that sets none gets


@dataclass
class LiveResult:
    record: RequestRecord
    text: str
    error: str | None
    completion_tokens: int
    served_id: str = ""  # the stack's request id (the chunks' id without "chatcmpl-")
    predicted_len: int | None = None  # the arrival prediction (X-ALISE-Prediction)


def request_seed(sample_seed: int | None, index: int) -> int | None:
    """The `seed` request `index` of a trace sends (None: unseeded)."""
    return None if sample_seed is None else (sample_seed * 1_000_003 + index) % 2**63


def _body(
    item: TraceItem,
    model: str,
    ignore_eos: bool,
    temperature: float = DEFAULT_TEMPERATURE,
    seed: int | None = None,
) -> dict:
    body: dict = {
        "model": model,
        "stream": True,
        "max_tokens": item.output_len,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": item.prompt or "Hello"}],
    }
    if seed is not None:
        body["seed"] = seed
    if item.messages:  # a multi-turn history or a system prompt (traces/multiturn.py)
        body["messages"] = [{"role": role, "content": text} for role, text in item.messages]
    slo = {
        k: v * 1000
        for k, v in (
            ("ttft_ms", item.slo.ttft_s),
            ("tbt_ms", item.slo.tbt_s),
            ("deadline_ms", item.slo.deadline_s),
        )
        if v is not None
    }
    if slo:
        body["slo"] = slo
    return body


async def _one(
    client: httpx.AsyncClient,
    url: str,
    item: TraceItem,
    model: str,
    ignore_eos: bool,
    t0: float,
    temperature: float = DEFAULT_TEMPERATURE,
    seed: int | None = None,
) -> LiveResult:
    """Send one request; times are seconds since the benchmark's t0."""
    arrival = time.perf_counter() - t0
    record = RequestRecord(
        item.request_id,
        arrival,
        item.prompt_len,
        slo_ttft_s=item.slo.ttft_s,
        slo_tbt_s=item.slo.tbt_s,
        slo_deadline_s=item.slo.deadline_s,
    )
    text, usage, error = [], None, None
    served_id, predicted = "", None
    try:
        async with client.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=_body(item, model, ignore_eos, temperature, seed),
        ) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            else:
                predicted = predicted_length(response.headers.get("x-alise-prediction", ""))
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    served_id = served_id or chunk.get("id", "").removeprefix("chatcmpl-")
                    now = time.perf_counter() - t0
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            text.append(piece)
                            record.token_times.append(now)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    record.finish_s = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else len(record.token_times)
    if usage:
        record.prompt_len = usage.get("prompt_tokens", record.prompt_len)
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    _pad_token_times(record, tokens)
    record.completed = error is None and tokens > 0
    return LiveResult(record, "".join(text), error, tokens, served_id, predicted)


def predicted_length(header: str) -> int | None:
    """The length in an X-ALISE-Prediction header (`length=123; source=retrieval`), or None."""
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == "length" and value.isdigit():
            return int(value)
    return None


def _pad_token_times(record: RequestRecord, tokens: int) -> None:
    """A chunk can carry several tokens (text held back until a character is whole); give
    the extra tokens the time of the chunk that delivered them so counts are exact."""
    missing = tokens - len(record.token_times)
    if missing > 0 and record.token_times:
        record.token_times.extend([record.token_times[-1]] * missing)


async def run_trace(
    url: str,
    items: list[TraceItem],
    model: str,
    ignore_eos: bool = True,
    max_concurrency: int | None = None,
    progress=None,
    timeout_s: float = 1800.0,
    temperature: float = DEFAULT_TEMPERATURE,
    sample_seed: int | None = None,
) -> list[LiveResult]:
    """Replay the trace in real time at `temperature` (`sample_seed`: pair the draws, see the
    module's doc); returns one result per item, in trace order."""
    # keep idle connections for less than the server's keep-alive (uvicorn: 5 s): at equal
    # timeouts a request can go out on a connection the server is closing (httpx ReadError)
    limits = httpx.Limits(
        max_connections=max_concurrency or 10_000,
        max_keepalive_connections=max_concurrency or 10_000,
        keepalive_expiry=2.0,
    )
    semaphore = asyncio.Semaphore(max_concurrency or len(items) or 1)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits
    ) as client:
        t0 = time.perf_counter()

        async def scheduled(index: int, item: TraceItem) -> LiveResult:
            await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - t0)))
            seed = request_seed(sample_seed, index)
            async with semaphore:
                result = await _one(client, url, item, model, ignore_eos, t0, temperature, seed)
            if progress is not None:
                progress.update(1)
            return result

        return await asyncio.gather(*(scheduled(i, item) for i, item in enumerate(items)))


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
