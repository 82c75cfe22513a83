"""The packed ragged batch of one forward pass, and its metadata, built once per step.

All scheduled tokens are concatenated into one sequence of T tokens. Requests computing exactly
one token (decodes) come first, then requests computing several (prefill chunks); each
request's tokens are contiguous. Attention runs per group on a padded view of that group:
decodes as [B, 1] queries, prefill chunks as [B, Qmax] queries, every request's keys padded to
the group's longest context.

Padding is work: 52 decodes with 9,000 context tokens in all but one of 640 read 33,000 keys
per layer in one group. So each kind is split into groups of similar context length, choosing
the split that minimises padded query-key pairs plus a fixed cost per extra group
(`group_cost`, in query-key pairs: what one more attention group costs, ~1024 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.arith import ceil_div


@dataclass
class TokenRun:
    """One request's share of the forward pass: the run of tokens it computes now (a prefill
    chunk, or the one token of a decode)."""

    request_id: str
    token_ids: list[int]  # the tokens computed now
    ctx_before: int  # tokens already in the KV cache
    block_table: list[int]  # device block ids, enough for ctx_before + len(token_ids)
    staging_slot: int = -1  # INT8 KV: the request's exact buffer for its open block
    sample: bool = False  # compute logits at its last token
    block_array: np.ndarray | None = None  # block_table as int64 (RequestState.block_array)

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def ctx_after(self) -> int:
        return self.ctx_before + self.q_len


@dataclass(frozen=True)
class RunArrays:
    """The per-run columns of a step (query tokens, context before, staging slot, sampled)
    as arrays, read from the TokenRuns in one pass: the host-side step preparation
    (tile table, metadata) computes on these instead of each run's attributes."""

    q: np.ndarray  # int64
    before: np.ndarray  # int64
    staging: np.ndarray  # int64
    sample: np.ndarray  # bool

    @classmethod
    def of(cls, runs: list[TokenRun]) -> RunArrays:
        rows = [(len(r.token_ids), r.ctx_before, r.staging_slot, r.sample) for r in runs]
        cols = np.array(rows, dtype=np.int64).reshape(-1, 4).T
        return cls(cols[0], cols[1], cols[2], cols[3].astype(bool))


@dataclass
class Group:
    """A padded sub-batch of requests: decodes (Qmax = 1) or prefill chunks."""

    runs: list[TokenRun]
    row_start: int  # first packed row of this group
    q_pos: torch.Tensor  # [B, Qmax] position of each query (padding: -1)
    q_rows: torch.Tensor  # [B, Qmax] packed row of each query (padding: row_start)
    q_valid: torch.Tensor  # [B, Qmax] bool
    ctx_after: torch.Tensor  # [B] tokens in the cache after this step's write
    tables: torch.Tensor  # [B, NBmax] block ids (padding: 0)
    extra: dict = field(default_factory=dict)  # per-step data the KV cache attaches (masks)

    @property
    def size(self) -> int:
        return len(self.runs)

    @property
    def q_max(self) -> int:
        return self.q_pos.shape[1]


@dataclass
class StepBatch:
    runs: list[TokenRun]  # in packed order
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset)
    groups: list[Group]  # non-empty groups, in packed order
    logits_rows: torch.Tensor  # [S] packed rows whose logits are needed
    sample_ids: list[str]  # request id of each logits row
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def _group(runs: list[TokenRun], row_start: int, block_size: int, device) -> Group:
    q_max = max(r.q_len for r in runs)
    nb_max = max(ceil_div(r.ctx_after, block_size) for r in runs)
    q_pos = torch.full((len(runs), q_max), -1, dtype=torch.long)
    q_rows = torch.full((len(runs), q_max), row_start, dtype=torch.long)
    tables = torch.zeros((len(runs), nb_max), dtype=torch.long)
    row = row_start
    for i, r in enumerate(runs):
        q_pos[i, : r.q_len] = torch.arange(r.ctx_before, r.ctx_after)
        q_rows[i, : r.q_len] = torch.arange(row, row + r.q_len)
        nb = ceil_div(r.ctx_after, block_size)
        tables[i, :nb] = torch.tensor(r.block_table[:nb], dtype=torch.long)
        row += r.q_len
    ctx_after = torch.tensor([r.ctx_after for r in runs], dtype=torch.long)
    return Group(
        runs,
        row_start,
        q_pos.to(device),
        q_rows.to(device),
        (q_pos >= 0).to(device),
        ctx_after.to(device),
        tables.to(device),
    )


def split_by_context(
    runs: list[TokenRun], block_size: int, group_cost: int
) -> list[list[TokenRun]]:
    """Contiguous slices of `runs` sorted by context length that minimise the padded work,
    sum over groups of (size * Qmax * Lk) + group_cost per group (exact dynamic programme over
    the distinct padded shapes, O(shapes^2) at worst, cut short once the last group alone
    costs more than the best split found; decodes have at most max_model_len / block_size)."""
    if len(runs) < 2:
        return [runs] if runs else []
    units: list[list] = []  # [lk, q, runs], ascending lk
    for r in sorted(runs, key=lambda r: (r.ctx_after, r.q_len)):
        lk = ceil_div(r.ctx_after, block_size) * block_size
        if units and units[-1][0] == lk and units[-1][1] == r.q_len:
            units[-1][2].append(r)
        else:
            units.append([lk, r.q_len, [r]])
    best = [0.0] * (len(units) + 1)  # best[j]: cost of units[:j]
    cut = [0] * (len(units) + 1)
    for j in range(1, len(units) + 1):
        lk, count, q_max, best_j = units[j - 1][0], 0, 0, None
        for i in range(j, 0, -1):  # last group = units[i-1:j]
            count += len(units[i - 1][2])
            q_max = max(q_max, units[i - 1][1])
            last = count * q_max * lk + group_cost
            if best_j is not None and last >= best_j:
                break  # the last group only grows from here: no better cut
            cost = best[i - 1] + last
            if best_j is None or cost < best_j:
                best_j, cut[j] = cost, i - 1
        best[j] = best_j
    groups, j = [], len(units)
    while j > 0:
        i = cut[j]
        groups.append([r for unit in units[i:j] for r in unit[2]])
        j = i
    return groups[::-1]


def build_batch(
    runs: list[TokenRun],
    block_size: int,
    device: torch.device,
    group_cost: int | None = 1024,
    split_decodes: bool = True,
) -> StepBatch:
    """Order decodes first, then prefill chunks (each kind split into groups of similar
    context; `group_cost=None`: one group per kind; `split_decodes=False`: decodes in one
    group whatever the cost), and precompute every index tensor."""
    decodes = [r for r in runs if r.q_len == 1]
    prefills = [r for r in runs if r.q_len > 1]

    def split(kind: list[TokenRun], allowed: bool) -> list[list[TokenRun]]:
        if group_cost is None or not allowed:
            return [kind] if kind else []
        return split_by_context(kind, block_size, group_cost)

    parts = split(decodes, split_decodes) + split(prefills, True)
    ordered = [r for part in parts for r in part]
    tokens, positions, slots, logits_rows, sample_ids = [], [], [], [], []
    for r in ordered:
        tokens.extend(r.token_ids)
        for pos in range(r.ctx_before, r.ctx_after):
            positions.append(pos)
            slots.append(r.block_table[pos // block_size] * block_size + pos % block_size)
        if r.sample:
            logits_rows.append(len(tokens) - 1)
            sample_ids.append(r.request_id)
    groups, row = [], 0
    for part in parts:
        groups.append(_group(part, row, block_size, device))
        row += sum(r.q_len for r in part)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepBatch(
        ordered,
        as_tensor(tokens),
        as_tensor(positions),
        as_tensor(slots),
        groups,
        as_tensor(logits_rows),
        sample_ids,
        block_size,
    )
