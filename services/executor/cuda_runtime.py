"""The step path on a CUDA device: one metadata copy in, one result copy out, no device-wide
synchronisation, CUDA graphs for decode-only steps.

Per step:
1. metadata: with the Triton backend and a full-precision pool ("packed"), every index the
   forward pass reads (tokens, positions, slots, block tables, per-token request) is written
   into one pinned host buffer and copied to the device in one non-blocking copy
   (step_buffers.py); otherwise (torch backend, INT8 pool) `build_batch` as on CPU;
2. forward: a decode-only step of n <= max bucket requests replays the CUDA graph of the
   smallest bucket >= n, its batch padded (cuda_graphs.py); any other step runs eagerly;
3. sampling on the device for the whole batch (sampler.sample_batch), tokens, logprobs and
   top alternatives packed into one tensor;
4. one device-to-host copy of that tensor into a pinned buffer, then a wait on the event
   recorded after it (the only wait of the step).

Forward and sampling times come from CUDA events around them. Off CUDA (tests, with Triton's
interpreter) the same code runs without pinning or events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.arith import ceil_div
from services.executor.cuda_graphs import Body, Capture, DecodeGraphs, eager_capture, graph_buckets
from services.executor.ragged_batch import RunArrays, StepBatch, TokenRun, build_batch
from services.executor.step_buffers import (
    MetaLayout,
    StepBuffers,
    StepMeta,
    order_runs,
    pad_decodes,
)

if TYPE_CHECKING:
    from services.executor.attention_backends import Attention
    from services.executor.kv_pool import KVCache
    from services.executor.runner import ModelRunner
    from services.executor.triton_attention import TritonAttention

STEP_RUNTIMES = ("auto", "packed", "classic")


@dataclass(frozen=True)
class RuntimeOptions:
    """How the engine runs steps on a GPU (ExecutorSettings' CUDA knobs)."""

    gpu_memory_utilization: float | None = None  # None: the pool from kv_memory_gb
    cuda_graphs: bool = True
    graph_max_batch: int = 512
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 512
    step_runtime: str = "auto"  # packed metadata: auto (CUDA + Triton + fp KV) | packed | classic
    graph_split_kv: bool = True  # small decode batches split KV by their graph bucket (packed)

    def __post_init__(self) -> None:
        if self.step_runtime not in STEP_RUNTIMES:
            raise ValueError(f"step_runtime must be one of {STEP_RUNTIMES}")


def uses_packed(options: RuntimeOptions, device: torch.device, backend: str, kv_dtype: str) -> bool:
    """Whether steps stage their metadata in one buffer (Triton backend, full-precision KV)."""
    if options.step_runtime == "classic" or backend != "triton" or kv_dtype != "auto":
        return False
    return options.step_runtime == "packed" or device.type == "cuda"


def uses_graphs(options: RuntimeOptions, packed: bool) -> bool:
    """CUDA graphs need the packed metadata (static buffers) and at least one bucket."""
    return packed and options.cuda_graphs and options.graph_max_batch > 0


class StepClock:
    """Forward and sampling times of a step: CUDA events (read after the step's one wait),
    or the host clock off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else []
        self.marks = [0.0, 0.0, 0.0]

    def mark(self, i: int) -> None:
        """0: before the forward pass, 1: after it, 2: after the result copy."""
        if self.cuda:
            self.events[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def wait(self) -> None:
        if self.cuda:
            self.events[2].synchronize()

    def times(self) -> tuple[float, float]:
        """(forward_s, sample_s), after `wait`."""
        if self.cuda:
            e = self.events
            return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3
        m = self.marks
        return m[1] - m[0], m[2] - m[1]


class DeviceRuntime:
    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCache,
        attn: Attention,
        block_size: int,
        max_model_len: int,
        graph_max_batch: int,
        packed: bool,
        pad_block: int | None,
    ) -> None:
        """packed: stage metadata in one buffer (see uses_packed); pad_block: a pool block no
        request owns, for padding graph batches (None: no CUDA graphs)."""
        self.runner, self.cache, self.attn, self.bs = runner, cache, attn, block_size
        self.device = cache.device
        self.pin = self.device.type == "cuda"
        self.packed, self.pad_block = packed, pad_block
        self.width = ceil_div(max_model_len, block_size)  # block-table columns of a graph
        buckets = graph_buckets(graph_max_batch) if pad_block is not None else ()
        self.graphs = DecodeGraphs(buckets)
        self.buffers = StepBuffers(1 << 14, self.device, self.pin, growable=True)
        self.graph_buffers: StepBuffers | None = None
        self.result = torch.zeros(1 << 12, dtype=torch.float64, pin_memory=self.pin)
        self.generator = torch.Generator(device=self.device)
        self.clock = StepClock(self.device)

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self, runs: list[TokenRun], all_logits: bool, group_cost: int | None
    ) -> tuple[StepBatch, torch.Tensor]:
        """Enqueue the forward pass: (the batch in packed order, logits of its sampled rows,
        or of every row with all_logits)."""
        if not self.packed:
            return self._classic(runs, all_logits, group_cost)
        ordered = order_runs(runs)
        if not all_logits and ordered[-1].q_len == 1:
            bucket = self.graphs.bucket_for(len(ordered))
            if bucket is not None:
                return self._replay(ordered, bucket)
        return self._eager(ordered, all_logits)

    def _classic(
        self, runs: list[TokenRun], all_logits: bool, group_cost: int | None
    ) -> tuple[StepBatch, torch.Tensor]:
        batch = build_batch(runs, self.bs, self.device, group_cost)
        if all_logits:
            batch.logits_rows = torch.arange(batch.num_tokens, device=self.device)
        self.cache.prepare(batch)
        self.attn.prepare(batch)
        return batch, self._logits(batch)

    def _eager(self, ordered: list[TokenRun], all_logits: bool) -> tuple[StepBatch, torch.Tensor]:
        arrays = RunArrays.of(ordered)
        tokens, samples = int(arrays.q.sum()), int(arrays.sample.sum())
        step = self._triton().plan_runs(ordered, self.bs, arrays=arrays)
        width = ceil_div(int((arrays.before + arrays.q).max()), self.bs)  # table_width
        layout = MetaLayout(tokens, len(ordered), samples, width, step.num_tiles)
        meta = self.buffers.stage(layout, ordered, self.bs, tiles=step.tiles, arrays=arrays)
        batch = meta.batch(ordered, self.bs)
        if all_logits:
            batch.logits_rows = torch.arange(tokens, device=self.device)
        self._triton().use(step, meta.triton(), tokens)
        return batch, self._logits(batch)

    def _logits(self, batch: StepBatch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.runner.forward(batch, self.cache, self.attn)  # [T, hidden]
            return self.runner.logits(hidden[batch.logits_rows])  # [S, V]

    def stage_replay(self, ordered: list[TokenRun], bucket: int) -> tuple[StepMeta, int]:
        """The host-side preparation of a decode step replayed as `bucket`'s graph: pad, plan,
        fill the metadata and start its copy. Returns the views and the sampled row count."""
        assert self.graph_buffers is not None and self.pad_block is not None
        padded = pad_decodes(ordered, bucket, self.pad_block)
        arrays = RunArrays.of(padded)
        step = self._triton().plan_runs(
            padded, self.bs, splits=1, arrays=arrays
        )  # the graph holds its split factor: only the tiles are read
        layout = self._graph_layout(bucket)
        rows = len(ordered)
        meta = self.graph_buffers.stage(
            layout, padded, self.bs, rows=rows, tiles=step.tiles, arrays=arrays
        )
        return meta, int(arrays.sample[:rows].sum())

    def _replay(self, ordered: list[TokenRun], bucket: int) -> tuple[StepBatch, torch.Tensor]:
        n = len(ordered)
        meta, samples = self.stage_replay(ordered, bucket)
        logits = self.graphs.replay(bucket)  # [bucket, V]
        if samples == n:
            logits = logits[:n]
        else:
            logits = logits.index_select(0, meta.logits_rows[:samples])
        batch = meta.batch(ordered, self.bs)
        batch.token_ids, batch.positions = meta.tokens[:n], meta.positions[:n]
        return batch, logits

    # -- graphs -------------------------------------------------------------------------------
    def _graph_layout(self, bucket: int) -> MetaLayout:
        """A bucket's layout: its decodes, one query tile each (a tile never spans requests)."""
        return MetaLayout(bucket, bucket, bucket, self.width, num_tiles=bucket)

    def _triton(self) -> TritonAttention:
        """The packed path's attention backend (uses_packed: always Triton)."""
        from services.executor.triton_attention import TritonAttention

        assert isinstance(self.attn, TritonAttention), "packed steps need the Triton backend"
        return self.attn

    def capture_graphs(self, capture: Capture | None = None) -> None:
        """Capture every bucket (default: real CUDA graphs; `eager_capture` off CUDA)."""
        if not self.graphs.buckets:
            return
        if capture is None:
            from services.executor.cuda_graphs import cuda_capture

            capture = cuda_capture() if self.device.type == "cuda" else eager_capture
        largest = self._graph_layout(max(self.graphs.buckets))
        self.graph_buffers = StepBuffers(largest.size, self.device, self.pin, growable=False)
        self.graphs.capture_all(capture, self._graph_body)

    def _graph_body(self, bucket: int) -> Body:
        assert self.graph_buffers is not None and self.pad_block is not None
        padded = pad_decodes([], bucket, self.pad_block)
        step = self._triton().plan_runs(padded, self.bs)  # its split factor: bucket_splits
        meta = self.graph_buffers.stage(
            self._graph_layout(bucket), padded, self.bs, tiles=step.tiles
        )
        batch = meta.batch(padded, self.bs)
        triton_meta = meta.triton()

        def body() -> torch.Tensor:
            self._triton().use(step, triton_meta, bucket)
            with torch.inference_mode():
                return self.runner.logits(self.runner.forward(batch, self.cache, self.attn))

        return body

    # -- the one transfer back ----------------------------------------------------------------
    def fetch(self, packed: torch.Tensor | None) -> list[list[float]]:
        """Copy the packed samples to the host (one copy) and wait for the step to finish."""
        rows: list[list[float]] = []
        if packed is not None:
            n = packed.numel()
            if n > self.result.numel():
                self.result = torch.zeros(2 * n, dtype=torch.float64, pin_memory=self.pin)
            host = self.result[:n].view(packed.shape)
            host.copy_(packed, non_blocking=self.pin)
        self.clock.mark(2)
        self.clock.wait()
        if packed is not None:
            rows = host.tolist()
        return rows
