"""cancel_and_wait ends tasks that swallow a cancellation (as grpc aio calls and 3.11's
asyncio.wait_for can)."""

import asyncio

from services.common.tasks import cancel_and_wait


async def test_ends_a_task_that_swallows_cancellations():
    swallowed = 0

    async def stubborn():
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, retry_s=0.01), timeout=5)
    assert task.done() and swallowed == 3


async def test_finished_and_missing_tasks_are_fine():
    async def quick():
        return 7

    task = asyncio.create_task(quick())
    await task
    await cancel_and_wait(task)
    await cancel_and_wait(None)
    failed = asyncio.create_task(asyncio.sleep(0, result=None))
    await cancel_and_wait(failed)
    assert failed.done()
