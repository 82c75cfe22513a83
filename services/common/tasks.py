"""Stopping background tasks for sure.

A cancellation can be swallowed: grpc's aio call object hands back a result that completed as
the cancel arrived, and `asyncio.wait_for` (Python 3.11) returns a result that raced the
cancel. A background loop that goes on after that would hang whoever awaits its end, so the
cancel is repeated until the task has ended.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

_T = TypeVar("_T")


async def cancel_and_wait(task: asyncio.Task[_T] | None, retry_s: float = 0.5) -> None:
    """Cancel `task` (again every `retry_s` while it runs) and wait for its end."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    await asyncio.gather(task, return_exceptions=True)
