"""The executor on the real SmolLM2-135M-Instruct weights in bf16 (what `auto` picks on CPUs
with native bf16) against transformers in bf16.

bf16 rounding is large on this model: transformers' own two bf16 attentions ("sdpa", fp32
scores in the kernel, and "eager", scores rounded to bf16) differ by 0.18-0.22 on average and
up to 1.4-1.8 in teacher-forced logits on these sequences (and transformers-bf16 differs from
transformers-fp32 by 0.15-0.26). Our prefill chunks run SDPA and our decodes the eager
arithmetic, so each sequence is compared with the nearer of the two, and must be as close to
it as the two are to each other (mean and max), with the same top-1 token at >= 95% of
positions. Measured: 0.0-0.16 on average, at most 0.88 (the one-token-per-step sequence),
top-1 equal at 96-100% of positions.
"""

from __future__ import annotations

import pytest
import torch

from lab.executor.quality import chat_prompts, passage
from lab.executor.testing import perplexity, teacher_forced_logits
from services.common.models import weights_dir
from services.common.settings import ExecutorSettings
from services.executor.engine import Engine

TOP1 = 0.95


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir():
    settings = ExecutorSettings()
    return weights_dir(settings.model, settings.data_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _engine(model_dir, kv_dtype: str = "auto") -> Engine:
    return Engine(
        model_dir,
        device="cpu",
        dtype="bf16",
        kv_dtype=kv_dtype,
        num_device_blocks=200,
        num_host_blocks=2,
    )


def test_teacher_forced_bf16_parity(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    prompts = chat_prompts(tokenizer, 4)
    seqs = [prompts[0][:24], prompts[1] * 2, prompts[2] * 4, prompts[3]]  # 24..150 tokens
    ours = teacher_forced_logits(_engine(model_dir), seqs, [1, 7, 64, None])
    models = [
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation=impl
        ).eval()
        for impl in ("sdpa", "eager")
    ]
    agree = total = 0
    for ids, logits in zip(seqs, ours):
        with torch.no_grad():
            refs = [m(torch.tensor([ids])).logits[0].float() for m in models]
        spread = (refs[0] - refs[1]).abs()  # transformers' bf16 against itself
        ref = min(refs, key=lambda r: (logits - r).abs().mean())
        diff = (logits - ref).abs()
        assert diff.mean() <= spread.mean() and diff.max() <= spread.max(), (
            f"{len(ids)} tokens: mean {diff.mean():.4f} (spread {spread.mean():.4f}), "
            f"max {diff.max():.3f} (spread {spread.max():.3f})"
        )
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= TOP1


def test_int8_kv_decodes_in_bf16_within_one_percent(model_dir, tokenizer):
    """One token per step, so every position runs the INT8 decode path (codes read directly,
    scales folded): perplexity within 1% of bf16 KV on the fixed passage's first 160 tokens."""
    ids = passage(tokenizer)[:160]
    fp = perplexity(teacher_forced_logits(_engine(model_dir), [ids], [1])[0], ids)
    q = perplexity(teacher_forced_logits(_engine(model_dir, "int8"), [ids], [1])[0], ids)
    assert abs(q - fp) / fp <= 0.01, (fp, q)
