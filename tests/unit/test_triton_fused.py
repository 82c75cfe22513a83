"""The fused Triton kernels (residual add + RMSNorm, RoPE with contiguous q/k/v, SiLU-and-mul)
equal the unfused torch path under TRITON_INTERPRET=1 on CPU: each kernel on random rows,
and a tiny Llama engine's logits with the fused kernels on and off (one interpreter
subprocess: the interpreter must be chosen before Triton is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.executor.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BF16_ULP = 2.0**-7  # relative: one rounding flip of a bf16 value


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=1)
    proc = subprocess.run(
        [sys.executable, "-m", "lab.executor.fused_check", "--engine", str(model)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["add_rms_norm", "silu_and_mul", "rope_qkv"])
def test_fused_kernels_round_as_the_unfused_path(interpreted, kernel):
    errors = interpreted[kernel]
    assert errors["float32"] <= 1e-5, errors
    assert errors["bfloat16"] <= BF16_ULP, errors  # measured 0 under the interpreter


def test_an_engine_gives_the_same_logits_fused_or_not(interpreted):
    assert interpreted["engine"]["fp32"] <= 1e-4, interpreted["engine"]
    assert interpreted["engine"]["bf16"] == 0.0, interpreted["engine"]  # the same roundings
