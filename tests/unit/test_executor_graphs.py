"""The CUDA step path without a GPU: graph buckets, padding a decode batch to a bucket, the
one-buffer step metadata, the capture fallback, batched sampling with one packed result, and
the whole packed path (metadata buffer + padded graph replays) run under Triton's interpreter
against the CPU engine. The real CUDA capture and replay are exercised by tests/gpu."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.sampling import SamplingParams
from services.executor.cuda_graphs import DecodeGraphs, bucket_for, eager_capture, graph_buckets
from services.executor.cuda_runtime import RuntimeOptions, uses_graphs, uses_packed
from services.executor.ragged_batch import TokenRun, build_batch
from services.executor.sampler import (
    _filter,
    _min_p,
    allowed_mask,
    sample,
    sample_batch,
    top_alternatives,
    unpack_samples,
)
from services.executor.step_buffers import (
    ALIGN,
    MetaLayout,
    StepBuffers,
    order_runs,
    pad_decodes,
    table_width,
)

ROOT = Path(__file__).resolve().parents[2]
BS = 16
CPU = torch.device("cpu")

# -- buckets -----------------------------------------------------------------------------------


def test_buckets_are_powers_of_two_up_to_the_largest():
    assert graph_buckets(512) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert graph_buckets(0) == ()


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(512)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 64, 65, 511, 512)] == [
        1,
        2,
        4,
        8,
        64,
        128,
        512,
        512,
    ]
    assert bucket_for(513, buckets) is None and bucket_for(3, ()) is None


def test_graphs_only_on_the_packed_path():
    cuda, cpu = torch.device("cuda"), CPU
    auto = RuntimeOptions()
    assert uses_packed(auto, cuda, "triton", "auto")
    assert not uses_packed(auto, cuda, "triton", "int8")  # INT8 writes are data dependent
    assert not uses_packed(auto, cuda, "torch", "auto")  # padded groups of varying shape
    assert not uses_packed(auto, cpu, "triton", "auto")  # CPU keeps its own path
    assert uses_packed(RuntimeOptions(step_runtime="packed"), cpu, "triton", "auto")
    assert not uses_packed(RuntimeOptions(step_runtime="classic"), cuda, "triton", "auto")
    assert uses_graphs(auto, True) and not uses_graphs(auto, False)
    assert not uses_graphs(RuntimeOptions(cuda_graphs=False), True)
    assert not uses_graphs(RuntimeOptions(graph_max_batch=0), True)
    with pytest.raises(ValueError, match="step_runtime"):
        RuntimeOptions(step_runtime="fast")


def test_a_capture_failure_leaves_every_step_eager(caplog):
    graphs = DecodeGraphs(graph_buckets(16))
    captured = []

    def capture(body):
        if len(captured) == 2:
            raise RuntimeError("operation not permitted when stream is capturing\n(detail)")
        captured.append(body())
        return body

    with caplog.at_level(logging.WARNING, logger="services.executor.cuda_graphs"):
        graphs.capture_all(capture, lambda b: lambda: torch.full((b,), float(b)))
    assert captured[0].shape == (16,) and captured[1].shape == (8,)  # largest first
    assert graphs.replays == {} and graphs.bucket_for(1) is None
    assert graphs.failure.startswith("bucket 4: RuntimeError: operation not permitted")
    assert "\n" not in graphs.failure
    assert any("running every step eagerly" in r.getMessage() for r in caplog.records)


def test_captured_buckets_replay_their_body():
    graphs = DecodeGraphs(graph_buckets(8))
    graphs.capture_all(eager_capture, lambda b: lambda: torch.arange(b))
    assert sorted(graphs.replays) == [1, 2, 4, 8] and graphs.failure == ""
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(9) is None
    assert graphs.replay(4).tolist() == [0, 1, 2, 3]


# -- step metadata in one buffer ---------------------------------------------------------------


def _random_runs(rng: random.Random, n: int, decodes_only: bool = False) -> list[TokenRun]:
    runs, next_block = [], 0
    for i in range(n):
        q = 1 if decodes_only or rng.random() < 0.5 else rng.randint(2, 40)
        ctx = rng.randint(0, 100)
        nb = -(-(ctx + q) // BS) + rng.randint(0, 2)  # tables may hold spare blocks
        table = list(range(next_block, next_block + nb))
        rng.shuffle(table)
        next_block += nb
        tokens = [rng.randrange(1000) for _ in range(q)]
        runs.append(TokenRun(f"r{i}", tokens, ctx, table, i % 3, sample=rng.random() < 0.8))
    return runs


def _stage(runs: list[TokenRun], rows: int | None = None):
    layout = MetaLayout(
        sum(r.q_len for r in runs), len(runs), sum(r.sample for r in runs), table_width(runs, BS)
    )
    buffers = StepBuffers(64, CPU, pin=False, growable=True)
    return layout, buffers, buffers.stage(layout, runs, BS, rows)


@pytest.mark.parametrize("seed", range(5))
def test_packed_metadata_equals_build_batch(seed):
    """Every index the forward pass reads equals what build_batch computes for the same runs
    (one group per kind, as with the Triton backend)."""
    rng = random.Random(seed)
    runs = order_runs(_random_runs(rng, rng.randint(1, 30)))
    ref = build_batch(runs, BS, CPU, group_cost=None)
    _, _, meta = _stage(runs)
    assert [r.request_id for r in ref.runs] == [r.request_id for r in runs]
    assert meta.tokens.tolist() == ref.token_ids.tolist()
    assert meta.positions.tolist() == ref.positions.tolist()
    assert meta.slots.tolist() == ref.slot_mapping.tolist()
    assert meta.logits_rows.tolist() == ref.logits_rows.tolist()
    assert meta.tok_req.tolist() == [i for i, r in enumerate(runs) for _ in range(r.q_len)]
    assert meta.req_ctx.tolist() == [r.ctx_after for r in runs]
    assert meta.req_slot.tolist() == [r.staging_slot for r in runs]
    for r, row in zip(runs, meta.tables.tolist()):
        need = -(-r.ctx_after // BS)
        assert row[:need] == r.block_table[:need] and not any(row[need:])
    assert meta.batch(runs, BS).sample_ids == ref.sample_ids


def test_segments_are_aligned_and_tables_come_last():
    layout = MetaLayout(num_tokens=37, num_reqs=5, num_logits=3, width=9, num_tiles=6)
    offsets = layout.offsets()
    assert all(o % ALIGN == 0 for o in offsets.values())  # 128-byte aligned segments
    assert max(offsets, key=offsets.get) == "tables"
    assert layout.size == offsets["tables"] + 5 * 9
    assert layout.copy_size(2) == offsets["tables"] + 2 * 9


def test_buffers_are_reused_and_grow_only_when_needed():
    rng = random.Random(1)
    small, big = _random_runs(rng, 2), _random_runs(rng, 40)
    layout, buffers, _ = _stage(small)
    before = buffers.dev.data_ptr()
    buffers.stage(layout, small, BS)
    assert buffers.dev.data_ptr() == before  # no allocation per step
    big = order_runs(big)
    big_layout = MetaLayout(
        sum(r.q_len for r in big), len(big), sum(r.sample for r in big), table_width(big, BS)
    )
    buffers.stage(big_layout, big, BS)
    assert buffers.capacity >= big_layout.size
    fixed = StepBuffers(layout.size, CPU, pin=False, growable=False)
    with pytest.raises(ValueError, match="exceeds"):
        fixed.stage(big_layout, big, BS)


def test_a_decode_batch_is_padded_to_its_bucket_with_a_padding_block():
    runs = order_runs(_random_runs(random.Random(2), 5, decodes_only=True))
    padded = pad_decodes(runs, 8, pad_block=99)
    assert padded[:5] == runs and len(padded) == 8
    assert all(
        p.token_ids == [0] and p.ctx_before == 0 and p.block_table == [99] for p in padded[5:]
    )
    assert not any(p.sample for p in padded[5:])
    width = 20
    layout = MetaLayout(8, 8, 8, width)
    buffers = StepBuffers(layout.size, CPU, pin=False, growable=False)
    buffers.dev.fill_(-1)  # whatever a previous step left
    meta = buffers.stage(layout, padded, BS, rows=5)
    assert meta.slots[5:].tolist() == [99 * BS] * 3  # padding writes only into block 99
    assert meta.positions[5:].tolist() == [0] * 3 and meta.req_ctx[5:].tolist() == [1] * 3
    assert meta.logits_rows[: sum(r.sample for r in runs)].tolist() == [
        i for i, r in enumerate(runs) if r.sample
    ]
    assert (meta.tables[5:] == -1).all()  # rows past the copied ones are not sent
    with pytest.raises(ValueError, match="bucket"):
        pad_decodes(runs, 4, pad_block=99)


def test_fill_handles_contexts_past_one_block_column():
    runs = [TokenRun("a", [5], 3 * BS + 2, [7, 3, 9, 4]), TokenRun("b", [1, 2, 3], 0, [6])]
    layout, _, meta = _stage(runs)
    assert layout.width == 4 and meta.tables.tolist() == [[7, 3, 9, 4], [6, 0, 0, 0]]
    assert meta.slots.tolist() == [4 * BS + 2, 6 * BS, 6 * BS + 1, 6 * BS + 2]
    assert meta.positions.tolist() == [3 * BS + 2, 0, 1, 2]


# -- batched sampling: one pass, one packed result ---------------------------------------------


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.9, min_p=0.3),
    SamplingParams(temperature=2.0, top_k=1),  # greedy
    SamplingParams(temperature=1.0, top_p=1.0, seed=3),
    SamplingParams(repetition_penalty=1.3, logit_bias=((4, 5.0),)),  # greedy, adjusted
]


def test_the_batched_filter_allows_the_tokens_the_row_filter_does():
    logits = _logits(len(PARAMS))
    mask = allowed_mask(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        if p.greedy:  # its token is the argmax, which every filter keeps
            assert mask[i, logits[i].argmax()]
            continue
        x = _filter(logits[i], p)
        if p.min_p:
            x = _min_p(x, p.min_p)
        assert mask[i].tolist() == (x > float("-inf")).tolist(), p


def test_batched_sampling_matches_the_row_sampler_where_it_is_deterministic():
    logits = _logits(len(PARAMS), seed=1)
    histories = [[1, 2, 3, 4]] * len(PARAMS)
    packed = sample_batch(logits, PARAMS, [2] * len(PARAMS), histories)
    assert packed.dtype == torch.float64 and packed.shape == (len(PARAMS), 2)
    tokens, logprobs, tops = unpack_samples(packed.tolist(), PARAMS)
    ref_tokens, ref_logprobs = sample(logits, PARAMS, [2] * len(PARAMS), histories)
    raw = torch.log_softmax(logits, -1)
    for i, p in enumerate(PARAMS):
        assert logprobs[i] == raw[i, tokens[i]].item()  # the raw distribution's, exactly
        if p.greedy:
            assert tokens[i] == ref_tokens[i] and logprobs[i] == ref_logprobs[i]
        else:
            assert allowed_mask(logits[i : i + 1], [p])[0, tokens[i]]
    assert tops == [[]] * len(PARAMS)


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    """The k-th token of a seeded request depends on (seed, k) only, not on its neighbours."""
    p = SamplingParams(temperature=1.5, seed=11)
    row = _logits(1, vocab=500, seed=4)
    alone = [sample_batch(row, [p], [k])[0, 0].item() for k in range(20)]
    for k in range(20):
        others = _logits(5, vocab=500, seed=100 + k)
        batch = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(temperature=1.0)] * 2 + [p] + [SamplingParams(top_k=3)] * 3
        assert sample_batch(batch, params, [7, 7, k, 7, 7, 7])[2, 0].item() == alone[k]
    assert len(set(alone)) > 3  # and it is random across k


def test_top_alternatives_ride_in_the_same_tensor():
    logits = _logits(3, seed=5)
    params = [SamplingParams(top_logprobs=3), SamplingParams(), SamplingParams(top_logprobs=1)]
    packed = sample_batch(logits, params, [0, 0, 0])
    assert packed.shape == (3, 2 + 2 * 3)
    _, _, tops = unpack_samples(packed.tolist(), params)
    assert tops == top_alternatives(logits, params)


# -- the packed path end to end, under Triton's interpreter ------------------------------------


def interpreted_check(model_dir: str) -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1: the packed runtime (one metadata buffer,
    decode steps replayed as padded buckets through `eager_capture`) against the CPU engine."""
    from lab.executor.driver import Driver
    from lab.executor.testing import teacher_forced_logits
    from services.executor.engine import Engine

    common = {"device": "cpu", "dtype": "fp32", "block_size": 8, "num_host_blocks": 2}
    ref = Engine(model_dir, num_device_blocks=96, **common)
    options = RuntimeOptions(step_runtime="packed", graph_max_batch=8)
    packed = Engine(
        model_dir, attention_backend="triton", num_device_blocks=96, runtime=options, **common
    )
    prompts = [list(range(200, 230)), list(range(1000, 1009)), list(range(5000, 5017))]
    a = teacher_forced_logits(ref, prompts, [1, 7, None])
    b = teacher_forced_logits(packed, prompts, [1, 7, None])
    replayed: list[int] = []

    def capture(body):
        def replay():
            out = body()
            replayed.append(out.shape[0])
            return out

        return replay

    packed.runtime.capture_graphs(capture)
    many = [p[: 5 + i] for i, p in enumerate(prompts * 4)]  # 12 requests
    lens = [2 + (i * 5) % 11 for i in range(12)]  # finishing one after another: batches 12..1
    ours = Driver(packed, token_budget=64, max_batch=12).generate(many, lens)
    theirs = Driver(ref, token_budget=64, max_batch=12).generate(many, lens)
    return {
        "max_diff": max(float((x - y).abs().max()) for x, y in zip(a, b)),
        "same_tokens": [s.output for s in ours] == [s.output for s in theirs],
        "buckets": sorted(packed.runtime.graphs.replays),
        "replayed": sorted(set(replayed)),
        "pad_block": packed.runtime.pad_block,
        "pool_blocks": [packed.num_device_blocks, packed.cache.num_blocks],
    }


def test_packed_path_and_padded_replays_match_the_cpu_engine(tmp_path):
    from lab.executor.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama", seed=2)
    code = (
        "import json; from tests.unit.test_executor_graphs import interpreted_check; "
        f"print(json.dumps(interpreted_check({str(model)!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_diff"] < 1e-4, result
    assert result["same_tokens"], result
    assert result["buckets"] == [1, 2, 4, 8]
    # replays ran with padded batches (12 requests decode eagerly: no bucket holds them)
    assert set(result["replayed"]) <= {1, 2, 4, 8} and len(result["replayed"]) >= 3, result
    assert result["pool_blocks"] == [96, 97] and result["pad_block"] == 96
