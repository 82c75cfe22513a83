"""FP8 weights (services/executor/fp8.py): checkpoints in each format this executor reads
load with the logits of the same checkpoint dequantized (a reference written here with its
own dequantization, run by transformers and by the engine), a wrong scale fails that check,
ALISE_QUANTIZATION=fp8 equals the rounding it documents, MoE experts and INT8 KV work with
FP8 weights, and an unsupported quantization is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import make_tiny_model
from services.executor import fp8
from services.executor.engine import Engine

PROMPTS = [list(range(200, 260)), list(range(1000, 1013))]
TOL = 1e-4  # fp32 logits of the same weights (the parity tests' bound)
E4M3 = torch.float8_e4m3fn


def _linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and "embed" not in name and "lm_head" not in name and ".gate." not in name


def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale) of w [N, K] as each format stores them."""
    x = w.float()
    if layout == "tensor":
        scale = x.abs().max() / 448
        return (x / scale).to(E4M3), scale.reshape(1)
    if layout == "channel":
        scale = x.abs().amax(dim=1, keepdim=True) / 448
        return (x / scale).to(E4M3), scale
    bn = bk = 32  # blocks
    n, k = x.shape
    blocks = x.reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448  # [n/bn, k/bk]
    q = (blocks / scale[:, None, :, None]).to(E4M3).reshape(n, k)
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, layout: str) -> torch.Tensor:
    if layout != "block":
        return q.float() * scale
    n, k = q.shape
    s = scale[:, None, :, None].expand(-1, 32, -1, 32).reshape(n, k)
    return q.float() * s


FORMATS = {  # name: (quantization_config, layout, scale tensor suffix)
    "fp8-block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
        "block",
        "weight_scale_inv",
    ),
    "fp8-tensor": (
        {"quant_method": "fp8", "activation_scheme": "static"},
        "tensor",
        "weight_scale",
    ),
    "compressed-tensors-channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        },
        "channel",
        "weight_scale",
    ),
}


def write_fp8(src: Path, out: Path, fmt: str, ref: Path) -> None:
    """`src` (safetensors, fp32) as an FP8 checkpoint of format `fmt` in `out`, and the same
    weights dequantized (this file's own arithmetic) as a plain checkpoint in `ref`."""
    config, layout, suffix = FORMATS[fmt]
    shutil.copytree(src, out)
    shutil.copytree(src, ref)
    state, quantized, plain = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in state.items():
        if _linear(name, t):
            q, scale = _quantize(t, layout)
            base = name.removesuffix(".weight")
            quantized[name], quantized[f"{base}.{suffix}"] = q, scale.float()
            if layout == "tensor":
                quantized[f"{base}.input_scale"] = torch.ones(1)
            plain[name] = _dequantize(q, scale, layout)
        else:
            quantized[name] = plain[name] = t
    save_file(quantized, str(out / "model.safetensors"))
    save_file(plain, str(ref / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": config}))


def _logits(model_dir: Path, **kw) -> list[torch.Tensor]:
    engine = Engine(model_dir, device="cpu", dtype="fp32", num_device_blocks=24, **kw)
    return teacher_forced_logits(engine, PROMPTS, [7, None])


def _hf_logits(model_dir: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in PROMPTS]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=9, head_dim=64)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_fp8_checkpoint_loads_with_its_dequantized_logits(tiny, tmp_path, fmt):
    write_fp8(tiny, tmp_path / "fp8", fmt, tmp_path / "ref")
    engine = Engine(tmp_path / "fp8", device="cpu", dtype="fp32", num_device_blocks=24)
    assert engine.describe()["weights"] == "fp8"
    ours = teacher_forced_logits(engine, PROMPTS, [7, None])
    assert _max_diff(ours, _hf_logits(tmp_path / "ref")) < TOL
    assert _max_diff(ours, _logits(tiny)) > 10 * TOL  # the weights really were rounded


def test_a_wrong_scale_fails_the_check(tiny, tmp_path, monkeypatch):
    write_fp8(tiny, tmp_path / "fp8", "compressed-tensors-channel", tmp_path / "ref")
    real = fp8.dequantize
    monkeypatch.setattr(fp8, "dequantize", lambda w, s: real(w, s * 1.05))
    assert _max_diff(_logits(tmp_path / "fp8"), _hf_logits(tmp_path / "ref")) > 10 * TOL


def test_quantization_fp8_rounds_through_fp8_per_channel(tiny, tmp_path):
    ref = tmp_path / "ref"
    shutil.copytree(tiny, ref)
    state = load_file(str(tiny / "model.safetensors"))
    rounded = {
        n: _dequantize(*_quantize(t, "channel"), "channel") if _linear(n, t) else t
        for n, t in state.items()
    }
    save_file(rounded, str(ref / "model.safetensors"))
    ours = _logits(tiny, quantization="fp8")
    assert _max_diff(ours, _logits(ref)) < TOL
    assert _max_diff(ours, _logits(tiny)) > 10 * TOL


def _fp8_activations(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear with x rounded per token through FP8 first (scale max |x| / 448): what the
    FP8 products compute, in fp32 arithmetic."""
    x32 = x.float()
    s = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
    return torch.nn.functional.linear(((x32 / s).to(E4M3).float() * s).to(x.dtype), w, bias)


def test_fp8_products_equal_fp8_rounded_activations(tiny, tmp_path, monkeypatch):
    """`torch._scaled_mm` with per-token activation scales (the path GPUs with FP8 units take;
    torch runs the same operator on CPU) against the dequantized weights with each linear
    layer's input rounded per token through FP8: the same numbers; a planted scale 5% off
    fails; and the activations really were rounded."""
    write_fp8(tiny, tmp_path / "fp8", "compressed-tensors-channel", tmp_path / "ref")
    monkeypatch.setattr(fp8, "SCALED_MM", True)
    engine = Engine(tmp_path / "fp8", device="cpu", dtype="fp32", num_device_blocks=24)
    assert isinstance(engine.runner.layers[0].qkv, fp8.Fp8Weight)
    ours = teacher_forced_logits(engine, PROMPTS, [7, None])
    monkeypatch.setattr(fp8, "SCALED_MM", False)
    emulated = Engine(tmp_path / "fp8", device="cpu", dtype="fp32", num_device_blocks=24)
    emulated.runner.linear = _fp8_activations
    reference = teacher_forced_logits(emulated, PROMPTS, [7, None])
    assert _max_diff(ours, reference) < TOL
    assert _max_diff(ours, _logits(tmp_path / "fp8")) > 10 * TOL
    engine.runner.layers[1].gate_up.scales *= 1.05
    planted = teacher_forced_logits(engine, PROMPTS, [7, None])
    assert _max_diff(planted, reference) > 10 * TOL


def test_moe_experts_in_fp8_and_int8_kv_together(tmp_path):
    from transformers import AutoTokenizer

    from lab.executor.quality import decode_perplexities

    moe = make_tiny_model(tmp_path / "mixtral", "mixtral", seed=9, head_dim=64)
    write_fp8(moe, tmp_path / "fp8", "fp8-block", tmp_path / "ref")
    assert _max_diff(_logits(tmp_path / "fp8"), _hf_logits(tmp_path / "ref")) < TOL
    tok = AutoTokenizer.from_pretrained(moe)
    got = decode_perplexities(tmp_path / "fp8", tok, "bf16", count=2, length=96)
    assert abs(got["rel_change"]) <= 0.01, got


def test_an_unsupported_quantization_is_refused(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "gptq")
    cfg = json.loads((tiny / "config.json").read_text())
    gptq = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg | {"quantization_config": gptq}))
    with pytest.raises(ValueError, match="quantization 'gptq' is not supported"):
        Engine(tmp_path / "gptq", device="cpu", num_device_blocks=4)
