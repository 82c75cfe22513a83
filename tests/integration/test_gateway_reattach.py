"""Clients ride through scheduler failures, over HTTP through a real gateway process: the
scheduler SIGKILLed mid-stream (restarted by the supervisor) and a leader SIGKILLed with a
standby scheduler taking over. Every stream, streamed or not, ends with exactly the text of an
undisturbed run (no repeated or missing token)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx

MAX_TOKENS = 120


def body(model: str, i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": model,
        "prompt": f"Request {i}: tell me about number {i * 7}",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class Client:
    """One request: its text so far, how it ended, and when its tokens came."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.gaps: list[float] = []

    async def run(self, http: httpx.AsyncClient, url: str, payload: dict) -> Client:
        if not payload["stream"]:
            reply = await http.post(f"{url}/v1/completions", json=payload)
            data = reply.json()
            if reply.status_code != 200:
                self.error = str(data)
            else:
                self.text.append(data["choices"][0]["text"])
                self.finish = data["choices"][0]["finish_reason"]
            return self
        last = time.monotonic()
        async with http.stream("POST", f"{url}/v1/completions", json=payload) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = str(chunk["error"])
                    continue
                for choice in chunk["choices"]:
                    self.text.append(choice.get("text") or "")
                    self.finish = choice.get("finish_reason") or self.finish
                now = time.monotonic()
                self.gaps.append(now - last)
                last = now
        return self


async def run_all(
    url: str, model: str, n: int, fault=None, max_tokens: int = MAX_TOKENS
) -> list[Client]:
    clients = [Client() for _ in range(n)]
    async with httpx.AsyncClient(timeout=120) as http:
        tasks = [
            asyncio.create_task(c.run(http, url, body(model, i, i % 4 != 3, max_tokens)))
            for i, c in enumerate(clients)
        ]
        if fault is not None:
            # once every stream has some text, the fault strikes mid-answer
            while sum(1 for c in clients if c.text) < n - n // 4:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(fault)
        await asyncio.gather(*tasks)
    return clients


def assert_intact(clients: list[Client], reference: list[Client]) -> None:
    for i, (c, ref) in enumerate(zip(clients, reference)):
        assert c.error is None, (i, c.error)
        assert c.finish == "length", (i, c.finish)
        assert "".join(c.text) == "".join(ref.text), i


def test_scheduler_sigkill_mid_stream_every_stream_completes(stack_factory):
    stack = stack_factory(env={"ALISE_RESUME_TIMEOUT_S": "60"})
    stack.watch()  # restarts the killed scheduler, as `alise serve` does
    n = 16
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))
    assert all(c.error is None and c.text for c in reference)
    pid = stack.pid("scheduler-0")
    clients = asyncio.run(
        run_all(stack.url, stack.model_id, n, lambda: stack.signal("scheduler-0", signal.SIGKILL))
    )
    assert stack.pid("scheduler-0") != pid  # it really died and came back
    assert_intact(clients, reference)
    assert max(max(c.gaps) for c in clients if c.gaps) > 0.2  # the pause the clients saw


def test_leader_sigkill_standby_takes_over_within_the_lease_bound(stack_factory):
    stack = stack_factory(num_schedulers=2, env={"ALISE_RESUME_TIMEOUT_S": "60"})
    n = 8
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))
    killed_at = []

    def kill_leader() -> None:
        killed_at.append(stack.leader())
        stack.signal(killed_at[0], signal.SIGKILL)  # not restarted: the standby must lead

    clients = asyncio.run(run_all(stack.url, stack.model_id, n, kill_leader))
    assert stack.leader() != killed_at[0]  # the standby leads now
    assert_intact(clients, reference)
    worst_pause = max(max(c.gaps) for c in clients if c.gaps)
    assert 0.5 < worst_pause < 3.0 + 0.5 + 4.0  # lease TTL + half a renewal + recovery slack
