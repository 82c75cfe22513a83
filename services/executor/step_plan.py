"""Check a step against the executor's state and compute its effects, without applying them.

Everything that can make a step malformed is found here, so a rejected step (ValueError)
leaves the executor untouched. Semantics, in the contract's order:
- swap_out suspends every request owning a swapped-out block (its table becomes unknown until
  the scheduler sends a replacing table);
- free forgets requests (unknown ids are ignored: freeing is idempotent);
- new requests, then block-table appends/replacements, are applied;
- a device block may end up in two tables only as a shared prefix block (prefix caching): at a
  table position the request will never write, i.e. whose tokens are all below its computed
  tokens (a new request's `num_cached_tokens`); a shared block is never swapped out nor a
  swap-in target while another request holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.arith import ceil_div
from services.executor.messages import RequestState

if TYPE_CHECKING:
    from services.common.step import NewRequestData, SchedulerOutput


class BlockOwners:
    """Which requests hold each device block: one, or several for a shared prefix block."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}

    def holders(self, block: int) -> set[str]:
        return self._holders.get(block, _NONE)

    def add(self, rid: str, table: Iterable[int]) -> None:
        for b in table:
            self._holders.setdefault(b, set()).add(rid)

    def release(self, rid: str, table: Iterable[int]) -> None:
        for b in table:
            held = self._holders.get(b)
            if held is not None:
                held.discard(rid)
                if not held:
                    del self._holders[b]

    def blocks_of(self, rids: set[str]) -> set[int]:
        return {b for b, held in self._holders.items() if held & rids}

    def snapshot(self) -> dict[int, frozenset[str]]:
        return {b: frozenset(held) for b, held in self._holders.items()}


_NONE: frozenset[str] = frozenset()


def apply_plan(
    plan: StepPlan,
    requests: dict[str, RequestState],
    owners: BlockOwners,
    on_free: Callable[[str], None] | None = None,
    on_new: Callable[[RequestState], None] | None = None,
) -> None:
    """Apply a checked plan's bookkeeping: suspend, free, add, then set tables (the engine and
    the stub executor share it; `on_free` / `on_new` do their own part, e.g. KV staging)."""

    def release(rid: str) -> None:
        owners.release(rid, requests[rid].block_table or ())

    for rid in plan.suspended:
        release(rid)
        requests[rid].block_table = None
    for rid in plan.freed:
        release(rid)
        if on_free is not None:
            on_free(rid)
        del requests[rid]
    for state in plan.new:
        if on_new is not None:
            on_new(state)
        requests[state.request_id] = state
    for rid, table in plan.tables.items():
        release(rid)
        requests[rid].block_table = table
        owners.add(rid, table)


@dataclass
class StepPlan:
    suspended: set[str] = field(default_factory=set)  # swapped-out owners
    freed: list[str] = field(default_factory=list)
    new: list[RequestState] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)  # final table of touched reqs
    scheduled: list[tuple[str, int]] = field(default_factory=list)


class StepChecker:
    def __init__(
        self,
        requests: dict[str, RequestState],
        owners: BlockOwners,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.requests, self.owners = requests, owners
        self.nd, self.nh, self.bs = num_device_blocks, num_host_blocks, block_size
        self.max_len, self.vocab = max_model_len, vocab_size

    def plan(self, step: SchedulerOutput) -> StepPlan:
        p = StepPlan()
        self._swaps(step.swap_out, self.nd, self.nh, "swap_out")
        self._swaps(step.swap_in, self.nh, self.nd, "swap_in")
        for src, _ in step.swap_out:
            holders = self.owners.holders(src)
            if len(holders) > 1:
                raise ValueError(f"swap_out of block {src}, shared by {sorted(holders)}")
            p.suspended.update(holders)
        p.freed = [r for r in dict.fromkeys(step.free_request_ids) if r in self.requests]
        live = set(self.requests) - set(p.freed)
        self._new_requests(step.new_requests, live, p)
        self._tables(step.block_tables, live | {r.request_id for r in p.new}, p)
        self._swap_in_targets(step.swap_in, p)
        self._scheduled(step.num_scheduled_tokens, p)
        return p

    @staticmethod
    def _swaps(pairs: list[tuple[int, int]], n_src: int, n_dst: int, what: str) -> None:
        for src, dst in pairs:
            if not (0 <= src < n_src and 0 <= dst < n_dst):
                raise ValueError(
                    f"{what} ({src} -> {dst}) out of range: source blocks "
                    f"0..{n_src - 1}, target blocks 0..{n_dst - 1}"
                )
        for i, name in ((0, "source"), (1, "target")):
            ids = [pair[i] for pair in pairs]
            if len(set(ids)) != len(ids):
                raise ValueError(f"{what} names a {name} block twice")

    def _new_requests(
        self, new_requests: Iterable[NewRequestData], live: set[str], p: StepPlan
    ) -> None:
        for nr in new_requests:
            rid = nr.request_id
            if rid in live or any(r.request_id == rid for r in p.new):
                raise ValueError(f"new request {rid!r} already exists")
            ids = list(nr.token_ids)
            if not ids:
                raise ValueError(f"new request {rid!r} has no tokens")
            if len(ids) > self.max_len:
                raise ValueError(
                    f"new request {rid!r} has {len(ids)} tokens, more than "
                    f"max_model_len {self.max_len}"
                )
            if min(ids) < 0 or max(ids) >= self.vocab:
                raise ValueError(f"new request {rid!r} has a token id outside 0..{self.vocab - 1}")
            if not 0 <= nr.num_output_tokens <= len(ids):
                raise ValueError(f"new request {rid!r}: num_output_tokens out of range")
            cached = nr.num_cached_tokens
            if not 0 <= cached < len(ids) or cached % self.bs:
                raise ValueError(
                    f"new request {rid!r}: num_cached_tokens {cached} is not whole blocks "
                    f"below its {len(ids)} tokens"
                )
            p.new.append(
                RequestState(
                    rid, ids, nr.sampling, nr.num_output_tokens, cached, max_tokens=nr.max_tokens
                )
            )

    def _current_table(self, rid: str, p: StepPlan) -> list[int] | None:
        if rid in p.tables:
            return p.tables[rid]
        if rid in p.suspended:
            return None
        state = self.requests.get(rid)
        if state is None:
            return []  # a new request
        return None if state.block_table is None else list(state.block_table)

    def _tables(
        self, updates: dict[str, tuple[list[int], bool]], live: set[str], p: StepPlan
    ) -> None:
        gone = p.suspended | set(p.freed)
        released = self.owners.blocks_of(gone) if gone else set()
        claims: dict[int, list[str]] = {}
        readonly: set[tuple[int, str]] = set()  # (block, request): a shared prefix position
        computed = {r.request_id: r.num_computed for r in p.new}
        for rid, (ids, replace) in updates.items():
            if rid not in live:
                raise ValueError(f"block table for unknown request {rid!r}")
            table = self._current_table(rid, p)
            if replace:
                released.update(table or [])
                table = []
            elif table is None:
                raise ValueError(f"request {rid!r} is swapped out: send a replacing block table")
            done = computed.get(rid)
            if done is None:
                done = self.requests[rid].num_computed
            seen = set(table)
            for i, b in enumerate(ids, start=len(table)):
                if not 0 <= b < self.nd:
                    raise ValueError(f"block id {b} out of range 0..{self.nd - 1} ({rid!r})")
                if b in seen:
                    raise ValueError(f"block {b} given twice to {rid!r}")
                seen.add(b)
                claims.setdefault(b, []).append(rid)
                if (i + 1) * self.bs <= done:
                    readonly.add((b, rid))
            p.tables[rid] = table + list(ids)
        for b, rids in claims.items():
            writers = [r for r in rids if (b, r) not in readonly]
            others = self.owners.holders(b) - set(rids) if b not in released else set()
            if writers and (len(rids) > 1 or others):
                holders = sorted({*rids, *others} - {writers[0]})
                raise ValueError(f"block {b} given to {writers[0]!r} but also held by {holders}")

    def _swap_in_targets(self, swap_in: list[tuple[int, int]], p: StepPlan) -> None:
        for _, dst in swap_in:
            for holder in self.owners.holders(dst):
                if (
                    holder not in p.suspended
                    and holder not in p.freed
                    and (holder not in p.tables or dst in p.tables[holder])
                ):
                    raise ValueError(f"swap_in target block {dst} still belongs to {holder!r}")

    def _scheduled(self, scheduled: dict[str, int], p: StepPlan) -> None:
        new = {r.request_id: r for r in p.new}
        for rid, n in scheduled.items():
            state = new.get(rid) or (self.requests.get(rid) if rid not in p.freed else None)
            if state is None:
                raise ValueError(f"scheduled unknown request {rid!r}")
            if n < 1:
                raise ValueError(f"request {rid!r}: num_new_tokens must be >= 1, got {n}")
            end = state.num_computed + n
            if end > len(state.token_ids):
                raise ValueError(
                    f"request {rid!r}: chunk of {n} tokens goes past its "
                    f"{len(state.token_ids)} known tokens "
                    f"({state.num_computed} computed)"
                )
            table = self._current_table(rid, p)
            if table is None:
                raise ValueError(f"request {rid!r} is swapped out and has no block table")
            if len(table) * self.bs < end:
                raise ValueError(
                    f"request {rid!r} needs {ceil_div(end, self.bs)} blocks for "
                    f"{end} tokens but its table has {len(table)}"
                )
            p.scheduled.append((rid, n))


class StepBook:
    """The executor's bookkeeping under the step contract: the requests it knows, which of them
    hold each device block, and the checker of each step against both. The engine keeps one;
    the benchmark stub executor (lab/executor/stub.py) keeps the very same."""

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.requests: dict[str, RequestState] = {}
        self.owners = BlockOwners()  # device block -> the requests holding it
        self.checker = StepChecker(
            self.requests,
            self.owners,
            num_device_blocks,
            num_host_blocks,
            block_size,
            max_model_len,
            vocab_size,
        )

    def plan(self, step: SchedulerOutput) -> StepPlan:
        """Check `step` (ValueError if malformed; nothing changes) and compute its effects."""
        return self.checker.plan(step)

    def apply(
        self,
        plan: StepPlan,
        on_free: Callable[[str], None] | None = None,
        on_new: Callable[[RequestState], None] | None = None,
    ) -> None:
        apply_plan(plan, self.requests, self.owners, on_free, on_new)
