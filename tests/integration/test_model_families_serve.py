"""Each registered family served through the real gateway, scheduler and executor over gRPC
(tiny random-weight checkpoints written by transformers, the bundled tokenizer and chat
template): a streamed chat answer over SSE, chunked prefill (Sarathi's 16-token budget, so
every prompt here is split), prefix caching (the second request reuses the first one's
blocks) and greedy tokens equal to transformers' on the same templated prompt."""

from __future__ import annotations

import pytest
import torch

from lab.executor.tiny import FAMILIES, make_tiny_model
from lab.gateway.testing import inprocess_stack

SYSTEM = "You are a careful assistant. " * 6  # ~40 tokens shared by both requests
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("family-serve")


def _stream(url: str, model: str, question: str) -> tuple[str, object]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, events = "", None, 0
    for chunk in stream:
        events += 1
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    assert events > 2  # streamed, not one answer
    return text, usage


def _hf_greedy(model_dir, question: str) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = list(enc["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_streams_a_chat_answer_with_chunked_prefill_and_prefix_caching(tiny_root, arch):
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(tiny_root / arch, arch, seed=6, head_dim=64)
    with inprocess_stack(
        tiny_root / f"{arch}-run",
        model_dir,
        executor_kw={"dtype": "fp32"},
        scheduler_kw={"policy": "sarathi", "policy_config": '{"token_budget": 16}'},
    ) as stack:
        first = _stream(stack["url"], model_dir.name, "Name a colour.")
        second = _stream(stack["url"], model_dir.name, "Name a fruit.")
    for _, usage in (first, second):
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens > 32  # longer than two 16-token chunks
    assert second[1].prompt_tokens_details.cached_tokens >= 16  # the shared system prompt
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = tok.decode(_hf_greedy(model_dir, "Name a fruit."), skip_special_tokens=True)
    assert second[0] == want, (arch, second[0], want)
