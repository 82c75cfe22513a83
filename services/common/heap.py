"""Hand memory that the C allocator keeps after `free()` back to the system (glibc).

glibc's malloc does not return freed memory to the kernel unless it lies at the top of an
arena's heap: chunks freed in the middle stay resident, and each thread that allocates gets an
arena of its own (up to 8 per core). A process whose threads allocate and free buffers of
varying sizes (the predictor: torch's embedding of prompts of every length in worker threads,
Qdrant Edge's segments) therefore shows a resident set that holds what it used at its peak
and creeps up in a sawtooth as arenas fragment, with no live object behind it.
`malloc_trim(0)` releases the free pages of every arena (`madvise(MADV_DONTNEED)`), which is
what `trim()` calls. Measured on the predictor (`alise bench predictor-memory`, README): about
700 MiB released after the seed, and a flat anonymous set under steady Predict/Observe load
when trimmed every minute.

`Trimmer` runs it in a worker thread every `every_s` seconds. Elsewhere than glibc (musl,
macOS) `trim()` does nothing and returns None.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from functools import cache

from services.common.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        func = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    func.argtypes = [ctypes.c_size_t]
    func.restype = ctypes.c_int
    return func


def available() -> bool:
    """Whether this process's C library has `malloc_trim` (glibc)."""
    return _malloc_trim() is not None


def trim() -> bool | None:
    """Release the allocator's free pages to the system: True when some were released, False
    when none were, None when the C library cannot (not glibc)."""
    func = _malloc_trim()
    if func is None:
        return None
    return bool(func(0))


class Trimmer:
    """Calls `trim()` off the event loop every `every_s` seconds and once more on `now()`
    (`every_s` 0: never, not even then); `on_trim(seconds)` hears the duration of each.
    `trims` counts the calls made."""

    def __init__(self, every_s: float, on_trim: Callable[[float], None] | None = None) -> None:
        self.every_s = every_s
        self.on_trim = on_trim
        self.trims = 0
        self.enabled = every_s > 0 and available()
        self._task: asyncio.Task[None] | None = None
        if self.enabled:
            self._task = asyncio.create_task(self._run())

    async def now(self) -> bool | None:
        """Trim once, now (after a burst that freed much: the predictor's seed); None when
        disabled or not glibc."""
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        released = await asyncio.to_thread(trim)
        self.trims += 1
        if self.on_trim is not None:
            self.on_trim(time.perf_counter() - t0)
        return released

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.now()
            except Exception:  # never let a failed trim stop the service's loop
                log.exception("malloc_trim failed")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
