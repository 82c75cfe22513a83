"""The fused Triton kernels (residual add + RMSNorm, RoPE with contiguous q/k/v, SiLU-and-mul)
equal the unfused torch path under TRITON_INTERPRET=1 on CPU: each kernel on random rows,
and a tiny Llama engine's logits with the fused kernels on and off (one interpreter
subprocess: the interpreter must be chosen before Triton is first imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.executor.testing import interpreted_check
from lab.executor.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BF16_ULP = 2.0**-7  # relative: one rounding flip of a bf16 value


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=1)
    return interpreted_check(["-m", "lab.executor.fused_check", "--engine", str(model)])


@pytest.mark.parametrize("kernel", ["add_rms_norm", "silu_and_mul", "rope_qkv"])
def test_fused_kernels_round_as_the_unfused_path(interpreted, kernel):
    errors = interpreted[kernel]
    assert errors["float32"] <= 1e-5, errors
    assert errors["bfloat16"] <= BF16_ULP, errors  # measured 0 under the interpreter


def test_an_engine_gives_the_same_logits_fused_or_not(interpreted):
    assert interpreted["engine"]["fp32"] <= 1e-4, interpreted["engine"]
    assert interpreted["engine"]["bf16"] == 0.0, interpreted["engine"]  # the same roundings
