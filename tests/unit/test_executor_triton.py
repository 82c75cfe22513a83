"""Triton kernels (paged attention with fused INT8 dequantization, KV write, block quantize)
equal the torch reference: on CPU under TRITON_INTERPRET=1 (in a subprocess, because the
interpreter must be chosen before Triton is first imported), natively on a GPU when present."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

TOL = 1e-4


def _check(results: dict) -> None:
    assert set(results) == {"auto", "int8"}
    for kv, diffs in results.items():
        assert diffs["out"] < TOL, (kv, diffs)
        assert diffs["cache"] == 0.0, (kv, diffs)  # same codes, scales and exact values


def test_triton_kernels_match_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "services.executor.triton_check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_torch_on_gpu():
    from services.executor.triton_check import compare

    _check(compare("cuda"))


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu():
    """`attention_backend=auto` picks the Triton kernels for a CUDA device and the torch
    reference on CPU (the choice is made without touching the device)."""
    from services.executor.config import ModelSpec
    from services.executor.runner import make_attention

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
