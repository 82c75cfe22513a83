"""OpenAI request -> `Plan`: validation, SLO/priority headers, chat template, tokenization,
length limits. Every refusal is an `APIError` with the status the issue asks for.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from services.common import sampling_pb
from services.common.pb import common_pb2
from services.common.sampling import SamplingParams
from services.gateway.errors import APIError, bad_request
from services.gateway.generation import Plan
from services.gateway.guides import Guide, checked_guide, checked_tool_guide
from services.gateway.middleware import new_request_id
from services.gateway.params import refuse_unsupported
from services.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Slo,
    TextPart,
)
from services.gateway.tools import history_text, parser_for, plan_tools
from services.gateway.tools import system_prompt as tools_system_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.common.guided import GuideCompiler

SLO_HEADERS = {
    "ttft_ms": "x-slo-ttft-ms",
    "tbt_ms": "x-slo-tbt-ms",
    "deadline_ms": "x-slo-deadline-ms",
}

_Request = CompletionRequest | ChatCompletionRequest
ROLE_ALIASES = {"developer": "system"}
MAX_PROMPTS = 64  # prompts in one batched completion request
_N = TypeVar("_N", int, float)


class PromptBuilder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model_id: str,
        max_len: Callable[[], int],
        tool_parser: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_len = max_len  # current maximum model length (the scheduler may report later)
        self.vocab_size = len(tokenizer)
        self.tool_parser = parser_for(getattr(tokenizer, "chat_template", None), tool_parser)

    @functools.cached_property
    def guides(self) -> GuideCompiler:
        """Compiles structured-output guides to check them (built on first use)."""
        from services.common.guided import GuideCompiler

        return GuideCompiler(self.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                param="model",
                code="model_not_found",
            )

    async def chat(
        self, body: ChatCompletionRequest, headers: Mapping[str, str], request_id: str
    ) -> Plan:
        self.check_model(body.model)
        _refuse_unsupported_chat(body)
        tools = plan_tools(body.tools, body.tool_choice)
        text = await self.chat_text(body.messages, body.tools if tools.mode else None)
        ids = await asyncio.to_thread(self._encode, text, body.add_special_tokens)
        max_tokens = body.max_completion_tokens or body.max_tokens
        guide = await checked_guide(body, self.guides)
        if tools.mode == "forced":
            if guide[0]:
                raise bad_request(
                    "tool_choice forces a call: no response_format with it", param="tool_choice"
                )
            guide = await checked_tool_guide(tools.guide, self.guides)
        plan = self._plan(body, headers, request_id, text, ids, max_tokens, "messages", guide)
        plan.tools_mode = tools.mode
        plan.tool_parser = self.tool_parser
        return plan

    async def completion(
        self, body: CompletionRequest, headers: Mapping[str, str], request_id: str
    ) -> list[Plan]:
        """One plan per prompt: a string, token ids, or a list of either (a batch; each
        prompt's answers are choices `i * n ...`)."""
        self.check_model(body.model)
        _refuse_unsupported_completion(body)
        guide = await checked_guide(body, self.guides)
        plans = []
        for i, prompt in enumerate(_prompts(body.prompt)):
            param = "prompt" if i == 0 else f"prompt.{i}"
            if isinstance(prompt, str):
                text = prompt
                ids = await asyncio.to_thread(self._encode, text, body.add_special_tokens)
            else:
                ids = self._check_ids(prompt)
                text = await asyncio.to_thread(self.tokenizer.decode, ids)
            rid = request_id if i == 0 else new_request_id()
            plan = self._plan(body, headers, rid, text, ids, body.max_tokens, param, guide)
            plan.prompt_index = i
            plans.append(plan)
        return plans

    async def chat_text(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The messages through the chat template, ready for generation (`developer` is the
        newer name of `system`; text parts are joined with newlines; tool calls and results
        written out, and `tools` described, as `services/gateway/tools.py` says)."""
        plain = []
        for i, m in enumerate(messages):
            role = ROLE_ALIASES.get(m.role, m.role)
            role, text = history_text(role, _message_text(m.content, i), m.model_extra or {})
            plain.append({"role": role, "content": text})
        if tools and not self.template_knows_tools:
            if plain and plain[0]["role"] == "system":
                plain[0]["content"] = tools_system_prompt(tools) + "\n\n" + plain[0]["content"]
            else:
                plain.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
            tools = None
        return await asyncio.to_thread(self._render, plain, tools)

    @functools.cached_property
    def template_knows_tools(self) -> bool:
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def _render(
        self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise bad_request(f"chat template failed: {exc}", param="messages") from exc

    def _encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of `text`; `special`: with the tokenizer's own special tokens (the BOS a
        raw completion prompt gets, as transformers adds it); a rendered chat template
        already holds its own."""
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _check_ids(self, ids: list[int]) -> list[int]:
        bad = [i for i in ids if i < 0 or i >= self.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param="prompt",
            )
        return ids

    def _plan(
        self,
        body: _Request,
        headers: Mapping[str, str],
        request_id: str,
        text: str,
        ids: list[int],
        max_tokens: int | None,
        param: str,
        guide: Guide = ("", ""),
    ) -> Plan:
        if not ids:
            raise bad_request("the prompt is empty", param=param, code="empty_prompt")
        max_tokens = self._check_length(len(ids), max_tokens, param)
        if body.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})",
                param="min_tokens",
            )
        return Plan(
            request_id=request_id,
            model=self.model_id,
            prompt_text=text,
            prompt_ids=ids,
            max_tokens=max_tokens,
            stops=body.stop_list(),
            sampling=_sampling(body, self.vocab_size, guide, self._bad_words(body.bad_words)),
            stop_token_ids=self._stop_ids(body.stop_token_ids),
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            priority=_priority(body, headers),
            slo=_slo(body, headers),
            logprobs=_logprobs(body),
            echo=isinstance(body, CompletionRequest) and body.echo,
            return_token_ids=body.return_token_ids,
        )

    def _bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids as it would appear mid-text and at the start (vLLM's)."""
        out: set[tuple[int, ...]] = set()
        for word in words or []:
            for form in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer(form, add_special_tokens=False)["input_ids"])
                if ids:
                    out.add(ids)
        return tuple(sorted(out))

    def _stop_ids(self, ids: list[int] | None) -> list[int]:
        bad = [i for i in ids or [] if not 0 <= i < self.vocab_size]
        if bad:
            raise bad_request(
                f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param="stop_token_ids",
            )
        return list(ids or [])

    def _check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        limit = self.max_len()
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens (the model's length, "
                f"capped by the largest executor KV pool); the prompt has {prompt_len} tokens.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens (the model's length, "
                f"capped by the largest executor KV pool); the prompt ({prompt_len}) plus "
                f"max_tokens ({max_tokens}) exceeds it.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens


def _message_text(content: str | list[TextPart | dict[str, object]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if isinstance(part, dict):
            raise bad_request(
                f"message {index}: only text content parts are supported "
                f"(got type {part.get('type')!r})",
                param=f"messages.{index}",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion request: one string, one list of token ids, or a batch
    of either (at most MAX_PROMPTS)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def _refuse_common(body: _Request) -> None:
    refuse_unsupported(body.model_extra or {}, set(type(body).model_fields))
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of < (body.n or 1):
        raise bad_request("best_of must be at least n", param="best_of")
    if best_of not in (None, 1) and body.stream:
        raise bad_request("best_of cannot be streamed", param="best_of")


def _refuse_unsupported_chat(body: ChatCompletionRequest) -> None:
    _refuse_common(body)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")


def _refuse_unsupported_completion(body: CompletionRequest) -> None:
    _refuse_common(body)
    if isinstance(body.prompt, list) and not body.prompt:
        raise bad_request("the prompt is empty", param="prompt", code="empty_prompt")


def _sampling(
    body: CompletionRequest | ChatCompletionRequest,
    vocab_size: int,
    guide: Guide = ("", ""),
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> common_pb2.SamplingParams:
    """The schema has checked the ranges already (a refusal there is a 400); null = default."""

    def value(name: str, default: float) -> float:
        got = getattr(body, name)
        return default if got is None else got

    return sampling_pb.to_pb(
        SamplingParams(
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=body.top_k,
            seed=None if body.seed is None else body.seed % 2**64,
            presence_penalty=value("presence_penalty", 0.0),
            frequency_penalty=value("frequency_penalty", 0.0),
            repetition_penalty=value("repetition_penalty", 1.0),
            min_p=value("min_p", 0.0),
            logit_bias=_logit_bias(body.logit_bias, vocab_size),
            top_logprobs=_logprobs(body) or 0,
            prompt_logprobs=_logprobs(body) if getattr(body, "echo", False) else None,
            guide_kind=guide[0],
            guide_spec=guide[1],
            bad_words=bad_words,
        )
    )


def _logprobs(body: _Request) -> int | None:
    """None: no logprobs asked; else how many alternatives per token (0-20)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys are token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
        out.append((token, value))
    return tuple(sorted(out))


def _header_number(headers: Mapping[str, str], name: str, cast: Callable[[str], _N]) -> _N | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return cast(raw)
    except ValueError:
        raise bad_request(f"header {name}: not a number: {raw!r}", param=name) from None


def _priority(body: _Request, headers: Mapping[str, str]) -> int | None:
    if body.priority is not None:
        return body.priority
    value = _header_number(headers, "x-priority", int)
    if value is not None and not -(2**31) <= value < 2**31:
        raise bad_request("header x-priority: out of range", param="x-priority")
    return value


def _slo(body: _Request, headers: Mapping[str, str]) -> common_pb2.Slo | None:
    values = {k: v for k, v in (body.slo.model_dump() if body.slo else {}).items() if v is not None}
    for key, header in SLO_HEADERS.items():
        if key not in values and (value := _header_number(headers, header, float)) is not None:
            values[key] = value
    if not values:
        return None
    try:
        slo = Slo(**values)
    except ValueError as exc:
        raise bad_request(f"invalid SLO: {exc.errors()[0]['msg']}", param="slo") from None
    ms = slo.model_dump(exclude_none=True)
    return common_pb2.Slo(**{k.replace("_ms", "_s"): v / 1000.0 for k, v in ms.items()})
