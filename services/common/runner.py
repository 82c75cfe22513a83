"""Run one gRPC service in the foreground until SIGINT/SIGTERM (the `... serve` commands)."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar


class Stoppable(Protocol):
    """A started service's handle."""

    async def stop(self) -> None: ...


_H = TypeVar("_H", bound=Stoppable)
_T = TypeVar("_T")


def run_until_signal(start: Callable[[], Awaitable[_H]], describe: Callable[[_H], str]) -> int:
    """`start()` returns a handle with `async stop()`; `describe(handle)` is printed once up."""

    async def main() -> None:
        handle = await start()
        settle_gc()
        print(describe(handle), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await handle.stop()

    run_coroutine(main())
    return 0


def settle_gc() -> None:
    """Once a service is up, what start-up allocated (modules, the model's Python objects,
    the services' tables) moves to the collector's permanent generation: the full
    collections a long-running process makes never scan it again."""
    gc.collect()
    gc.freeze()


def run_coroutine(coro: Coroutine[Any, Any, _T], event_loop: str = "uvloop") -> _T:
    """asyncio.run on uvloop (faster callbacks and sockets: the scheduler's per-iteration
    overhead is mostly event-loop work) or on the standard loop."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    if event_loop != "asyncio":
        raise ValueError(f"unknown event loop {event_loop!r}: uvloop or asyncio")
    return asyncio.run(coro)
