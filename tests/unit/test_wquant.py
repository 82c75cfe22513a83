"""Weight-only INT4/INT8 linear layers (services/executor/wquant.py): the packed products equal
the dequantized weights' products, the bundled GGUF's Q4_1 weights come back on their own
codes, and `auto` picks the format from the GGUF's tensor types."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.common.models import BUNDLED, GGUF_TYPES, resolve
from services.executor import wquant
from services.executor.runner import resolve_quantization


def _error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max())


@pytest.mark.parametrize("mode", wquant.MODES)
def test_packed_products_equal_the_dequantized_weights_products(mode):
    """Against fp32 products with the dequantized weights, a packed product is as close as a
    bf16 product with those same weights (x 2: both round the output to bf16)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 192, generator=gen) * 0.05
    packed = wquant.quantize(w, mode, torch.bfloat16)
    deq = packed.dequantized()
    for rows in (1, 5, 33):
        x = torch.randn(rows, 192, generator=gen).bfloat16()
        ref = x.float() @ deq.t()
        bf16 = _error(torch.nn.functional.linear(x, deq.bfloat16()), ref)
        assert _error(wquant.linear(x, packed), ref) <= 2 * bf16 + 1e-6
    # and the dequantized weights are the quantization of w: within half a step of it
    step = w.reshape(96, -1, wquant.GROUP).amax(-1) - w.reshape(96, -1, wquant.GROUP).amin(-1)
    bound = (step / 15).max() if mode == "int4" else (w.abs().amax(1) / 127).max()
    assert float((deq - w).abs().max()) <= 0.51 * float(bound) + 1e-3 * float(w.abs().max())


def test_a_planted_wrong_zero_point_is_caught():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    packed = wquant.quantize_int4(w, torch.float32)
    x = torch.randn(4, 128)
    good = _error(wquant.linear(x, packed), x @ packed.dequantized().t())
    packed.scales_zeros[..., 1] += packed.scales_zeros[..., 0]  # zero one code off
    assert _error(wquant.linear(x, packed), x @ w.t()) > 10 * max(good, 1e-4)


def test_bias_and_leading_dimensions_pass_through():
    w = torch.randn(32, 64)
    bias = torch.randn(32)
    packed = wquant.quantize_int8(w, torch.float32)
    x = torch.randn(2, 3, 64)
    y = wquant.linear(x, packed, bias)
    assert y.shape == (2, 3, 32)
    ref = x @ packed.dequantized().t() + bias
    assert _error(y, ref) < 1e-3


def _bundled_q4_1(name: str) -> torch.Tensor:
    """One of the bundled GGUF's Q4_1 weights dequantized by the gguf package (fp32)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(resolve(next(iter(BUNDLED))).gguf_file()))
    t = next(t for t in reader.tensors if t.name == name)
    assert t.tensor_type.name == "Q4_1"
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight"])
def test_the_bundled_q4_1_weights_come_back_on_their_own_codes(name):
    """Requantized in fp32, every weight is its file value to float rounding: a code one off
    anywhere would be a whole grid step (the group's range / 15) away."""
    w = _bundled_q4_1(name)
    back = wquant.quantize_int4(w, torch.float32).dequantized()
    groups = w.reshape(w.shape[0], -1, wquant.GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert float((back - w).abs().max()) < 1e-3 * float(step[step > 0].min())


def test_auto_serves_a_gguf_model_at_its_files_bit_width(tmp_path):
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", tmp_path, cpu) == "none"  # no GGUF source
    for types, mode in (({"blk.0.ffn_up.weight": "Q4_1"}, "int4"),
                        ({"blk.0.ffn_up.weight": "Q8_0"}, "int8"),
                        ({"blk.0.ffn_up.weight": "F16"}, "none")):  # fmt: skip
        (tmp_path / GGUF_TYPES).write_text(json.dumps({"token_embd.weight": "Q8_0", **types}))
        assert resolve_quantization("auto", tmp_path, cpu) == mode
    (tmp_path / GGUF_TYPES).write_text(json.dumps({"blk.0.ffn_up.weight": "Q4_1"}))
    assert resolve_quantization("auto", tmp_path, cpu, deterministic=True) == "none"
    assert resolve_quantization("auto", tmp_path, torch.device("cuda")) == "none"
    assert resolve_quantization("int8", tmp_path, cpu) == "int8"
    with pytest.raises(ValueError, match="deterministic"):
        resolve_quantization("int4", tmp_path, cpu, deterministic=True)
    with pytest.raises(ValueError, match="CPU only"):
        wquant.check_supported("int4", torch.device("cuda"))


def test_wide_products_read_the_dense_copy_narrow_ones_the_packed_weights():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    packed = wquant.quantize(w, "int4", torch.bfloat16, keep_dense=True)
    for rows in (1, wquant.PACKED_MAX_ROWS, wquant.PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 128).bfloat16()
        dense = torch.nn.functional.linear(x, w)
        narrow = packed.matmul(x)
        want = dense if rows > wquant.PACKED_MAX_ROWS else narrow
        assert torch.equal(wquant.linear(x, packed), want), rows
    assert wquant.quantize(w, "int8", torch.bfloat16).dense is None  # not kept unless asked
