"""The bundled SmolLM2 served as its GGUF's own 4-bit weights (ALISE_QUANTIZATION=auto, what
`alise serve` does on CPU) against the same file dequantized into the model dtype: perplexity
of a fixed 256-token passage within 2% (measured +0.3% for INT4 and +0.4% for INT8 over 512
tokens in bf16 on an AVX-512 machine; `alise bench wquant` has the figures and speeds), and explicit INT8 likewise."""

from __future__ import annotations

import pytest
import torch

from lab.executor.quality import passage
from lab.executor.testing import perplexity, teacher_forced_logits
from services.common.models import weights_dir
from services.common.settings import ExecutorSettings
from services.executor.engine import Engine

BOUND = 0.02
CHUNK = 32  # tokens a step: the packed products (wquant.PACKED_MAX_ROWS); wider use dense


@pytest.fixture(scope="module")
def model_dir():
    settings = ExecutorSettings()
    return weights_dir(settings.model, settings.data_dir)


@pytest.fixture(scope="module")
def ids(model_dir):
    from transformers import AutoTokenizer

    return passage(AutoTokenizer.from_pretrained(model_dir), 256)


def _ppl(model_dir, ids, quantization: str) -> tuple[float, str]:
    engine = Engine(
        model_dir, device="cpu", dtype="auto", num_device_blocks=40, num_host_blocks=1,
        quantization=quantization,
    )  # fmt: skip
    with torch.inference_mode():
        logits = teacher_forced_logits(engine, [ids], [CHUNK])[0]
    return perplexity(logits, ids), engine.describe()["weights"]


@pytest.fixture(scope="module")
def full_precision(model_dir, ids):
    return _ppl(model_dir, ids, "none")


@pytest.mark.parametrize("quantization,served", [("auto", "int4"), ("int8", "int8")])
def test_packed_weights_keep_the_perplexity(model_dir, ids, full_precision, quantization, served):
    ppl, weights = _ppl(model_dir, ids, quantization)
    assert weights == served
    assert full_precision[1] in ("bfloat16", "float32")
    assert abs(ppl / full_precision[0] - 1) <= BOUND, (ppl, full_precision)


def test_the_check_catches_weights_a_code_off(model_dir, ids, full_precision, monkeypatch):
    """INT4 zeros one grid step off (every weight one code too high) fail the check."""
    from services.executor import wquant

    quantize = wquant.quantize_int4

    def off(w, dtype):
        packed = quantize(w, dtype)
        packed.scales_zeros[..., 1] += packed.scales_zeros[..., 0]
        return packed

    monkeypatch.setattr(wquant, "quantize_int4", off)
    ppl, _ = _ppl(model_dir, ids, "int4")
    assert abs(ppl / full_precision[0] - 1) > BOUND
