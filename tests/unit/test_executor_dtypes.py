"""Model dtypes on CPU: bf16 runs end to end (weights, KV pool, forward) and matches
transformers in bf16; fp16 is refused on CPU. (`auto` picks bf16 on CPUs with native bf16:
tests/unit/test_executor_decode_path.py.)"""

from __future__ import annotations

import pytest
import torch

from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import ARCHS, make_tiny_model
from services.executor.engine import Engine

PROMPTS = [list(range(200, 290)), list(range(1000, 1013)), list(range(5000, 5070))]
# Logits here are O(3); one bf16 ulp at 2..4 is 1/64. transformers has two bf16 attentions
# that round differently: "sdpa" (fp32 scores inside the kernel) and "eager" (scores rounded
# to bf16 by the matmul, softmax in fp32). Our prefill chunks run SDPA, our decodes the eager
# arithmetic (decode_attention.py), so each prompt is compared with the nearer of the two:
# measured at most 0.024 (1.5 ulps) and 0.0027 on average per prompt, against 0.03..0.045 and
# 0.003..0.005 between the two implementations themselves. For scale, the fp32 engine against
# transformers-bf16 differs by 0.03..0.06 at most and 0.004..0.006 on average, so the mean
# bound also tells bf16 from fp32 compute.
MAX_DIFF, MEAN_DIFF = 0.04, 0.0035


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_close_to_transformers_bf16(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM

    engine = Engine(
        tiny_dirs[arch], device="cpu", dtype="bf16", num_device_blocks=32, num_host_blocks=2
    )
    assert engine.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in engine.cache.tensors.values())
    assert engine.describe()["dtype"] == "bfloat16"
    ours = teacher_forced_logits(engine, PROMPTS, [1, 7, None])
    models = [
        AutoModelForCausalLM.from_pretrained(
            tiny_dirs[arch], dtype=torch.bfloat16, attn_implementation=impl
        ).eval()
        for impl in ("sdpa", "eager")
    ]
    for ids, logits in zip(PROMPTS, ours):
        with torch.no_grad():
            refs = [m(torch.tensor([ids])).logits[0].float() for m in models]
        diff = min(((logits - ref).abs() for ref in refs), key=lambda d: d.mean())
        assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (
            f"{len(ids)} tokens: max {diff.max():.4f}, mean {diff.mean():.5f}"
        )


def test_fp16_is_refused_on_cpu(tiny_dirs):
    with pytest.raises(ValueError, match="fp16"):
        Engine(
            tiny_dirs["llama"], device="cpu", dtype="fp16", num_device_blocks=4, num_host_blocks=1
        )
