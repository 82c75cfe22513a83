"""Multi-turn and shared-system-prompt workloads, and the simulator's prefix cache on them."""

import itertools

import pytest

from lab.sim.config import SimConfig, load_profile
from lab.sim.engine import prompt_tokens
from lab.sim.run import simulate
from lab.workload.traces.multiturn import (
    Conversation,
    conversation_turns,
    multiturn_trace,
    shared_prompt_trace,
    sharegpt_conversations,
)
from lab.workload.traces.trace import Shape, load_jsonl, save_jsonl

PROFILE = load_profile("a100-80g/llama-2-7b")


def conv(cid, turns, user=40, answer=120):
    return Conversation(
        cid,
        tuple(f"question {i}" for i in range(turns)),
        tuple(f"answer {i}" for i in range(turns)),
        tuple(user + 7 * i for i in range(turns)),
        tuple(answer + 13 * i for i in range(turns)),
    )


def test_each_turn_extends_the_previous_turns_history():
    turns = conversation_turns(conv("c", 3))
    assert [t.prompt_len for t in turns] == [40, 40 + 120 + 47, 40 + 120 + 47 + 133 + 54]
    assert [t.output_len for t in turns] == [120, 133, 146]
    for prev, nxt in itertools.pairwise(turns):
        assert nxt.segments[: len(prev.segments)] == prev.segments
        assert nxt.messages[: len(prev.messages)] == prev.messages
        assert nxt.messages[len(prev.messages)] == ("assistant", "answer " + prev.sample_id[-1])
    # the simulator's tokens: equal segments, equal ids; different conversations differ
    a, b = prompt_tokens(turns[1]), prompt_tokens(turns[2])
    assert b[: len(a)] == a
    assert prompt_tokens(conversation_turns(conv("d", 1))[0]) != prompt_tokens(turns[0])


def test_multiturn_trace_orders_turns_and_keeps_the_rate(tmp_path):
    convs = [conv(f"c{i}", 2 + i % 4) for i in range(200)]
    items = multiturn_trace(convs, rate=10.0, think_s=2.0, seed=1)
    assert len(items) == sum(c.turns for c in convs)
    assert [i.arrival_s for i in items] == sorted(i.arrival_s for i in items)
    by_conv = {}
    for item in items:
        by_conv.setdefault(item.request_id.rsplit("-t", 1)[0], []).append(item.request_id)
    assert all(ids == sorted(ids) for ids in by_conv.values())  # turns in order
    rate = len(items) / items[-1].arrival_s
    assert 7.0 < rate < 13.0
    path = tmp_path / "t.jsonl"
    save_jsonl(items[:5], path)
    assert load_jsonl(path) == items[:5]  # segments and messages survive a save


def test_shared_prompt_trace_puts_a_system_prompt_first():
    shapes = [Shape(30 + i, 10, f"p{i}", f"s{i}") for i in range(20)]
    items = shared_prompt_trace(shapes, [i * 0.1 for i in range(20)], 256, 2, seed=0)
    assert {i.segments[0][0] for i in items} == {"system-0", "system-1"}
    assert all(i.prompt_len == 256 + s.prompt_len for i, s in zip(items, shapes))
    assert all(i.messages[0][0] == "system" for i in items)


def test_sharegpt_conversations_have_several_turns():
    convs = sharegpt_conversations(5)
    assert len(convs) == 5 and all(c.turns >= 2 for c in convs)
    assert all(sum(c.user_lens) + sum(c.answer_lens) <= 2048 for c in convs)


def _run(items, caching, executors=1, placement=True):
    config = SimConfig(
        policy="hybrid",
        num_executors=executors,
        prefix_caching=caching,
        cache_aware_placement=placement,
    )
    return simulate(items, config, PROFILE)


def test_simulated_prefix_cache_cuts_prefill_and_ttft():
    items = multiturn_trace([conv(f"c{i}", 5, 300, 200) for i in range(40)], rate=6.0, seed=2)
    off, on = _run(items, False), _run(items, True)
    assert on.summary["completed"] == off.summary["completed"] == len(items)
    prefill = [sum(i.num_prefill_tokens for i in r.iterations) for r in (off, on)]
    assert prefill[1] < 0.6 * prefill[0]
    assert on.summary["mean_ttft"] < off.summary["mean_ttft"]
    assert on.summary["prefix_cache_hit_rate"] > 0.4


@pytest.mark.parametrize("executors", [2, 4])
def test_cache_aware_placement_finds_more_of_the_cache(executors):
    items = multiturn_trace([conv(f"c{i}", 5, 300, 200) for i in range(60)], rate=12.0, seed=3)
    aware, load = _run(items, True, executors), _run(items, True, executors, placement=False)
    assert aware.summary["prefix_cache_hits"] > load.summary["prefix_cache_hits"]
