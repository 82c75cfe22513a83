"""The packed ragged batch of one forward pass, and its metadata, built once per step.

All scheduled tokens are concatenated into one sequence of T tokens. Requests computing exactly
one token (decodes) come first, then requests computing several (prefill chunks); each
request's tokens are contiguous. Attention runs per group on a padded view of that group:
decodes as [B, 1] queries, prefill chunks as [B, Qmax] queries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Chunk:
    """One request's share of the forward pass."""
    request_id: str
    token_ids: list[int]          # the tokens computed now
    ctx_before: int               # tokens already in the KV cache
    block_table: list[int]        # device block ids, enough for ctx_before + len(token_ids)
    staging_slot: int = -1        # INT8 KV: the request's exact buffer for its open block
    sample: bool = False          # compute logits at its last token

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def ctx_after(self) -> int:
        return self.ctx_before + self.q_len


@dataclass
class Group:
    """A padded sub-batch of requests: decodes (Qmax = 1) or prefill chunks."""
    chunks: list[Chunk]
    row_start: int                # first packed row of this group
    q_pos: torch.Tensor           # [B, Qmax] position of each query (padding: -1)
    q_rows: torch.Tensor          # [B, Qmax] packed row of each query (padding: row_start)
    q_valid: torch.Tensor         # [B, Qmax] bool
    ctx_after: torch.Tensor       # [B] tokens in the cache after this step's write
    tables: torch.Tensor          # [B, NBmax] block ids (padding: 0)
    extra: dict = field(default_factory=dict)  # per-step data the KV cache attaches (masks)

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def q_max(self) -> int:
        return self.q_pos.shape[1]


@dataclass
class StepBatch:
    chunks: list[Chunk]           # in packed order
    token_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    slot_mapping: torch.Tensor    # [T] flat cache slot (block * block_size + offset)
    groups: list[Group]           # non-empty groups, in packed order
    logits_rows: torch.Tensor     # [S] packed rows whose logits are needed
    sample_ids: list[str]         # request id of each logits row
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def _group(chunks: list[Chunk], row_start: int, block_size: int, device) -> Group:
    q_max = max(c.q_len for c in chunks)
    nb_max = max(-(-c.ctx_after // block_size) for c in chunks)
    q_pos = torch.full((len(chunks), q_max), -1, dtype=torch.long)
    q_rows = torch.full((len(chunks), q_max), row_start, dtype=torch.long)
    tables = torch.zeros((len(chunks), nb_max), dtype=torch.long)
    row = row_start
    for i, c in enumerate(chunks):
        q_pos[i, :c.q_len] = torch.arange(c.ctx_before, c.ctx_after)
        q_rows[i, :c.q_len] = torch.arange(row, row + c.q_len)
        nb = -(-c.ctx_after // block_size)
        tables[i, :nb] = torch.tensor(c.block_table[:nb], dtype=torch.long)
        row += c.q_len
    ctx_after = torch.tensor([c.ctx_after for c in chunks], dtype=torch.long)
    return Group(chunks, row_start, q_pos.to(device), q_rows.to(device), (q_pos >= 0).to(device),
                 ctx_after.to(device), tables.to(device))


def build_batch(chunks: list[Chunk], block_size: int, device: torch.device) -> StepBatch:
    """Order decodes first, then prefill chunks, and precompute every index tensor."""
    decodes = [c for c in chunks if c.q_len == 1]
    prefills = [c for c in chunks if c.q_len > 1]
    ordered = decodes + prefills
    tokens, positions, slots, logits_rows, sample_ids = [], [], [], [], []
    for c in ordered:
        tokens.extend(c.token_ids)
        for pos in range(c.ctx_before, c.ctx_after):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        if c.sample:
            logits_rows.append(len(tokens) - 1)
            sample_ids.append(c.request_id)
    groups = []
    if decodes:
        groups.append(_group(decodes, 0, block_size, device))
    if prefills:
        groups.append(_group(prefills, len(decodes), block_size, device))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepBatch(ordered, as_tensor(tokens), as_tensor(positions), as_tensor(slots), groups,
                     as_tensor(logits_rows), sample_ids, block_size)
