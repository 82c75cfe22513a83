"""Redis failures under load, over HTTP through a real gateway: Redis SIGKILLed and restarted
mid-stream (the scheduler notices the new server and rewrites its state: every request ends
intact), Redis paused (a new request is held for ALISE_ADMISSION_HOLD_S, then gets a 503 with
Retry-After; running ones finish once it is back), and Redis and the scheduler both restarted (the scheduler rebuilds from the AOF)."""

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


def test_redis_paused_holds_new_requests_then_refuses_them_with_503(stack_factory):
    """While Redis is paused a new request is held (ALISE_ADMISSION_HOLD_S, here 2 s) and then
    refused with a 503 and Retry-After; with the one hold place (ALISE_ADMISSION_HOLD_MAX=1)
    taken, another is refused at once. Running streams finish once Redis is back."""
    stack = stack_factory(env={"ALISE_ADMISSION_HOLD_S": "2", "ALISE_ADMISSION_HOLD_MAX": "1"})
    n = 8
    reference = asyncio.run(run_all(stack.url, stack.model_id, n))
    refused: list[tuple[float, httpx.Response]] = []

    def one(i: int) -> None:
        started = time.monotonic()
        reply = httpx.post(
            f"{stack.url}/v1/completions", json=body(stack.model_id, 90 + i, False), timeout=30
        )
        refused.append((time.monotonic() - started, reply))

    def pause_redis() -> None:
        stack.redis.pause()
        try:
            time.sleep(4.0)  # past the Redis client timeout: the writer is failing by now
            both = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in both:
                t.start()
            for t in both:
                t.join(30)
            time.sleep(4.0)  # ~10 s paused in all
        finally:
            stack.redis.resume()

    clients = asyncio.run(run_all(stack.url, stack.model_id, n, pause_redis))
    (quick_s, quick), (held_s, held) = sorted(refused, key=lambda r: r[0])
    for reply in (quick, held):
        assert reply.status_code == 503, reply.text
        assert reply.headers["Retry-After"] == "2"
        assert "Redis" in reply.json()["error"]["message"]
    assert "already waiting" in quick.json()["error"]["message"]
    assert "within 2s" in held.json()["error"]["message"]
    assert quick_s < held_s and 2.0 <= held_s < 6.0, (quick_s, held_s)
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
