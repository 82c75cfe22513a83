"""Request fields ALISE does not honour: a 400 naming the field, never silently ignored.

Every field of vLLM's `ChatCompletionRequest` and `CompletionRequest` is either a declared
field of `schemas.py` (honoured) or listed here with the value that changes nothing (sent
with that value, or null, it is accepted). A field in neither list is unknown, and a 400 too,
as OpenAI answers "Unrecognized request argument". `tests/integration/test_gateway_params.py`
walks vLLM's lists.
"""

from __future__ import annotations

from typing import Any

from services.gateway.errors import bad_request

ANY = object()  # refused whatever its value (null aside)

# field -> the harmless value (or ANY), and why it is refused otherwise
REFUSED: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": (
        True,
        "special tokens are always decoded as the tokenizer does",
    ),
    "truncate_prompt_tokens": (ANY, "prompts are never truncated: a long one is a 400"),
    "prompt_logprobs": (
        ANY,
        "vLLM's prompt_logprobs shape is not served; use completions echo with logprobs",
    ),
    "allowed_token_ids": (
        ANY,
        "allowed_token_ids is not supported; use guided_choice or logit_bias",
    ),
    "add_generation_prompt": (True, "the generation prompt is always added"),
    "continue_final_message": (False, "continuing the final message is not supported"),
    "documents": (ANY, "documents are not supported"),
    "chat_template": (ANY, "a per-request chat template is not accepted"),
    "chat_template_kwargs": (ANY, "chat template arguments are not supported"),
    "mm_processor_kwargs": (ANY, "multimodal inputs are not supported"),
    "structural_tag": (ANY, "structural tags are not supported; use guided_json or tools"),
    "guided_decoding_backend": ("xgrammar", "the only guided decoding backend is xgrammar"),
    "guided_whitespace_pattern": (ANY, "JSON is generated without free whitespace"),
    "request_id": (ANY, "send X-Request-Id: it is echoed; generations get their own ids"),
    "logits_processors": (ANY, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (False, "tokens are returned as text"),
    "cache_salt": (ANY, "the prefix cache is shared; cache_salt is not supported"),
    "kv_transfer_params": (ANY, "disaggregated serving is not supported"),
    "vllm_xargs": (ANY, "vllm_xargs is not supported"),
    "reasoning_effort": (ANY, "reasoning models are not supported"),
    "include_reasoning": (True, "reasoning models are not supported"),
    "prompt_embeds": (ANY, "prompt embeddings are not supported"),
    "suffix": (ANY, "suffix (insertion) is not supported"),
    "echo": (False, "chat echo (prepending the last message) is not supported"),
    "best_of": (1, "best_of is served on /v1/completions"),
    "functions": (ANY, "use tools (functions is OpenAI's deprecated form)"),
    "function_call": (ANY, "use tool_choice (function_call is OpenAI's deprecated form)"),
    "audio": (ANY, "audio output is not supported"),
    "modalities": (["text"], "only text output is supported"),
    "prediction": (ANY, "predicted outputs are not supported"),
    "web_search_options": (ANY, "web search is not supported"),
}
# Accepted and documented as having no effect here (OpenAI bookkeeping fields).
NO_EFFECT = {"store", "metadata", "service_tier", "user"}


def refuse_unsupported(
    fields: dict[str, Any],
    declared: set[str],
    refused: dict[str, tuple[Any, str]] = REFUSED,
    no_effect: set[str] = NO_EFFECT,
) -> None:
    """A 400 naming the first field (of `fields`, the request's JSON keys) that is refused
    with a value that would change the answer, or that is unknown."""
    for name, value in fields.items():
        if name in declared or name in no_effect or value is None:
            continue
        if name not in refused:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)
        harmless, why = refused[name]
        if harmless is ANY or value != harmless:
            raise bad_request(f"{name}: {why}", param=name, code="unsupported_parameter")
