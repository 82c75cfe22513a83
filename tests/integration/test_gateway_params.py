"""Every request field of vLLM's ChatCompletionRequest and CompletionRequest is either
honoured (a declared field of services/gateway/schemas.py, with its own tests) or answered
with a 400 naming it (services/gateway/params.py); unknown fields are a 400 too, as OpenAI
answers. The gateway's scheduler is down: these answers come before any generation."""

from __future__ import annotations

import httpx
import pytest

from lab.gateway.testing import running_gateway
from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings
from services.gateway.params import ANY, NO_EFFECT, REFUSED
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

# The field names of vLLM's protocol (vllm/entrypoints/openai/protocol.py, 2025): the
# sampling and extra fields both requests share, then each one's own.
VLLM_SHARED = [
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "best_of",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "allowed_token_ids",
    "echo",
    "add_special_tokens",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
]
VLLM_CHAT = VLLM_SHARED + [
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "bad_words",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "structural_tag",
]
VLLM_COMPLETION = VLLM_SHARED + ["prompt", "prompt_embeds", "suffix"]

# A value for each refused field that would change the answer.
CHANGING = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 8,
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"x": 1},
    "mm_processor_kwargs": {"x": 1},
    "structural_tag": "{}",
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
    "request_id": "mine",
    "logits_processors": ["a.b"],
    "return_tokens_as_token_ids": True,
    "cache_salt": "salt",
    "kv_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "reasoning_effort": "low",
    "include_reasoning": False,
    "prompt_embeds": "AAAA",
    "suffix": "end",
    "echo": True,
    "best_of": 2,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "x"},
    "modalities": ["audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = GatewaySettings(
        scheduler_address=f"127.0.0.1:{free_port()}",
        predictor_addresses=[f"127.0.0.1:{free_port()}"],
        admission_hold_s=0,  # no scheduler: a valid request is a 503 at once
    )
    with running_gateway(settings) as base, httpx.Client(base_url=base, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    ("path", "schema", "names", "base"),
    [
        (
            "/v1/chat/completions",
            ChatCompletionRequest,
            VLLM_CHAT,
            {"messages": [{"role": "user", "content": "x"}]},
        ),
        ("/v1/completions", CompletionRequest, VLLM_COMPLETION, {"prompt": "x"}),
    ],
)
def test_every_vllm_field_is_honoured_or_refused_by_name(client, path, schema, names, base):
    declared = set(schema.model_fields)
    refused = []
    for name in names:
        if name in declared or name in NO_EFFECT:
            continue
        assert name in REFUSED, f"{name}: neither honoured nor refused"
        refused.append(name)
        response = client.post(path, json={**base, name: CHANGING[name]})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name
        harmless = REFUSED[name][0]
        if harmless is not ANY:  # its no-op value passes (then 503: no scheduler)
            ok = client.post(path, json={**base, name: harmless, "max_tokens": 1})
            assert ok.json().get("error", {}).get("param") != name, name
    assert len(refused) >= 10
    unknown = client.post(path, json={**base, "no_such_field": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "no_such_field"
