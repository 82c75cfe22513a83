"""Packed batches: decodes and prefill runs split into groups of similar context length."""

from __future__ import annotations

import torch

from services.executor.ragged_batch import TokenRun, build_batch, split_by_context

BS = 16


def _decode(rid: str, ctx: int) -> TokenRun:
    nb = -(-(ctx + 1) // BS)
    return TokenRun(rid, [7], ctx, list(range(nb)), sample=True)


def _padded(groups) -> int:
    return sum(
        len(g) * max(c.q_len for c in g) * max(-(-c.ctx_after // BS) * BS for c in g)
        for g in groups
    )


def test_long_outlier_gets_its_own_group():
    runs = [_decode(f"s{i}", 20 + i) for i in range(10)] + [_decode("long", 630)]
    groups = split_by_context(runs, BS, group_cost=128)
    assert [len(g) for g in groups] == [10, 1]
    assert groups[1][0].request_id == "long"
    assert _padded(groups) < _padded([runs]) / 5


def test_equal_contexts_and_expensive_groups_stay_together():
    same = [_decode(f"s{i}", 100) for i in range(8)]
    assert [len(g) for g in split_by_context(same, BS, 128)] == [8]
    mixed = [_decode(f"m{i}", 30 * i) for i in range(8)]
    assert len(split_by_context(mixed, BS, 10**9)) == 1
    assert len(split_by_context(mixed, BS, 0)) == len({-(-c.ctx_after // BS) for c in mixed})


def test_split_is_optimal_against_brute_force():
    import itertools
    import random

    rng = random.Random(3)
    for _ in range(20):
        runs = [
            TokenRun(f"c{i}", [1] * rng.choice([1, 5, 40]), rng.randint(0, 300), [0] * 30)
            for i in range(6)
        ]
        cost = rng.choice([0, 64, 512])
        got = split_by_context(runs, BS, cost)
        assert sorted(c.request_id for g in got for c in g) == sorted(c.request_id for c in runs)
        order = sorted(runs, key=lambda c: (c.ctx_after, c.q_len))
        best = min(
            _padded(parts) + cost * len(parts)
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
            for parts in [[order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]]
        )
        assert _padded(got) + cost * len(got) == best


def test_groups_cover_the_packed_rows_in_order():
    runs = [
        _decode("a", 500),
        TokenRun("p", list(range(30)), 0, [8, 9]),
        _decode("b", 3),
        _decode("c", 490),
        TokenRun("q", list(range(4)), 200, list(range(20, 34))),
    ]
    batch = build_batch(runs, BS, torch.device("cpu"))
    assert len(batch.groups) >= 3
    row = 0
    for g in batch.groups:
        assert g.row_start == row
        assert all(c.q_len == 1 for c in g.runs) or all(c.q_len > 1 for c in g.runs)
        row += sum(c.q_len for c in g.runs)
    assert row == batch.num_tokens == 1 + 30 + 1 + 1 + 4
    # decodes before prefill runs; every sampled row is the last token of its request
    kinds = [c.q_len > 1 for c in batch.runs]
    assert kinds == sorted(kinds)
    assert batch.sample_ids == ["b", "c", "a"]
    one = build_batch(runs, BS, torch.device("cpu"), group_cost=None)
    assert len(one.groups) == 2
    # the compiled CPU kernel pads nothing: its decodes stay one group, chunks still split
    split = build_batch(runs, BS, torch.device("cpu"), group_cost=0)
    kept = build_batch(runs, BS, torch.device("cpu"), group_cost=0, split_decodes=False)
    decode_groups = [[g for g in b.groups if g.q_max == 1] for b in (split, kept)]
    assert len(decode_groups[0]) == 3 and len(decode_groups[1]) == 1
    assert len(kept.groups) == 1 + len([g for g in split.groups if g.q_max > 1])


def test_engine_split_groups_match_one_group_and_bench_restores_setting(tmp_path):
    """Greedy tokens of decodes with very different contexts are the same whether attention
    runs per context group or as one padded group; the benchmark's figure restores the knob."""
    from bench.bench_engine import mixed_context_decode_ms
    from lab.executor.tiny import make_tiny_model
    from services.common.step import NewRequestData, SchedulerOutput
    from services.executor.engine import Engine

    engine = Engine(
        make_tiny_model(tmp_path / "tiny", "llama", seed=2),
        num_device_blocks=400,
        num_host_blocks=4,
    )
    lens = [3, 40, 300, 17, 299, 5]
    base = 0

    def run(cost, tag):
        nonlocal base
        engine.attention_group_cost = cost
        rids = [f"{tag}{i}" for i in range(len(lens))]
        step = SchedulerOutput(0)
        for rid, n in zip(rids, lens):
            nb = -(-(n + 4) // 16)
            step.new_requests.append(NewRequestData(rid, [(7 * n + k) % 50 + 3 for k in range(n)]))
            step.block_tables[rid] = (list(range(base, base + nb)), False)
            step.num_scheduled_tokens[rid] = n
            base += nb
        out = [engine.step(step).sampled]
        for i in range(3):
            step = SchedulerOutput(i + 1, num_scheduled_tokens=dict.fromkeys(rids, 1))
            out.append(engine.step(step).sampled)
        engine.step(SchedulerOutput(9, free_request_ids=rids))
        return [[o[rid][0] for rid in rids] for o in out]

    assert run(128, "a") == run(None, "b")
    engine.attention_group_cost = 77
    fig = mixed_context_decode_ms(engine, batch=6, reps=5)
    assert engine.attention_group_cost == 77
    assert fig["split_ms"] > 0 and fig["one_group_ms"] > 0 and fig["max_context"] <= 600
