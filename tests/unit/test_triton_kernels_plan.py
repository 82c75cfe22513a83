"""Launch planning of the Triton attention kernels (services/executor/triton_plan.py): query
tiles with GQA packed into the rows, KV tile size, and the split-KV rule. Pure host logic."""

from __future__ import annotations

import pytest

from services.executor import triton_plan as plan
from services.executor.ragged_batch import TokenRun

H100_SMS = 132


def _run(q_len: int, ctx_before: int) -> TokenRun:
    return TokenRun("r", [0] * q_len, ctx_before, list(range(200)))


@pytest.mark.parametrize(
    ("programs", "max_context", "decode_only", "splits"),
    [
        (4, 2048, False, 1),  # a step with prefill chunks never splits
        (132, 8192, True, 1),  # the programs already fill the SMs
        (4, 1023, True, 1),  # context below SPLIT_MIN_CONTEXT
        (4, 1024, True, 4),  # 1024 // 256 = 4 splits of 256 keys
        (4, 2048, True, 8),  # ceil(132 / 4) = 33, capped at 2048 // 256 = 8
        (1, 32768, True, 16),  # capped at MAX_SPLITS
        (40, 32768, True, 4),  # ceil(132 / 40) = 4
        (50, 32768, True, 2),  # ceil(132 / 50) = 3, rounded down to a power of two
        (100, 32768, True, 2),  # ceil(132 / 100) = 2
    ],
)
def test_split_rule(programs, max_context, decode_only, splits):
    assert plan.num_kv_splits(programs, max_context, H100_SMS, decode_only) == splits


def test_split_rule_always_gives_a_power_of_two_within_bounds():
    for programs in range(1, 200):
        for ctx in (1024, 1500, 4096, 100_000):
            n = plan.num_kv_splits(programs, ctx, H100_SMS, True)
            assert n & (n - 1) == 0 and 1 <= n <= plan.MAX_SPLITS
            assert n == 1 or n * plan.SPLIT_MIN_TOKENS <= ctx
            # below the SMs a long context always splits (ceil(sms / programs) >= 2, and
            # ctx // SPLIT_MIN_TOKENS >= 4)
            assert (n == 1) == (programs >= H100_SMS or ctx < plan.SPLIT_MIN_CONTEXT)


@pytest.mark.parametrize(
    ("group", "has_chunks", "tile"),
    [
        (1, False, (16, 16)),
        (4, False, (16, 4)),
        (7, False, (16, 2)),  # 14 of 16 rows used
        (8, False, (16, 2)),
        (7, True, (64, 9)),  # 63 of 64 rows
        (8, True, (64, 8)),
        (32, False, (32, 1)),  # more heads than rows: one token, rows = next power of two
    ],
)
def test_query_tile_packs_the_group_into_the_rows(group, has_chunks, tile):
    block_m, block_q = plan.query_tile(group, has_chunks)
    assert (block_m, block_q) == tile
    assert block_q * group <= block_m and block_m >= 16  # tl.dot needs M >= 16


def test_kv_tile_spans_whole_pages():
    assert plan.kv_tile(16, 128) == 64 and plan.kv_tile(32, 128) == 64
    assert plan.kv_tile(16, 64) == 128 and plan.kv_tile(256, 64) == 256
    assert plan.kv_tile(16, 128, fp32=True) == 32 and plan.kv_tile(64, 128, fp32=True) == 64
    for bs in (8, 16, 32, 64, 128):
        for d in (16, 64, 128):
            assert plan.kv_tile(bs, d) % bs == 0


def test_tile_table_cuts_each_run_into_query_tiles():
    runs = [_run(1, 700), _run(20, 40), _run(1, 4)]
    tiles = plan.tile_table(runs, block_q=8)
    assert tiles.tolist() == [
        [0, 1, 1, 1, 2],  # request
        [0, 1, 9, 17, 21],  # first packed row
        [1, 8, 8, 4, 1],  # queries in the tile
        [700, 40, 48, 56, 4],  # position of its first query
    ]


def test_plan_step_splits_only_decode_steps_unless_forced():
    decodes = [_run(1, 2000), _run(1, 300)]
    step = plan.plan_step(decodes, 4, 1, 16, 128, H100_SMS)
    # 2 programs, longest context 2001: min(66, 7, 16) = 7 -> 4
    assert (step.block_m, step.block_q, step.block_n, step.splits) == (16, 4, 64, 4)
    mixed = [*decodes, _run(30, 0)]
    step = plan.plan_step(mixed, 4, 1, 16, 128, H100_SMS)
    assert (step.block_m, step.block_q, step.splits, step.num_tiles) == (64, 16, 1, 4)
    assert plan.plan_step(mixed, 4, 1, 16, 128, H100_SMS, splits=8).splits == 8


def test_split_factors_are_what_the_rule_can_pick():
    assert plan.split_factors(1000) == [2]
    assert plan.split_factors(8192) == [2, 4, 8, 16]
    assert plan.split_factors(300) == [] and plan.split_factors(300, forced=4) == [4]
    for ctx in (1024, 2048, 4096, 10**6):
        for programs in (1, 3, 8, 40, 100):
            s = plan.num_kv_splits(programs, ctx, plan.NOMINAL_SMS, True)
            assert s == 1 or s in plan.split_factors(ctx)


def test_small_decode_batches_split_by_their_graph_bucket():
    # Llama-3-8B's 8 KV heads on 132 SMs: bucket 1 -> 8 programs -> 16 splits ... 32 -> none
    got = [plan.bucket_splits(n, 8, plan.NOMINAL_SMS, 8192) for n in (1, 2, 3, 4, 8, 16, 32)]
    assert got == [16, 8, 4, 4, 2, 2, 1]
    assert plan.bucket_splits(1, 8, plan.NOMINAL_SMS, 1024) == 4  # capped by the longest context
    for n in range(1, 40):  # the factor depends on the bucket alone, and warm-up compiles it
        s = plan.bucket_splits(n, 3, plan.NOMINAL_SMS, 2048)
        assert s == plan.bucket_splits(plan.next_pow2(n), 3, plan.NOMINAL_SMS, 2048)
        assert s == 1 or s in plan.split_factors(2048)
