"""GGUF models: a tiny random-weight Llama written as GGUF loads through the executor's loader
(`services.common.models.weights_dir` dequantizes it into a safetensors cache) with the same
logits as the same weights loaded from safetensors, and a second load reuses the cache.

The GGUF file is written the way llama.cpp's converter writes one: llama tensor names, Q/K
rows permuted for its RoPE layout, and the bundled SmolLM2 GGUF's tokenizer metadata (the
tiny models share that vocabulary), so transformers' GGUF reader has everything it needs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import make_tiny_model
from services.common.models import _cache_dir, resolve, weights_dir
from services.executor.engine import Engine

PROMPTS = [list(range(200, 260)), list(range(1000, 1013))]


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved RoPE halves); transformers' reader undoes it."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _copy_tokenizer_fields(writer, reader) -> None:
    from gguf import GGUFValueType

    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)


def write_llama_gguf(
    hf_dir: Path, out: Path, qtype: str, arch: str = "llama"
) -> dict[str, torch.Tensor]:
    """Write the safetensors Llama (or Qwen3: `arch`) in `hf_dir` to `out` as GGUF, 2-D
    weights as `qtype` (F32 or Q8_0; norms stay F32 as llama.cpp keeps them). Returns the
    tensors a reader gets back (the Q8_0 round trip), under their Hugging Face names. Only
    Llama's Q/K rows are permuted (llama.cpp's converter leaves Qwen's as they are)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    names = gguf.get_tensor_name_map(
        getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers
    )
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    _copy_tokenizer_fields(writer, gguf.GGUFReader(str(resolve("smollm2-135m-instruct").gguf_path)))
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    expected = {}
    for hf_name, tensor in state.items():
        w = tensor.float().numpy()
        permute = arch == "llama"
        if permute and ".q_proj." in hf_name:
            w = _permute_for_gguf(w, config.num_attention_heads)
        elif permute and ".k_proj." in hf_name:
            w = _permute_for_gguf(w, config.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if w.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, quant)
            writer.add_tensor(name, data, raw_dtype=quant)
            back = gguf.quants.dequantize(data, quant)
        else:
            writer.add_tensor(name, w)
            back = w
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # the reader sees Q/K back in Hugging Face order: undo our permutation on the expectation
    for hf_name, w in expected.items():
        if arch != "llama":
            break
        heads = (
            config.num_attention_heads
            if ".q_proj." in hf_name
            else config.num_key_value_heads
            if ".k_proj." in hf_name
            else None
        )
        if heads:
            n = heads
            expected[hf_name] = (
                w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:])
                .transpose(1, 2)
                .reshape(w.shape)
                .contiguous()
            )
    return expected


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=11)


def _engine(model_dir: Path) -> Engine:
    return Engine(model_dir, device="cpu", dtype="fp32", num_device_blocks=16, num_host_blocks=1)


def test_gguf_loads_like_safetensors_and_is_dequantized_once(tiny_llama, tmp_path):
    """Q8_0 (one case: most of the time is transformers converting the GGUF tokenizer)."""
    gguf_path = tmp_path / "src" / "tiny-llama.gguf"
    gguf_path.parent.mkdir()
    expected = write_llama_gguf(tiny_llama, gguf_path, "Q8_0")

    # the reference: the same (dequantized) weights as a plain safetensors directory
    from safetensors.torch import save_file

    ref_dir = tmp_path / "ref"
    shutil.copytree(tiny_llama, ref_dir)
    save_file(expected, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = teacher_forced_logits(_engine(ref_dir), PROMPTS, [7, None])

    data_dir = tmp_path / "data"
    cache = weights_dir(str(gguf_path), data_dir)
    assert cache.parent == data_dir / "models" and (cache / "model.safetensors").exists()
    ours = teacher_forced_logits(_engine(cache), PROMPTS, [7, None])
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    # quantization really happened: close to the original weights' logits, but not equal
    original = teacher_forced_logits(_engine(tiny_llama), PROMPTS, [None, None])
    drift = max((a - b).abs().max().item() for a, b in zip(ours, original))
    assert 1e-4 < drift < 0.1, drift

    # second load, of the same file in another place (another checkout or venv): the cache
    # is reused as is (nothing rewritten, no second directory)
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    elsewhere = tmp_path / "elsewhere" / gguf_path.name
    elsewhere.parent.mkdir()
    shutil.copyfile(gguf_path, elsewhere)
    again = weights_dir(str(elsewhere), data_dir)
    assert again == cache
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files
    assert [p.name for p in (data_dir / "models").iterdir() if p.is_dir()] == [cache.name]
    second = teacher_forced_logits(_engine(again), PROMPTS, [7, None])
    assert all(torch.equal(a, b) for a, b in zip(second, ours))
    # a file replaced in place is not mistaken for the cached one
    elsewhere.write_bytes(b"not a gguf file any more")
    assert _cache_dir(resolve(str(elsewhere)), data_dir) != cache


def test_a_qwen3_gguf_loads_like_its_safetensors(tmp_path):
    """A family the registry added, through the same GGUF path (transformers' reader maps
    Qwen3's QK-norm tensors; its head size must be the released 128: the reader takes no
    key_length for Qwen3)."""
    from safetensors.torch import save_file

    hf_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=11, head_dim=128)
    gguf_path = tmp_path / "src" / "tiny-qwen3.gguf"
    gguf_path.parent.mkdir()
    expected = write_llama_gguf(hf_dir, gguf_path, "F32", arch="qwen3")
    assert any("q_norm" in name for name in expected)
    cache = weights_dir(str(gguf_path), tmp_path / "data")
    ours = teacher_forced_logits(_engine(cache), PROMPTS, [7, None])
    ref_dir = tmp_path / "ref"
    shutil.copytree(hf_dir, ref_dir)
    save_file(expected, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = teacher_forced_logits(_engine(ref_dir), PROMPTS, [7, None])
    assert _engine(cache).spec.arch == "qwen3"
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
