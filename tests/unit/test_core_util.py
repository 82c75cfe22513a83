"""Shared helpers for the scheduling-core tests: a deterministic in-process driver (the cost
model is the clock, tokens come from a caller-supplied function) plus checks it applies after
every step."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.step import SchedulerOutput, StepOutcome
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.cost_model import CostModel
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.shape import StepShape

EOS = 2
# 1 ms fixed + 0.1 ms/token + a little attention: easy numbers for scenario tests
SIMPLE = CostModel(c0=1e-3, c_prefill=1e-4, c_decode=1e-4, c_context=1e-7)


def make_sched(
    policy="fcfs",
    device_blocks=256,
    host_blocks=256,
    block_size=16,
    max_model_len=4096,
    cost=SIMPLE,
    prefix_caching=False,
    **knobs,
) -> Scheduler:
    from services.scheduler.core.policies import make_policy

    pol = make_policy(policy, **knobs) if isinstance(policy, str) else policy
    bm = BlockManager(device_blocks, host_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(pol, bm, cost, max_model_len)


def req(rid, prompt_len, out_len, t=0.0, **kw) -> Request:
    """A request that will produce exactly `out_len` tokens (ignore_eos + max_tokens)."""
    kw.setdefault("ignore_eos", True)
    return Request(rid, [5] * prompt_len, out_len, t, eos_token_ids=(EOS,), **kw)


@dataclass(frozen=True)
class Planned:
    """A step as these tests check it: what was sent (`out`, the wire contract) and what the
    core knew of it besides (`shape`); an attribute is read from whichever holds it."""

    out: SchedulerOutput
    shape: StepShape

    def __getattr__(self, name: str):
        holder = self.shape if hasattr(self.shape, name) else self.out
        return getattr(holder, name)


def plan(s: Scheduler, now: float) -> Planned:
    """`s.schedule(now)` with the core's shape of that step."""
    out = s.schedule(now)
    return Planned(out, s.last_shape)


def check_step(s: Scheduler, out) -> None:
    bm = s.block_manager
    bm.check_invariants()
    if out.token_budget is not None:
        assert out.total_num_scheduled_tokens <= out.token_budget, (out.token_budget, out)
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        assert 1 <= n <= r.num_uncomputed_tokens
        assert bm.num_device_blocks_of(rid) * bm.block_size >= r.num_computed_tokens + n
    assert not set(out.num_scheduled_tokens) & set(out.preempted_request_ids)
    for rid in s.running:
        assert bm.is_on_device(rid) or s.requests[rid].num_computed_tokens == 0
    for rid in s.swapped:
        assert bm.is_swapped(rid)
    for rid in s.waiting:  # nothing computed of its own (a cached prefix is attached later)
        r = s.requests[rid]
        assert r.num_computed_tokens == r.num_cached_tokens and not bm.is_on_device(rid)
        assert r.num_computed_tokens % bm.block_size == 0 and r.num_uncomputed_tokens >= 1
        assert bm.cache is not None or r.num_computed_tokens == 0


def drive(
    s: Scheduler,
    arrivals: list[Request],
    token=lambda r, i: 7,
    max_steps=100_000,
    check=True,
    on_step=None,
) -> list:
    """Run until every request finishes. Returns [(start, end, output)] per executed step."""
    pending = sorted(arrivals, key=lambda r: r.arrival_time)
    now, trace, k = 0.0, [], 0
    for _ in range(max_steps):
        while k < len(pending) and pending[k].arrival_time <= now:
            s.admit(pending[k])
            k += 1
        if not s.has_unfinished and k == len(pending):
            return trace
        out = plan(s, now)
        if check:
            check_step(s, out)
        if out.is_empty:
            assert k < len(pending), f"stuck: nothing scheduled at {now}: {s.stats()}"
            now = max(now, pending[k].arrival_time)
            continue
        start, now = now, now + max(s.cost_model.step_time(out.shape), 1e-5)
        sampled = {
            rid: (token(s.requests[rid], s.requests[rid].num_output_tokens), -0.5)
            for rid, n in out.num_scheduled_tokens.items()
            if s.requests[rid].num_computed_tokens + n >= s.requests[rid].num_tokens
        }
        s.update(StepOutcome(out.step_id, sampled, now - start), now)
        trace.append((start, now, out))
        if on_step:
            on_step(s, out)
    raise AssertionError(f"not finished after {max_steps} steps: {s.stats()}")


def test_drive_finishes_and_counts_tokens():
    s = make_sched("fcfs")
    reqs = [req(f"r{i}", 20 + i, 5 + i, t=0.001 * i) for i in range(6)]
    trace = drive(s, reqs)
    assert all(r.num_output_tokens == 5 + i for i, r in enumerate(reqs))
    assert all(r.finish_reason == "length" for r in reqs)
    assert sum(out.total_num_scheduled_tokens for _, _, out in trace) == sum(
        (20 + i) + (5 + i) - 1 for i in range(6)
    )
