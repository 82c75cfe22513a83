"""Pipelined steps in the scheduling core: step n+1 planned while step n runs.

Each run drives a core `Scheduler` against the stub executor's engine (the executor's own Step
checks: token counts, block tables, shared blocks; deterministic tokens by position) and keeps
up to `depth` steps in flight, applying results in order, as the live loop does. A pipelined
run must give every request exactly the tokens and finish reason of an unpipelined one.
"""

from __future__ import annotations

from collections import deque

import pytest

from lab.executor.stub import STUB_VOCAB, StubEngine
from services.common.step import StepOutcome
from services.scheduler.core.request import Request
from tests.unit.test_core_util import make_sched


def _token_at(position: int) -> int:
    """The token the stub samples when a request reaches `position` tokens."""
    return 3 + (position * 7919) % (STUB_VOCAB - 3)


def _requests(n: int, stop_every: int) -> list[Request]:
    reqs = []
    for i in range(n):
        prompt = [7 + (i * 13 + j) % 500 for j in range(10 + (i * 37) % 90)]
        stop = ()
        if stop_every and i % stop_every == 0:  # stops on its 3rd..7th token
            stop = (_token_at(len(prompt) + 2 + i % 5),)
        reqs.append(
            Request(f"r{i}", prompt, 20 + (i * 11) % 40, 0.0, stop_token_ids=stop, ignore_eos=True)
        )
    return reqs


def _run(depth: int, policy: str, blocks: int, caching: bool, stop_every: int):
    sched = make_sched(policy, device_blocks=blocks, host_blocks=64, prefix_caching=caching)
    sched.pipeline_depth = depth
    engine = StubEngine(0.0, num_device_blocks=blocks, num_host_blocks=64, max_model_len=4096)
    for r in _requests(24, stop_every):
        sched.admit(r)
    tokens: dict[str, list[int]] = {r: [] for r in sched.requests}
    finished: dict[str, tuple[list[int], str | None]] = {}
    flights: deque = deque()  # (executor result, computes)
    surplus, now, ahead = 0, 0.0, 0
    while sched.has_unfinished or flights:
        while len(flights) < depth and (not flights or flights[-1][1]):
            out = sched.schedule(now)
            computes = bool(out.num_scheduled_tokens or out.swap_out or out.swap_in)
            if not computes and not out.free_request_ids:
                break
            ahead += bool(flights)
            flights.append((engine.step(out), computes))  # the executor runs Steps in order
        result, _ = flights.popleft()
        now += 0.01
        updates = sched.update(StepOutcome(result.step_id, result.sampled), now)
        got = {u.request_id for u in updates}
        surplus += sum(1 for rid in result.sampled if rid not in got)
        for u in updates:
            assert u.token is not None and u.token[2] == len(tokens[u.request_id])
            tokens[u.request_id].append(u.token[0])
            if u.finished:
                finished[u.request_id] = (tokens[u.request_id], u.finish_reason)
        assert all(r.num_pending_tokens >= 0 for r in sched.requests.values())
    return finished, surplus, ahead


@pytest.mark.parametrize(
    ("policy", "blocks", "caching"),
    [("fcfs", 512, False), ("fcfs", 40, False), ("sarathi", 64, True), ("hybrid", 48, False)],
)
def test_pipelined_steps_give_the_same_tokens(policy, blocks, caching):
    """Same tokens and finish reasons with two steps in flight as with one; the surplus
    tokens of requests that stopped while a later step was in flight are discarded."""
    plain, plain_surplus, plain_ahead = _run(1, policy, blocks, caching, stop_every=3)
    piped, surplus, ahead = _run(2, policy, blocks, caching, stop_every=3)
    assert plain_surplus == 0 and plain_ahead == 0
    assert ahead > 0  # steps really were planned while another was in flight
    assert sorted(piped) == sorted(f"r{i}" for i in range(24))
    assert piped == plain  # every request: the same tokens, the same finish reason
    assert {r for r, (_, why) in piped.items() if why == "stop"} == {
        f"r{i}" for i in range(0, 24, 3)
    }
    assert surplus > 0  # stop tokens found only after the next step was sent


def test_length_finish_is_not_given_a_surplus_step():
    """A request whose pending token reaches max_tokens is not scheduled again: with no stop
    tokens, a pipelined run computes no surplus token at all."""
    _, surplus, ahead = _run(2, "fcfs", 512, False, stop_every=0)
    assert ahead > 0 and surplus == 0


def test_planning_ahead_counts_the_running_step():
    sched = make_sched("fcfs")
    sched.pipeline_depth = 2
    sched.admit(Request("a", [5] * 20, 4, 0.0, ignore_eos=True))
    first = sched.schedule(0.0)
    assert first.num_scheduled_tokens == {"a": 20}
    second = sched.schedule(0.0)  # planned while the prefill runs: decodes its pending token
    assert second.num_scheduled_tokens == {"a": 1}
    req = sched.requests["a"]
    # the prefill counts as computed and its token as pending (the second step is counted in
    # turn when a third is planned, or when its result is applied)
    assert (req.num_pending_tokens, req.num_computed_tokens, req.num_tokens) == (1, 20, 21)
    with pytest.raises(RuntimeError):
        sched.schedule(0.0)  # two in flight already
    with pytest.raises(ValueError):
        sched.update(StepOutcome(second.step_id, {"a": (9, 0.0)}), 0.0)  # out of order
    sched.update(StepOutcome(first.step_id, {"a": (9, 0.0)}), 0.0)
    assert req.output_token_ids == [9] and req.num_pending_tokens == 0
    third = sched.schedule(0.0)
    assert third.num_scheduled_tokens == {"a": 1} and req.num_pending_tokens == 1
    sched.update(StepOutcome(second.step_id, {"a": (10, 0.0)}), 0.0)
    sched.update(StepOutcome(third.step_id, {"a": (11, 0.0)}), 0.0)
    assert req.output_token_ids == [9, 10, 11] and req.num_computed_tokens == 22


def test_abort_with_two_steps_in_flight():
    """An abort while two steps run: their tokens for it are discarded, its free goes out in
    the next plan, and it is forgotten once that plan's result is applied."""
    sched = make_sched("fcfs")
    sched.pipeline_depth = 2
    for rid in ("a", "b"):
        sched.admit(Request(rid, [5] * 8, 10, 0.0, ignore_eos=True))
    first, second = sched.schedule(0.0), sched.schedule(0.0)
    assert sched.abort("a", 0.0)
    a = sched.requests["a"]
    assert a.num_pending_tokens == 0 and a.finish_reason == "abort"
    both = {"a": (9, 0.0), "b": (9, 0.0)}
    assert [u.request_id for u in sched.update(StepOutcome(first.step_id, both), 0.0)] == ["b"]
    third = sched.schedule(0.0)
    assert third.free_request_ids == ["a"] and set(third.num_scheduled_tokens) == {"b"}
    assert [u.request_id for u in sched.update(StepOutcome(second.step_id, both), 0.0)] == ["b"]
    assert "a" in sched.requests  # its free is still in flight
    sched.update(StepOutcome(third.step_id, {"b": (9, 0.0)}), 0.0)
    assert "a" not in sched.requests and sched.requests["b"].num_output_tokens == 3
