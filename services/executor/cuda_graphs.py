"""CUDA graphs for decode-only steps, one per batch-size bucket (1, 2, 4, ..., 512).

A decode step of n requests runs as the graph of the smallest bucket >= n, its batch padded
with decodes of a padding block (step_buffers.pad_decodes); larger steps, steps with prefill
chunks and steps asking for every position's logits run eagerly. Graphs are captured at
start-up, largest first, sharing one memory pool. A capture failure logs why and leaves every
step eager.

`Capture` is what turns a step body into a replay: `cuda_capture` records a real CUDA graph
(after one eager run, which also compiles the Triton kernels at these shapes); `eager_capture`
replays by running the body again, which is what a graph replay computes, and lets the
bucketing and padding logic run without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

Body = Callable[[], torch.Tensor]  # runs the forward on static buffers, returns the logits
Replay = Callable[[], torch.Tensor]
Capture = Callable[[Body], Replay]


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to `max_batch`, and `max_batch` itself when it is not one."""
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    if max_batch > 0 and out[-1] != max_batch:
        out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows, or None when none does."""
    return next((b for b in sorted(buckets) if b >= n), None)


def eager_capture(body: Body) -> Replay:
    """A replay that runs the body again (CPU, tests)."""
    return body


def cuda_capture(pool: Any = None) -> Capture:
    """Capture into real CUDA graphs sharing the memory `pool` (default: a new one) and one
    side stream (each new stream would get cuBLAS workspaces of its own)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()

    def capture(body: Body) -> Replay:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and allocate outside the capture
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = body()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    """The captured replays by bucket; empty (every step eager) when disabled or failed."""

    def __init__(self, buckets: tuple[int, ...]) -> None:
        self.buckets = buckets
        self.replays: dict[int, Replay] = {}
        self.failure = ""  # why capture failed ("" when it did not)
        self.replayed: dict[int, int] = {}  # bucket -> replays so far

    def capture_all(self, capture: Capture, body_for: Callable[[int], Body]) -> None:
        """Capture every bucket, largest first; on the first failure drop them all."""
        for b in sorted(self.buckets, reverse=True):
            try:
                self.replays[b] = capture(body_for(b))
            except Exception as exc:  # any failure: serve eagerly rather than not at all
                self.replays.clear()
                self.failure = f"bucket {b}: {type(exc).__name__}: {exc}".replace("\n", " ")
                log.warning(
                    "CUDA graph capture failed, running every step eagerly: %s", self.failure
                )
                return

    def bucket_for(self, n: int) -> int | None:
        """The captured bucket a decode step of n requests replays, or None (eager)."""
        return bucket_for(n, tuple(self.replays))

    def replay(self, bucket: int) -> torch.Tensor:
        self.replayed[bucket] = self.replayed.get(bucket, 0) + 1
        return self.replays[bucket]()
