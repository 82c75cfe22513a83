"""A step's metadata in one int32 buffer: filled on the host (pinned on CUDA), copied to the
device in one non-blocking copy, read there through views. No per-step allocation.

Layout (int32; every segment starts on a 32-element = 128-byte boundary, so Triton's pointer
alignment specialisation is the same on every step):

    tokens [T]  positions [T]  slots [T]  tok_req [T]  req_ctx [R]  req_slot [R]
    logits_rows [S]  tiles [4, Q]  tables [R, W]

T packed tokens of R requests (decodes first, then prefill chunks, as `build_batch` orders
them without context groups), S rows whose logits are sampled, Q query tiles of the Triton
attention kernel (`triton_plan.tile_table`), W block-table columns. The
tables come last so a copy can stop after the rows in use (CUDA-graph buckets pad a decode
batch with rows whose tables are never read past column 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np
import torch

from services.common.arith import ceil_div
from services.executor.ragged_batch import RunArrays, StepBatch, TokenRun

ALIGN = 32  # int32 elements: 128 bytes
SEGMENTS = ("tokens", "positions", "slots", "tok_req", "req_ctx", "req_slot", "logits_rows")


def _aligned(n: int) -> int:
    return ceil_div(n, ALIGN) * ALIGN


@dataclass(frozen=True)
class MetaLayout:
    num_tokens: int
    num_reqs: int
    num_logits: int
    width: int  # block-table columns
    num_tiles: int = 0  # query tiles of the attention kernel (triton_plan.tile_table)

    def lengths(self) -> dict[str, int]:
        t, r = self.num_tokens, self.num_reqs
        return {
            "tokens": t,
            "positions": t,
            "slots": t,
            "tok_req": t,
            "req_ctx": r,
            "req_slot": r,
            "logits_rows": self.num_logits,
            "tiles": 4 * self.num_tiles,
            "tables": r * self.width,
        }

    def offsets(self) -> dict[str, int]:
        return _offsets(self)

    @property
    def size(self) -> int:
        return self.offsets()["tables"] + self.num_reqs * self.width

    def copy_size(self, rows: int) -> int:
        """Elements to copy so the first `rows` block-table rows arrive."""
        return self.offsets()["tables"] + rows * self.width


@lru_cache(maxsize=256)
def _offsets(layout: MetaLayout) -> dict[str, int]:
    """Segment offsets of a layout (cached: graph buckets reuse a few layouts every step;
    callers only read the dict)."""
    out, at = {}, 0
    for name, n in layout.lengths().items():
        out[name] = at
        at += _aligned(n)
    return out


def order_runs(runs: list[TokenRun]) -> list[TokenRun]:
    """Decodes (one token) first, then prefill chunks, each in the given order."""
    decodes = [r for r in runs if len(r.token_ids) == 1]
    if len(decodes) == len(runs):
        return decodes
    return decodes + [r for r in runs if len(r.token_ids) > 1]


def table_width(runs: list[TokenRun], block_size: int) -> int:
    """Block-table columns the runs need (their contexts after this step)."""
    return max(ceil_div(r.ctx_after, block_size) for r in runs)


def pad_decodes(runs: list[TokenRun], bucket: int, pad_block: int) -> list[TokenRun]:
    """`runs` (decodes) followed by padding decodes up to `bucket` rows: token 0 at position
    0 of `pad_block`, a block no request owns; nothing is sampled from them."""
    if bucket < len(runs):
        raise ValueError(f"{len(runs)} decodes do not fit a bucket of {bucket}")
    pad = TokenRun("", [0], 0, [pad_block], block_array=np.array([pad_block], dtype=np.int64))
    return runs + [pad] * (bucket - len(runs))


def _flat_tables(runs: list[TokenRun], nb: np.ndarray) -> np.ndarray:
    """The first nb[i] blocks of every run's table, concatenated (from the runs' int64
    block arrays where every run has one: no per-block conversion)."""
    arrays = [r.block_array for r in runs]
    if all(a is not None for a in arrays):
        return np.concatenate([a[:k] for a, k in zip(arrays, nb.tolist(), strict=True)])
    tables = (r.block_table[:k] for r, k in zip(runs, nb.tolist(), strict=True))
    return np.fromiter(chain.from_iterable(tables), np.int64, int(nb.sum()))


def fill_meta(
    buf: np.ndarray,
    layout: MetaLayout,
    runs: list[TokenRun],
    block_size: int,
    tiles: torch.Tensor | None = None,
    arrays: RunArrays | None = None,
) -> None:
    """Write the metadata of `runs` (in packed order) into the int32 array `buf` at `layout`,
    with the attention kernel's query `tiles` [4, Q] when given (`arrays`: the runs'
    RunArrays when already read). Block-table rows are zero past each request's last
    needed block."""
    off, n = layout.offsets(), layout.lengths()
    r_count, width = len(runs), layout.width
    a = arrays if arrays is not None else RunArrays.of(runs)
    q, before = a.q, a.before
    ends = np.cumsum(q)
    tok_req = np.repeat(np.arange(r_count), q)
    positions = np.arange(int(ends[-1])) - (ends - q)[tok_req] + before[tok_req]
    nb = ceil_div(before + q, block_size)  # elementwise on the arrays
    flat = _flat_tables(runs, nb)
    tables = buf[off["tables"] : off["tables"] + n["tables"]].reshape(r_count, width)
    tables[:] = 0
    tables[
        np.repeat(np.arange(r_count), nb), np.arange(flat.size) - np.repeat(np.cumsum(nb) - nb, nb)
    ] = flat
    values = {
        "tokens": np.fromiter(chain.from_iterable([r.token_ids for r in runs]), np.int64),
        "positions": positions,
        "slots": tables[tok_req, positions // block_size] * block_size + positions % block_size,
        "tok_req": tok_req,
        "req_ctx": before + q,
        "req_slot": np.maximum(a.staging, 0),
        "logits_rows": (ends - 1)[a.sample],
    }
    if tiles is not None:
        values["tiles"] = tiles.numpy().reshape(-1)
    for name, v in values.items():
        buf[off[name] : off[name] + v.size] = v


@dataclass
class StepMeta:
    """Device views of one step's metadata."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tok_req: torch.Tensor
    req_ctx: torch.Tensor
    req_slot: torch.Tensor
    logits_rows: torch.Tensor
    tiles: torch.Tensor  # [4, Q]
    tables: torch.Tensor  # [R, W]

    def triton(self) -> dict[str, torch.Tensor]:
        """The per-step metadata dict of the Triton backend (TritonAttention.use)."""
        return {
            "tiles": self.tiles,
            "tables": self.tables,
            "slots": self.slots,
            "req_ctx": self.req_ctx,
            "req_slot": self.req_slot,
        }

    def batch(self, runs: list[TokenRun], block_size: int) -> StepBatch:
        """A StepBatch over these views (no context groups: the Triton kernels need none)."""
        return StepBatch(
            runs,
            self.tokens,
            self.positions,
            self.slots,
            [],
            self.logits_rows,
            [r.request_id for r in runs if r.sample],
            block_size,
        )


class StepBuffers:
    """A host buffer (pinned when `pin`) and its device twin. `stage` fills the host side and
    issues one copy; the host side is reused only after that copy has completed (an event on
    CUDA), so steps never allocate. `growable=False` keeps the device addresses fixed (the
    buffers CUDA graphs were captured on)."""

    def __init__(self, capacity: int, device: torch.device, pin: bool, growable: bool) -> None:
        self.device, self.pin, self.growable = device, pin, growable
        self.copied: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=self.pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        return int(self.host.shape[0])

    def stage(
        self,
        layout: MetaLayout,
        runs: list[TokenRun],
        block_size: int,
        rows: int | None = None,
        tiles: torch.Tensor | None = None,
        arrays: RunArrays | None = None,
    ) -> StepMeta:
        """Fill and copy the metadata of `runs` (and the kernel's query `tiles`); `rows`: copy
        only the first block-table rows (default all); `arrays`: the runs' RunArrays."""
        if layout.size > self.capacity:
            if not self.growable:
                raise ValueError(f"step metadata of {layout.size} exceeds {self.capacity}")
            self._allocate(2 * layout.size)
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has read the host buffer
        fill_meta(self.host_np, layout, runs, block_size, tiles, arrays)
        n = layout.copy_size(layout.num_reqs if rows is None else rows)
        self.dev[:n].copy_(self.host[:n], non_blocking=self.pin)
        if self.device.type == "cuda":
            self.copied = self.copied or torch.cuda.Event()
            self.copied.record()
        return self.views(layout)

    def views(self, layout: MetaLayout) -> StepMeta:
        off, n = layout.offsets(), layout.lengths()
        v = {name: self.dev[off[name] : off[name] + n[name]] for name in SEGMENTS}
        tiles = self.dev[off["tiles"] : off["tiles"] + n["tiles"]].view(4, layout.num_tiles)
        tables = self.dev[off["tables"] : off["tables"] + n["tables"]]
        return StepMeta(**v, tiles=tiles, tables=tables.view(layout.num_reqs, layout.width))
