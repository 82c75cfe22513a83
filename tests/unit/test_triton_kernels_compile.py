"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU: Triton's compiler
and the ptxas its wheel ships, in a subprocess without TRITON_INTERPRET. This is what caught
`quantize_blocks` taking a reduction axis from a run-time conditional, which the interpreter
accepts and a GPU compile refuses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.executor.triton_compile import variants
from services.executor.moe_layout import TILE_TABLE

ROOT = Path(__file__).resolve().parents[2]
H100_SHARED_BYTES = 227 * 1024  # the most shared memory one H100 block may use
SHARDS = 2  # compiler processes


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="Triton without its CUDA backend",
)
def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    """Two compiler processes, each half of the variants (one per core of a 2-core machine)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}  # really compile
    command = [sys.executable, "-m", "lab.executor.triton_compile", "--arch", "90"]
    procs = [
        subprocess.Popen(
            [*command, "--shard", f"{i}/{SHARDS}"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(SHARDS)
    ]
    compiled: dict[str, dict[str, int]] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = out.strip().splitlines()
        assert lines, err[-3000:]
        result = json.loads(lines[-1])
        assert result["failed"] == {}, result["failed"]
        assert proc.returncode == 0, err[-3000:]
        assert not set(compiled) & set(result["compiled"])
        compiled |= result["compiled"]
    assert set(compiled) == {v.name for v in variants()}
    for name, info in compiled.items():
        assert 0 <= info["shared"] <= H100_SHARED_BYTES, (name, info)


def test_compiled_variants_cover_the_supported_shapes():
    names = [v.name for v in variants()]
    assert len(names) == len(set(names))
    needles = ("-d64-", "-d128-", "-int8-", "-fp-", "-bs32-", "-g7-", "-split4-", "bf16")
    needles += tuple(f"-bm{row[1]}" for row in TILE_TABLE)  # every row of the MoE tile table
    for needle in needles:
        assert any(needle in n for n in names), needle
    kernels = {v.kernel for v in variants()}
    assert kernels == {
        "paged_attention",
        "reduce_splits",
        "write_kv",
        "quantize_blocks",
        "add_rms_norm_kernel",
        "silu_mul_kernel",
        "rope_qkv_kernel",
        "moe_gate_up_kernel",
        "moe_down_kernel",
    }
