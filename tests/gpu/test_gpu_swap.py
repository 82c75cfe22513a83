"""Swapping on CUDA: blocks swapped out to the pinned host pool and back are bit-identical,
decoding continues with the same tokens, and a pending swap does not hold up a step that
does not touch its blocks."""

from __future__ import annotations

import pytest
import torch

from services.common.step import NewRequestData, SchedulerOutput
from services.executor.engine import Engine
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY

PROMPT = list(range(400, 437))  # 37 tokens: 3 blocks of 16
BLOCKS = [0, 1, 2, 3, 4]
NEW_BLOCKS = [7, 9, 11, 13, 15]


def _decode(engine, rid: str, n: int) -> list[int]:
    return [
        engine.step(SchedulerOutput(0, num_scheduled_tokens={rid: 1})).sampled[rid][0]
        for _ in range(n)
    ]


def _run(engine, swap: bool) -> tuple[list[int], bool]:
    first = engine.step(
        SchedulerOutput(
            0, [NewRequestData("a", PROMPT)], {"a": (BLOCKS, False)}, {"a": len(PROMPT)}
        )
    )
    tokens = [first.sampled["a"][0]] + _decode(engine, "a", 5)
    exact = True
    if swap:
        before = {n: t[:, :, BLOCKS].clone() for n, t in engine.cache.tensors.items()}
        engine.step(SchedulerOutput(1, swap_out=[(b, 10 + b) for b in BLOCKS]))
        engine.step(  # another request overwrites the device blocks meanwhile
            SchedulerOutput(
                2, [NewRequestData("x", list(range(900, 970)))], {"x": (BLOCKS, False)}, {"x": 70}
            )
        )
        engine.step(SchedulerOutput(3, free_request_ids=["x"]))
        engine.step(
            SchedulerOutput(
                4,
                swap_in=[(10 + b, nb) for b, nb in zip(BLOCKS, NEW_BLOCKS)],
                block_tables={"a": (NEW_BLOCKS, True)},
            )
        )
        engine.swap.synchronize()
        after = {n: t[:, :, NEW_BLOCKS] for n, t in engine.cache.tensors.items()}
        exact = all(torch.equal(before[n], after[n]) for n in before)
    return tokens + _decode(engine, "a", 10), exact


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_swap_out_and_in_is_exact(tiny_dirs, kv_dtype):
    kw = dict(device="cuda", dtype="bf16", num_device_blocks=16, num_host_blocks=16)
    plain, _ = _run(Engine(tiny_dirs["llama"], kv_dtype=kv_dtype, **kw), swap=False)
    engine = Engine(tiny_dirs["llama"], kv_dtype=kv_dtype, **kw)
    assert all(t.is_pinned() for t in engine.swap.host.values())
    swapped, exact = _run(engine, swap=True)
    assert exact
    assert swapped == plain
    engine.close()
