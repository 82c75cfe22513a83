"""Deterministic mode on CUDA (batch_invariant.py): the fixed-configuration Triton product's
rows do not depend on the batch; a request's bf16 logits are bit-identical alone, decoded one
token a step and in mixed batches at other chunk sizes; 64 greedy requests produce the same
tokens all at once, in small batches and again; the families it cannot cover are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.executor.driver import Driver
from lab.executor.testing import teacher_forced_logits
from services.executor import triton_matmul
from services.executor.cuda_runtime import RuntimeOptions
from services.executor.engine import Engine
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY

PROMPT = list(range(300, 340))
OTHERS = [list(range(1000, 1091)), list(range(40, 49)), list(range(7000, 7017))]


def _engine(model_dir, deterministic: bool = True) -> Engine:
    options = RuntimeOptions(max_num_batched_tokens=512, max_num_seqs=64, graph_max_batch=64)
    engine = Engine(
        model_dir, device="cuda", dtype="bf16", kv_memory_gb=1.0, num_host_blocks=4,
        runtime=options, deterministic=deterministic,
    )  # fmt: skip
    engine.warm_up()
    return engine


@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336), (49152, 576)])
def test_product_rows_do_not_depend_on_the_batch(n, k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    x = torch.randn(300, k, device="cuda", generator=gen).bfloat16()
    alone = triton_matmul.linear(x[:1], w)[0]
    for m in (2, 3, 63, 64, 65, 128, 300):
        assert torch.equal(triton_matmul.linear(x[:m], w)[0], alone), m
        shuffled = torch.cat([x[1:m], x[:1]])  # the row last, beside other rows
        assert torch.equal(triton_matmul.linear(shuffled, w)[m - 1], alone), m
    ref = F.linear(x.float(), w.float())
    err = (triton_matmul.linear(x, w).float() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, err  # bf16 output rounding


def test_logits_equal_alone_batched_and_chunked(smollm2_dir):
    engine = _engine(smollm2_dir)
    alone = teacher_forced_logits(engine, [PROMPT], [None])[0]
    by_token = teacher_forced_logits(engine, [PROMPT], [1])[0]
    mixed = teacher_forced_logits(engine, [OTHERS[0], PROMPT, OTHERS[1]], [5, 7, None])[1]
    mixed3 = teacher_forced_logits(engine, [PROMPT, *OTHERS], [3, 1, 64, 2])[0]
    for other in (by_token, mixed, mixed3):
        assert torch.equal(alone, other), (alone - other).abs().max()


def _prompts() -> list[list[int]]:
    return [list(range(100 + 37 * i, 100 + 37 * i + 5 + (i * 13) % 90)) for i in range(64)]


def test_64_greedy_requests_do_not_depend_on_batching(smollm2_dir):
    """All 64 at once (budget 512), in batches of at most 5 with 16-token chunks, and all at
    once again: the same tokens. Prints how many the default mode changes."""
    prompts, n = _prompts(), 24
    engine = _engine(smollm2_dir)
    wide = [s.output for s in Driver(engine, 512, 64).generate(prompts, n)]
    narrow = [s.output for s in Driver(engine, 16, 5).generate(prompts, n)]
    again = [s.output for s in Driver(engine, 512, 64).generate(prompts, n)]
    assert all(len(o) == n for o in wide)
    assert narrow == wide and again == wide
    del engine
    default = _engine(smollm2_dir, deterministic=False)
    a = [s.output for s in Driver(default, 512, 64).generate(prompts, n)]
    b = [s.output for s in Driver(default, 16, 5).generate(prompts, n)]
    print(f"default mode: {sum(x != y for x, y in zip(a, b))}/64 requests differ")


def test_families_outside_the_fused_layer_are_refused(family_dirs):
    with pytest.raises(ValueError, match="ALISE_DETERMINISTIC"):
        Engine(family_dirs["qwen3"], device="cuda", dtype="bf16", kv_memory_gb=0.1,
               num_host_blocks=1, deterministic=True)  # fmt: skip
