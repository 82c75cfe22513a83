"""Engine logits on CUDA in bf16 against transformers, for SmolLM2-135M-Instruct and tiny
random Llama / Qwen2 / OPT / Mistral models, through the packed step path (one metadata
buffer, Triton kernels) and the classic one (build_batch)."""

from __future__ import annotations

import pytest
import torch

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import NEW_FAMILIES
from services.executor.cuda_runtime import RuntimeOptions
from services.executor.engine import Engine
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY

PROMPTS = [list(range(200, 290)), list(range(1000, 1013)), list(range(5000, 5070))]
CHUNKS = [1, 7, None]  # one token a step, 7 a step, the whole prompt at once
# Ours must be no further from transformers in fp32 than transformers' own bf16 is (x1.5:
# two bf16 implementations round their matmuls differently), and pick fp32's token about as
# often as transformers' bf16 does (random tiny models have many near-ties).
ERROR_RATIO, AGREEMENT_SLACK = 1.5, 0.05


def _hf_logits(model_dir, dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    # eager attention, as the CPU tests' references do: on an H200 our Gemma 2 logits, fp32 or
    # bf16, on every step path and attention backend, sat 0.046 from an SDPA reference and
    # matched it at position 0 only (one key: soft-capping cannot matter there), while Gemma 3
    # matched exactly; SDPA has no soft-capping. Not yet rerun on a GPU with eager.
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
        .cuda()
        .eval()
    )
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            out.append(model(torch.tensor([ids], device="cuda")).logits[0].float())
    del model
    torch.cuda.empty_cache()
    return out


def _ours(model_dir, step_runtime: str = "auto") -> list[torch.Tensor]:
    engine = Engine(
        model_dir,
        device="cuda",
        dtype="bf16",
        num_device_blocks=64,
        num_host_blocks=2,
        runtime=RuntimeOptions(step_runtime=step_runtime),
    )
    engine.warm_up()
    logits = [x.float() for x in teacher_forced_logits(engine, PROMPTS, CHUNKS)]
    engine.close()
    return logits


@pytest.mark.parametrize(
    "name", ["smollm2", "tiny-llama", "tiny-qwen2", "tiny-opt", "tiny-mistral"]
)
def test_bf16_logits_track_transformers(model_dirs, name):
    _assert_tracks(model_dirs[name], name)


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_bf16_logits_of_each_family_track_transformers(family_dirs, arch):
    """Qwen3, Gemma 2/3 (windows past the 12-token window, soft-caps), Phi-3: Triton
    attention with windows and soft-cap, the unfused layers, CUDA graphs."""
    _assert_tracks(family_dirs[arch], arch)


def _assert_tracks(model_dir, name: str) -> None:
    ours = _ours(model_dir)
    ref32, ref16 = (_hf_logits(model_dir, d) for d in (torch.float32, torch.bfloat16))
    for ids, o, r32, r16 in zip(PROMPTS, ours, ref32, ref16):
        ours_err, hf_err = (o - r32).abs().mean().item(), (r16 - r32).abs().mean().item()
        agree = (o.argmax(-1) == r32.argmax(-1)).float().mean().item()
        hf_agree = (r16.argmax(-1) == r32.argmax(-1)).float().mean().item()
        assert ours_err <= ERROR_RATIO * hf_err + 1e-4, (name, len(ids), ours_err, hf_err)
        assert agree >= hf_agree - AGREEMENT_SLACK, (name, len(ids), agree, hf_agree)


def test_packed_and_classic_step_paths_agree(smollm2_dir):
    """The one-buffer metadata path computes what build_batch's does."""
    packed, classic = _ours(smollm2_dir, "auto"), _ours(smollm2_dir, "classic")
    for p, c in zip(packed, classic):
        assert (p - c).abs().max().item() <= 1e-2 * c.abs().max().item()
