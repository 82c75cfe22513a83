"""The fused Triton mixture-of-experts kernels (services/executor/triton_moe.py) equal a
per-expert reference under TRITON_INTERPRET=1 on CPU (one interpreter subprocess running
lab/executor/moe_check.py: the interpreter must be chosen before Triton is first imported),
within a bound set by the reference's own rounding; a wrong expert's weights break the bound.
The layout (tiles, padded expert blocks) and the switch in moe.py are checked here directly,
without Triton."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from lab.executor.moe_check import CASES
from lab.executor.testing import interpreted_check
from lab.executor.tiny import make_tiny_model
from services.common.arith import ceil_div
from services.executor import moe, moe_layout
from services.executor.cpu_kernels import silu_and_mul
from services.executor.moe import MoeWeights
from services.executor.moe_layout import align, moe_tiles

ROOT = Path(__file__).resolve().parents[2]
# |fused - exact| <= SLACK x |reference - exact|: the same roundings in another summation order
# (measured: bf16 1.0, the same values; fp32 up to 2.2)
SLACK = 4.0


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Every case, and a tiny Qwen3-MoE engine (8 experts, top 3, not renormalised)."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3_moe", "qwen3_moe", seed=1)
    check = ["-m", "lab.executor.moe_check", "--engine", str(model), "--engine-dtypes", "fp32"]
    return interpreted_check(check)


@pytest.fixture(scope="module")
def cases(interpreted) -> dict:
    return interpreted["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_experts_equal_the_per_expert_reference(cases, case):
    got = cases[case.name]
    assert got["reference"] > 0, got  # the bound is not vacuous
    assert got["fused"] <= SLACK * got["reference"], got
    assert got["vs_reference"] <= SLACK * got["reference"], got


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_wrong_experts_weights_break_the_bound(cases, case):
    got = cases[case.name]
    assert got["planted"] > 10 * SLACK * got["reference"], got  # measured: 150x and more


def test_the_cases_cover_top_k_renormalisation_and_idle_experts(cases):
    assert {c.top_k for c in CASES} == {1, 2}
    assert {c.renormalize for c in CASES} == {True, False}
    assert {c.dtype for c in CASES} == {torch.float32, torch.bfloat16}
    assert all(cases[c.name]["empty_experts"] > 0 for c in CASES if c.experts == 16)


def test_an_engine_gives_the_same_logits_with_the_fused_experts_or_not(interpreted):
    """Through llama.py's layers: prefill chunks and decodes, a dense layer among MoE ones
    (fp32 here, for time; bf16 measured equal, 0.0, by `moe_check --engine`)."""
    assert interpreted["engine"]["fp32"] <= 1e-4, interpreted["engine"]  # measured 1.4e-6


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_pads_each_expert_to_whole_blocks(block_m):
    experts, k = 6, 2
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, experts - 1, (23 * k,), generator=gen)  # the last expert: idle
    ids, block_experts = align(flat, experts, block_m)
    n = flat.numel()
    assert ids.numel() == block_experts.numel() * block_m
    assert ids.numel() <= n + experts * (block_m - 1)
    real = ids[ids < n].long()
    assert sorted(real.tolist()) == list(range(n))  # every assignment once
    row_expert = block_experts.long().repeat_interleave(block_m)
    assert torch.equal(row_expert[ids < n], flat[real])  # each row in its expert's block
    used = int((block_experts < experts).sum())
    assert used == sum(ceil_div(int((flat == e).sum()), block_m) for e in range(experts))
    assert (block_experts[used:] == experts).all()  # the unused tail: skipped by the kernels


def test_tiles_share_block_m_and_fit_the_matrix():
    for rows in (1, 16, 200, 5000, 100_000):
        up, down = moe_tiles(rows, 8, 14336, 4096, torch.bfloat16)
        assert up.block_m == down.block_m
    small, large = (moe_tiles(r, 8, 14336, 4096, torch.bfloat16)[0] for r in (2, 50_000))
    assert (small.block_m, large.block_m) == (16, 128)
    up, down = moe_tiles(14, 4, 24, 48, torch.float32)  # capped by the matrix
    assert (up.block_n, up.block_k, down.block_n, down.block_k) == (32, 64, 64, 32)
    up, down = moe_tiles(14, 4, 8, 8, torch.float32)  # at least tl.dot's 16
    assert (up.block_n, up.block_k, down.block_n, down.block_k) == (16, 16, 16, 16)


def _weights(dtype: torch.dtype) -> MoeWeights:
    return MoeWeights(
        torch.zeros(4, 8), torch.zeros(4, 6, 8, dtype=dtype), torch.zeros(4, 8, 3), 2, True
    )


def test_the_fused_path_is_chosen_for_cuda_silu_and_matching_weights(monkeypatch):
    x, w = torch.zeros(2, 8), _weights(torch.float32)
    assert not moe._fused(x, w, silu_and_mul)  # CPU: the grouped torch path
    monkeypatch.setattr(moe, "TRITON", True)
    assert moe._fused(x, w, silu_and_mul)
    assert not moe._fused(x, w, torch.nn.functional.gelu)  # only SiLU gating is fused
    assert not moe._fused(x, _weights(torch.bfloat16), silu_and_mul)  # other weight dtypes


def test_the_fused_path_never_waits_for_the_device():
    """No host synchronisation in the layout or the launches (CUDA graphs can hold them)."""
    from_device = {"item", "tolist", "cpu", "numpy", "nonzero", "unique", "bincount"}
    source = inspect.getsource(moe_layout.align)
    source += (ROOT / "services/executor/triton_moe.py").read_text(encoding="utf-8")
    calls = {
        node.func.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not calls & from_device, calls & from_device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_experts_equal_the_per_expert_reference_on_gpu(case):
    from lab.executor.moe_check import compare_case

    got = compare_case(case, "cuda")
    assert got["fused"] <= SLACK * got["reference"], got
    assert got["planted"] > SLACK * got["reference"], got
