"""Random weights for any shape (load_format=dummy): every shape preset loads as a one-layer
model with the bundled tokenizer and generates; the full presets carry the named models'
shapes; a config-only directory without dummy says how to load it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lab.executor.driver import Driver
from services.common.model_presets import PRESETS, preset_config, write_preset
from services.common.models import tokenizer_dir
from services.common.settings import ExecutorSettings
from services.executor.engine import Engine


@pytest.fixture(scope="module")
def tokenizer_src() -> Path:
    settings = ExecutorSettings()
    return tokenizer_dir(settings.model, settings.data_dir)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_loads_with_random_weights_and_generates(name, tokenizer_src, tmp_path):
    model_dir = write_preset(name, tmp_path / name, tokenizer_src, num_layers=1)
    engine = Engine(
        model_dir,
        device="cpu",
        dtype="bf16",
        attention_backend="torch",
        num_device_blocks=16,
        num_host_blocks=1,
        max_model_len=256,
        load_format="dummy",
    )
    shape = PRESETS[name]
    assert engine.spec.num_layers == 1
    assert engine.spec.hidden_size == shape["hidden_size"]
    assert engine.spec.num_kv_heads == shape["num_key_value_heads"]
    layer = engine.runner.layers[0]
    tensors = [t for t in vars(layer).values() if isinstance(t, torch.Tensor) and t.dim() == 2]
    assert tensors and all(t.dtype == torch.bfloat16 and t.float().std() > 0.01 for t in tensors)
    seqs = Driver(engine, token_budget=64, max_batch=2).generate([[1, 2, 3, 4], [5, 6]], [3, 2])
    assert [len(s.output) for s in seqs] == [3, 2]
    assert all(0 <= t < engine.spec.vocab_size for s in seqs for t in s.output)
    engine.close()


def test_presets_are_the_named_models_shapes(tokenizer_src):
    c = preset_config("llama-3-8b", tokenizer_src)
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (4096, 14336, 32)
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (32, 8)
    q = preset_config("qwen2.5-7b", tokenizer_src)
    assert (q["model_type"], q["num_key_value_heads"], q["intermediate_size"]) == (
        "qwen2",
        4,
        18944,
    )
    tok = AutoTokenizerVocab(tokenizer_src)
    assert all(preset_config(n, tokenizer_src)["vocab_size"] == tok for n in PRESETS)
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("gpt-5", tokenizer_src)


def AutoTokenizerVocab(src: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(src))


def test_a_config_only_directory_needs_load_format_dummy(tokenizer_src, tmp_path):
    model_dir = write_preset("llama-3.2-1b", tmp_path / "m", tokenizer_src, num_layers=1)
    with pytest.raises(FileNotFoundError, match="load_format=dummy"):
        Engine(model_dir, device="cpu", num_device_blocks=4, num_host_blocks=1)
