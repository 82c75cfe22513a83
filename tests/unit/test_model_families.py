"""Every family of the model registry (services/executor/models/) against transformers, on
tiny random-weight checkpoints that transformers' own classes write offline
(lab/executor/tiny.py: 64-wide heads, so decodes run the compiled CPU kernel where it builds;
the Gemma models' 12-token sliding windows are shorter than every long prompt here).

- Parity in bf16: teacher-forced logits (mixed chunk sizes) against transformers in fp32.
  Our error (mean and 99.9th percentile of |ours - fp32|) must be within PARITY_SLACK of
  transformers' own bf16 error, measured in the same run for the same family (the larger of
  its "sdpa" and "eager" attentions; Gemma 2 has eager only): the bound
  tests/integration/test_executor_smollm2_bf16.py uses. Random weights leave near-ties, so
  the share of positions with fp32's top-1 token may be at most three standard errors below
  the lower of transformers' bf16 shares.
- Greedy in fp32: 32 tokens after a 40-token prompt equal transformers' fp32 argmax loop.
- Planted errors (a norm of the wrong form, a window one key wider, soft-capping or QK-norm
  left out, full instead of partial rotary) make the parity check fail.
- INT8 KV: perplexity within 1% of full-precision KV, decoding one token per step.
- Unknown architectures are refused with the supported list.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lab.executor.driver import Driver
from lab.executor.testing import teacher_forced_logits
from lab.executor.tiny import FAMILIES, NEW_FAMILIES, TINY_WINDOW, make_tiny_model
from services.executor import llama
from services.executor.config import load_spec
from services.executor.engine import Engine
from services.executor.models import supported

PARITY_SLACK, INT8_BOUND = 1.25, 0.01
PROMPTS = [list(range(200, 290)), list(range(1000, 1013)), list(range(5000, 5070)), [300, 301]]
CHUNKS = [1, 7, 64, None]
GREEDY_PROMPT, GREEDY_TOKENS = list(range(700, 740)), 32


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {a: make_tiny_model(root / a, a, seed=4, head_dim=64) for a in FAMILIES}


def error_stats(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, float, float]:
    """(mean, 99.9th percentile) of |ours - refs| over every logit, and the share of
    positions whose top-1 token is the reference's."""
    err = torch.cat([(a - b).abs().flatten() for a, b in zip(ours, refs, strict=True)])
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, refs))
    p999 = float(err.kthvalue(max(1, math.ceil(0.999 * err.numel()))).values)
    return float(err.mean()), p999, agree / sum(len(r) for r in refs)


def _hf(model_dir, dtype, impl="eager"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=impl
    ).eval()


def _hf_logits(model, prompts) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts]


_REFERENCES: dict[str, tuple[list[torch.Tensor], list[tuple[float, float]]]] = {}


def references(tiny_dirs, arch):
    """transformers' fp32 logits and its bf16 errors against them (per attention)."""
    if arch not in _REFERENCES:
        fp32 = _hf_logits(_hf(tiny_dirs[arch], torch.float32), PROMPTS)
        impls = ("eager",) if arch == "gemma2" else ("eager", "sdpa")
        bf16 = [
            error_stats(_hf_logits(_hf(tiny_dirs[arch], torch.bfloat16, i), PROMPTS), fp32)
            for i in impls
        ]
        _REFERENCES[arch] = (fp32, bf16)
    return _REFERENCES[arch]


def parity_failure(tiny_dirs, arch, **engine_kw) -> str:
    """Why our bf16 logits are further from fp32 than transformers' bf16 allows ("": not)."""
    fp32, hf_bf16 = references(tiny_dirs, arch)
    engine = Engine(
        tiny_dirs[arch], device="cpu", dtype="bf16", num_device_blocks=48, num_host_blocks=2,
        **engine_kw,
    )  # fmt: skip
    ours = teacher_forced_logits(engine, PROMPTS, CHUNKS)
    worst = [max(s[i] for s in hf_bf16) for i in range(2)]
    stats = error_stats(ours, fp32)
    print(arch, "ours", stats, "transformers bf16", hf_bf16)
    bad = [
        f"{name} {o:.4f} > {PARITY_SLACK} x {w:.4f}"
        for name, o, w in zip(("mean", "p99.9"), stats, worst)
        if o > PARITY_SLACK * w
    ]
    # random weights leave near-ties: the share is held to transformers' own bf16 one, less
    # three standard errors of a share over this many positions
    least, n = min(s[2] for s in hf_bf16), sum(map(len, PROMPTS))
    slack = 3 * math.sqrt(least * (1 - least) / n)
    if stats[2] < least - slack:
        bad.append(f"top-1 agreement {stats[2]:.3f} < {least:.3f} - {slack:.3f}")
    return "; ".join(bad)


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_parity_within_transformers_own_bf16_error(tiny_dirs, arch):
    failure = parity_failure(tiny_dirs, arch)
    assert not failure, failure


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_torch_attention_parity_too(tiny_dirs, arch):
    """The torch reference attention (the fallback where the kernels cannot be built)."""
    failure = parity_failure(tiny_dirs, arch, attention_backend="torch")
    assert not failure, failure


def _wider_windows(monkeypatch):
    real = Engine.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.attn.windows = tuple(w + 1 if w else 0 for w in self.attn.windows)

    monkeypatch.setattr(Engine, "__init__", init)


def _no_softcap(monkeypatch):
    real = Engine.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.attn.softcap = 0.0

    monkeypatch.setattr(Engine, "__init__", init)


def _experts_changed(change):
    def plant(monkeypatch):
        real = llama.moe_weights

        def patched(*a, **kw):
            return change(real(*a, **kw))

        monkeypatch.setattr(llama, "moe_weights", patched)

    return plant


def _swap_experts(w):
    order = [1, 0, *range(2, w.num_experts)]
    return dataclasses.replace(w, gate_up=w.gate_up[order], down=w.down[order])


PLANTED = {
    "gemma3_text: Llama's norm form": (
        "gemma3_text",
        lambda mp: mp.setattr(llama, "offset_weight", lambda w: w.float()),
    ),
    "gemma3_text: a window one key wider": ("gemma3_text", _wider_windows),
    "gemma2: no attention soft-cap": ("gemma2", _no_softcap),
    "qwen3: no QK-norm": ("qwen3", lambda mp: mp.setattr(llama.LlamaLayer, "q_norm", None)),
    "mixtral: two experts swapped": ("mixtral", _experts_changed(_swap_experts)),
    "qwen3_moe: top-k weights renormalised": (
        "qwen3_moe",
        _experts_changed(lambda w: dataclasses.replace(w, renormalize=not w.renormalize)),
    ),
    "phi3: full rotary": (
        "phi3",
        lambda mp: mp.setattr(llama, "apply_partial_rope", lambda x, c, s: x),
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_parity_check_catches_a_planted_error(tiny_dirs, monkeypatch, case):
    arch, plant = PLANTED[case]
    references(tiny_dirs, arch)  # the reference before anything is planted
    plant(monkeypatch)
    if "QK-norm" in case:  # the layers' q_norm field read as absent
        real = llama.LlamaRunner._layer

        def layer(self, state, i):
            out = real(self, state, i)
            out.q_norm = None
            return out

        monkeypatch.setattr(llama.LlamaRunner, "_layer", layer)
    assert parity_failure(tiny_dirs, arch), case


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_equal_transformers_fp32(tiny_dirs, arch):
    """A 40-token prompt, longer than the Gemma windows (the decode reads past them)."""
    assert len(GREEDY_PROMPT) > TINY_WINDOW
    engine = Engine(tiny_dirs[arch], device="cpu", dtype="fp32", num_device_blocks=16)
    seq = Driver(engine, token_budget=16).generate([GREEDY_PROMPT], GREEDY_TOKENS)[0]
    assert seq.output == _hf_greedy(_hf(tiny_dirs[arch], torch.float32), GREEDY_PROMPT, 32)


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_deterministic_mode_greedy_equals_transformers_fp32(tiny_dirs, arch):
    """Deterministic mode (fixed-tile products, prefill queries through the decode kernel,
    which takes the windows too) on the compiled CPU kernels."""
    from services.executor import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("deterministic mode needs the compiled CPU kernels")
    engine = Engine(
        tiny_dirs[arch], device="cpu", dtype="fp32", num_device_blocks=16, deterministic=True
    )
    seq = Driver(engine, token_budget=16).generate([GREEDY_PROMPT], GREEDY_TOKENS)[0]
    assert seq.output == _hf_greedy(_hf(tiny_dirs[arch], torch.float32), GREEDY_PROMPT, 32)


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_int8_kv_perplexity_within_one_percent(tiny_dirs, arch):
    from transformers import AutoTokenizer

    from lab.executor.quality import decode_perplexities

    tok = AutoTokenizer.from_pretrained(tiny_dirs[arch])
    got = decode_perplexities(tiny_dirs[arch], tok, "bf16", count=2, length=96)
    assert abs(got["rel_change"]) <= INT8_BOUND, got


def test_the_registry_lists_the_families():
    assert {"llama", "mistral", "qwen2", "opt", "qwen3", "gemma2", "gemma3", "gemma3_text"} | {
        "phi3"
    } <= set(supported())


def test_an_unknown_architecture_is_refused_with_the_supported_list(tiny_dirs, tmp_path):
    config = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    for model_type in ("mamba", "not_a_model_type"):
        (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": model_type}))
        with pytest.raises(ValueError, match=f"unsupported architecture '{model_type}'.*qwen3"):
            load_spec(tmp_path)


def test_gemma3_image_text_checkpoint_serves_its_language_model(tiny_dirs):
    spec = load_spec(tiny_dirs["gemma3"])
    assert spec.arch == "gemma3" and spec.num_layers == 3
    assert spec.variant.windows == (TINY_WINDOW, 0, TINY_WINDOW)
    assert spec.variant.rope_of_layer == (1, 0, 1)


def test_a_gemma3_engine_profiles_for_the_cost_model(tiny_dirs):
    """`alise executor profile`'s fit on a family with windows: usable coefficients."""
    from services.scheduler.core.cost_model import CostModel

    engine = Engine(tiny_dirs["gemma3_text"], device="cpu", dtype="fp32", num_device_blocks=64)
    profile = engine.profile(quick=True)
    assert profile["architecture"] == "gemma3_text"
    model = CostModel.from_profile(profile)
    assert model.c_decode > 0 and model.c0 >= 0
