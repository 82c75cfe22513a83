"""Redis failures under load, over HTTP through a real gateway: Redis SIGKILLed and restarted
mid-stream (the scheduler notices the new server and rewrites its state: every request ends
intact), Redis paused (new requests get a 503 with Retry-After, running ones finish once it is
back), and Redis and the scheduler both restarted (the scheduler rebuilds from the AOF)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx

from tests.integration.test_gateway_reattach import assert_intact, body, run_all


def test_redis_sigkill_and_restart_mid_load_every_request_completes(stack_factory):
    stack = stack_factory()
    n = 12
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))

    def crash_redis() -> None:
        stack.redis.kill()
        time.sleep(1.0)
        stack.redis.start()

    clients = asyncio.run(run_all(stack.url, stack.model_id, n, crash_redis))
    assert_intact(clients, reference)
    assert max(max(c.gaps) for c in clients if c.gaps) > 0.5  # streams paused meanwhile
    log = (stack.run_dir / "logs" / "scheduler-0.log").read_text()
    assert "redis restarted: rewriting the full state" in log


def test_redis_paused_refuses_new_requests_with_503_and_finishes_running_ones(stack_factory):
    stack = stack_factory()
    n = 8
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))
    refused: list[httpx.Response] = []

    def pause_redis() -> None:
        stack.redis.pause()
        try:
            time.sleep(4.0)  # past the Redis client timeout: the writer is failing by now
            started = time.monotonic()
            reply = httpx.post(
                f"{stack.url}/v1/completions", json=body(stack.model_id, 99, False), timeout=30
            )
            refused.append(reply)
            assert time.monotonic() - started < 5.0
            time.sleep(6.0)  # ~10 s paused in all
        finally:
            stack.redis.resume()

    clients = asyncio.run(run_all(stack.url, stack.model_id, n, pause_redis))
    assert refused[0].status_code == 503, refused[0].text
    assert refused[0].headers["Retry-After"] == "2"
    assert "Redis" in refused[0].json()["error"]["message"]
    assert_intact(clients, reference)
    after = httpx.post(f"{stack.url}/v1/completions", json=body(stack.model_id, 1, False))
    assert after.status_code == 200  # admitting again


def test_redis_and_scheduler_restarted_together_resume_from_the_aof(stack_factory):
    stack = stack_factory(env={"ALISE_RESUME_TIMEOUT_S": "60"})
    stack.watch()
    n, long = 8, 600
    reference = asyncio.run(run_all(stack.url, stack.model_id, n, max_tokens=long))
    done = threading.Event()

    def crash_both() -> None:
        time.sleep(1.2)  # > the AOF's one-second flush: most of what was streamed is on disk
        stack.signal("scheduler-0", signal.SIGKILL)
        stack.redis.kill()
        stack.redis.start()
        done.set()

    clients = asyncio.run(run_all(stack.url, stack.model_id, n, crash_both, max_tokens=long))
    assert done.is_set()
    assert_intact(clients, reference)
    assert max(max(c.gaps) for c in clients if c.gaps) > 1.0  # streams were cut mid-answer
