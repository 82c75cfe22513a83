"""Hybrid polling in the executor loop (`ExecutorLoop._wait_hot`), on the real event loop."""

import asyncio
import time

from services.scheduler.loop.executor_loop import ExecutorLoop, LoopTiming
from services.scheduler.service import SchedulerService


def _loop(spin_ms: float) -> ExecutorLoop:
    # only the timing is read by _wait_hot: no host call, and the client's channel is unused
    host: SchedulerService = None  # type: ignore[assignment]
    return ExecutorLoop("127.0.0.1:9", host, LoopTiming(step_spin_ms=spin_ms))


async def test_wait_hot_returns_once_the_step_ends():
    loop = _loop(5)
    ends = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.04, ends.set_result, "result")
    start = time.perf_counter()
    await loop._wait_hot(ends, start + 0.04)
    assert ends.done()
    assert time.perf_counter() - start < 0.04 + 0.02
    await loop.client.close()


async def test_wait_hot_gives_up_after_three_windows_and_can_be_off():
    loop = _loop(5)
    never = asyncio.get_running_loop().create_future()
    start = time.perf_counter()
    await loop._wait_hot(never, start + 0.02)  # spins from +15 ms until +30 ms
    elapsed = time.perf_counter() - start
    assert not never.done() and 0.029 <= elapsed < 0.06
    off = _loop(0)
    start = time.perf_counter()
    await off._wait_hot(never, start + 1.0)
    assert time.perf_counter() - start < 0.01
    await loop.client.close()
    await off.client.close()


async def test_the_hang_deadline_scales_with_the_predicted_step_time():
    host: SchedulerService = None  # type: ignore[assignment]
    timing = LoopTiming(step_timeout_s=60, step_timeout_factor=10, step_timeout_floor_s=2)
    loop = ExecutorLoop("127.0.0.1:9", host, timing)
    assert loop.step_deadline(0.01) == 2  # short Steps: the floor
    assert loop.step_deadline(0.5) == 5.0  # 10 x the prediction
    assert loop.step_deadline(30) == 60  # never past the hard cap
    loop._model_ratio = 3.0  # this executor runs 3x slower than its cost model says
    assert loop.step_deadline(0.5) == 15.0
    await loop.client.close()
