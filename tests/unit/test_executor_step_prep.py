"""The vectorised host-side step preparation computes what the per-run loops computed: query
tiles, and the packed metadata from block arrays or from the lists; a request's block array
follows its table."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lab.executor.tiny import make_tiny_model
from services.common.arith import ceil_div
from services.common.sampling import SamplingParams
from services.executor import triton_plan as plan
from services.executor.engine import Engine
from services.executor.messages import RequestState
from services.executor.ragged_batch import RunArrays, TokenRun
from services.executor.step_buffers import MetaLayout, fill_meta, order_runs


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=0)
    return Engine(model, device="cpu", num_device_blocks=8, num_host_blocks=1)


def _loop_tiles(runs: list[TokenRun], block_q: int) -> torch.Tensor:
    cols, row = [], 0
    for i, r in enumerate(runs):
        for start in range(0, r.q_len, block_q):
            cols.append((i, row + start, min(block_q, r.q_len - start), r.ctx_before + start))
        row += r.q_len
    return torch.tensor(cols, dtype=torch.int32).T.contiguous()


def _runs(seed: int, with_arrays: bool) -> list[TokenRun]:
    rng = random.Random(seed)
    runs, next_block = [], 0
    for i in range(rng.randint(1, 40)):
        q, before = rng.choice([1, 1, 1, rng.randint(2, 70)]), rng.randint(0, 300)
        n = ceil_div(before + q, 16) + rng.randint(0, 2)
        table = list(range(next_block, next_block + n))
        next_block += n
        arr = np.asarray(table, dtype=np.int64) if with_arrays else None
        runs.append(
            TokenRun(f"r{i}", [7] * q, before, table, rng.randint(-1, 5), rng.random() < 0.8, arr)
        )
    return order_runs(runs)


def test_tiles_match_the_per_run_loop():
    for seed in range(30):
        runs = _runs(seed, False)
        for block_q in (1, 4, 16, 64):
            assert torch.equal(plan.tile_table(runs, block_q), _loop_tiles(runs, block_q))
            assert torch.equal(
                plan.tile_table(runs, block_q, RunArrays.of(runs)), _loop_tiles(runs, block_q)
            )


def test_metadata_from_block_arrays_equals_from_lists():
    for seed in range(20):
        lists, arrays = _runs(seed, False), _runs(seed, True)
        a = RunArrays.of(lists)
        tokens, width = int(a.q.sum()), ceil_div(int((a.before + a.q).max()), 16)
        layout = MetaLayout(tokens, len(lists), int(a.sample.sum()), width, 0)
        bufs = [np.full(layout.size, -5, dtype=np.int32) for _ in range(2)]
        fill_meta(bufs[0], layout, lists, 16)
        fill_meta(bufs[1], layout, arrays, 16, arrays=RunArrays.of(arrays))
        assert np.array_equal(bufs[0], bufs[1])
        assert (bufs[0][layout.offsets()["tables"] :] >= 0).all()  # every table cell written


def test_a_block_array_follows_its_table(tiny_engine):
    st = RequestState("a", [1, 2], SamplingParams(), 4)
    tiny_engine.requests["a"] = st
    st.block_table = [3, 4]
    first = tiny_engine._block_array(st)
    assert first.tolist() == [3, 4] and tiny_engine._block_array(st) is first  # converted once
    st.block_table = [3, 4, 9]  # tables are replaced, never edited in place
    assert tiny_engine._block_array(st).tolist() == [3, 4, 9]
    st.block_table = None
    assert tiny_engine._block_array(st) is None
