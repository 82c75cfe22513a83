"""Giving the allocator's free pages back (services.common.heap), on the real C library."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from services.common import heap

pytestmark = pytest.mark.skipif(not heap.available(), reason="malloc_trim is glibc's")

# In a fresh interpreter: 1,500 blocks of 64 KiB (below glibc's mmap threshold, so they come
# from the heap), each written to, then all freed but the last, which keeps the heap's top
# in use so free() cannot shrink it. The ~94 MiB freed stay resident until malloc_trim.
CHILD = """
import ctypes, json, sys
from services.common import heap

def anon_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1])

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 * 1024) for _ in range(1500)]
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
for b in blocks[:-1]:
    libc.free(b)
before = anon_kib()
released = heap.trim()
print(json.dumps({"before": before, "after": anon_kib(), "released": released}))
"""


def test_trim_returns_the_freed_heap_to_the_system():
    import json

    # glibc's defaults (a 128 KiB mmap threshold): no MALLOC_* tuning from the caller's env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    got = json.loads(out.stdout)
    freed_kib = 1499 * 64
    assert got["released"] is True
    # the pages of the freed blocks leave the resident set (most of them: some of the freed
    # space holds the allocator's own bookkeeping and stays)
    assert got["before"] - got["after"] > freed_kib // 2, got


async def test_trimmer_off_never_trims():
    seen: list[float] = []
    trimmer = heap.Trimmer(0, seen.append)
    assert await trimmer.now() is None
    await trimmer.stop()
    assert trimmer.trims == 0 and seen == []


async def test_trimmer_trims_on_request_and_periodically():
    seen: list[float] = []
    trimmer = heap.Trimmer(0.01, seen.append)
    try:
        assert await trimmer.now() in (True, False)
        assert trimmer.trims >= 1 and len(seen) == trimmer.trims and min(seen) >= 0
        for _ in range(500):  # the periodic task runs on its own (no time bound asserted)
            if trimmer.trims >= 3:
                break
            await asyncio.sleep(0.02)
        assert trimmer.trims >= 3
    finally:
        await trimmer.stop()
    stopped_at = trimmer.trims
    await asyncio.sleep(0.05)
    assert trimmer.trims == stopped_at  # stop() ends the periodic task
