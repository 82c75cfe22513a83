"""Triton kernels (unified paged attention with split-KV and fused INT8 dequantization, KV
write, block quantize) equal the torch reference: on CPU under TRITON_INTERPRET=1 (in one
subprocess, because the interpreter must be chosen before Triton is first imported), natively
on a GPU when present. The case matrix is lab/executor/triton_check.py's CASES: D 64/128,
G 1/4/7/8, blocks 16/32, fp32 / bf16 / fp16 / INT8 KV, split-KV off and on, contexts up to
2,048 tokens, decodes and prefill chunks in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.executor.testing import interpreted_checks
from lab.executor.tiny import make_tiny_model
from lab.executor.triton_check import CASES, Case

ROOT = Path(__file__).resolve().parents[2]
ENGINE_TOL = 1e-4  # fp32 logits of the tiny model, torch backend against Triton
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(case: Case, result: dict) -> None:
    assert result["out"] <= case.tol, (case.name, result)
    assert result["cache"] == 0.0, (case.name, result)  # same codes, scales and exact values
    if case.splits is None:  # the rule's case: a decode-only step with long contexts
        assert result["splits"] > 1, result
    else:
        assert result["splits"] == case.splits, result


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    """Sliding windows (12 keys) and attention soft-capping (lab/executor/tiny.py)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "gemma2", "gemma2", seed=1)


@pytest.fixture(scope="module")
def interpreted(tiny_llama, tiny_gemma2) -> dict:
    """Every case, the padding write and the engine comparisons, in two interpreter processes
    at once (half the cases each, one with the engines, the other with the windowed one)."""
    check = ["-m", "lab.executor.triton_check"]
    first, second = interpreted_checks(
        [
            [*check, "--shard", "0/2", "--engine", str(tiny_llama)],
            [*check, "--shard", "1/2", "--windowed", str(tiny_gemma2)],
        ],
        timeout=600,
    )
    assert not set(first["cases"]) & set(second["cases"])
    merged = first | {"windowed_engine": second["windowed_engine"]}
    merged["cases"] = first["cases"] | second["cases"]
    merged["padding_write"] = max(first["padding_write"], second["padding_write"])
    return merged


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_matches_torch_under_interpreter(interpreted, case):
    _check(case, interpreted["cases"][case.name])


def test_padding_slots_write_nothing_under_interpreter(interpreted):
    assert interpreted["padding_write"] == 0.0


def test_engine_on_triton_matches_torch_under_interpreter(interpreted):
    """Whole tiny-model engines, decodes, 7-token chunks and a whole prompt in mixed steps:
    fp KV at block 16, INT8 KV at block 8."""
    assert set(interpreted["engine"]) == {"auto-bs16", "int8-bs8"}
    for name, diff in interpreted["engine"].items():
        assert diff < ENGINE_TOL, (name, diff)


def test_windowed_soft_capped_engine_on_triton_matches_torch_under_interpreter(interpreted):
    """Gemma 2's interleaved 12-key windows and soft-capped scores, prompts past the window."""
    assert interpreted["windowed_engine"] < ENGINE_TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_matches_torch_on_gpu(case):
    from lab.executor.triton_check import compare_case

    _check(case, compare_case(case, "cuda"))


@pytest.mark.gpu
@needs_cuda
def test_padding_and_engine_on_gpu(tiny_llama):
    from lab.executor.triton_check import engine_parity, padding_write

    assert padding_write("cuda") == 0.0
    for kv, bs in (("auto", 16), ("int8", 8)):
        assert engine_parity(str(tiny_llama), kv, bs, "cuda") < ENGINE_TOL


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu():
    """`attention_backend=auto` picks the Triton kernels for a CUDA device and the torch
    reference on CPU (the choice is made without touching the device)."""
    from services.executor.attention_backends import make_attention
    from services.executor.config import ModelSpec

    spec = ModelSpec(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
        max_model_len=64,
    )
    triton, reference = (make_attention(spec, "auto", torch.device(d)) for d in ("cuda", "cpu"))
    assert (triton.name, reference.name) == ("triton", "torch")
    # ragged kernels pad nothing, so only the torch backend splits batches by context
    assert triton.group_cost is None and reference.group_cost == 1024
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_attention(spec, "triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention(spec, "flash", torch.device("cpu"))
