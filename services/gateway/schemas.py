"""OpenAI request and response bodies (pydantic), with ALISE's extensions.

Requests accept the fields OpenAI clients send, an explicit null wherever OpenAI allows one
(it means the default). Sampling knobs are honoured in the executor's sampler: temperature,
top_p, seed (any integer), presence and frequency penalties, logit_bias, and vLLM's top_k,
min_p and repetition_penalty; chat `logprobs`/`top_logprobs` and completions `logprobs` (and
`echo` without them) are answered in OpenAI's shapes; `n`/`best_of`; structured outputs
(`response_format` json_object / json_schema, vLLM's `guided_*` and `structured_outputs`);
tools (`tools`, `tool_choice`). Features not built yet that would change the answer's shape
(prompt logprobs) are refused with a 400 naming
the field. Extensions:
`priority`, `slo`, `ignore_eos`, `top_k`, `min_tokens`, `min_p`, `repetition_penalty` (vLLM's
names) and `return_token_times` (each chunk carries the scheduler's token time).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

StopField = Annotated[
    str | list[Annotated[str, Field(min_length=1)]] | None,
    Field(description="Up to 16 strings; generation stops before the first match."),
]


class Slo(BaseModel):
    """Latency objectives in milliseconds (ALISE extension)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0, le=86_400_000, description="Time to first token.")
    tbt_ms: float | None = Field(None, gt=0, le=86_400_000, description="Time between tokens.")
    deadline_ms: float | None = Field(
        None, gt=0, le=86_400_000, description="Arrival to last token (job completion)."
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationParams(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Served model id (default: the served model).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="Any integer.")
    n: int | None = Field(1, ge=1, le=128, description="Answers to generate (choices).")
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit."
    )
    repetition_penalty: float | None = Field(
        1.0, gt=0.0, le=2.0, description="vLLM extension: > 1 discourages repeats."
    )
    min_p: float | None = Field(0.0, ge=0.0, le=1.0, description="vLLM extension.")
    stop_token_ids: list[int] | None = Field(
        None, max_length=64, description="vLLM extension: token ids that end the answer."
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM extension: keep the matched stop string or token."
    )
    skip_special_tokens: bool = Field(
        True, description="vLLM extension: leave special tokens out of the text."
    )
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=64, description="vLLM: words the answer never contains."
    )
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": ...}'
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM: a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM: one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM: an EBNF grammar.")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: {json | regex | choice | grammar}."
    )
    # Extensions.
    priority: int | None = Field(
        None,
        ge=-(2**31),
        le=2**31 - 1,
        description="vLLM's meaning: lower = served earlier (recorded; no policy orders by it yet).",
    )
    slo: Slo | None = None
    ignore_eos: bool = Field(False, description="Keep generating past EOS (vLLM extension).")
    top_k: int = Field(0, ge=0, le=1_000_000, description="0 = disabled (vLLM extension).")
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="vLLM extension.")
    return_token_ids: bool = Field(
        False,
        description="vLLM's extension: each choice (each stream chunk's choice) carries "
        "`token_ids`, the ids of the tokens it covers, as the scheduler committed them.",
    )
    return_token_times: bool = Field(
        False,
        description="Each chunk carries `alise.time`, the scheduler's time of its last "
        "token (unix seconds); used by benchmarks.",
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | str | None:
        if isinstance(value, str) and not value:
            raise ValueError("stop must not be empty")
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_GenerationParams):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, token ids, or a list of either (a batch of prompts)."
    )
    max_tokens: int | None = Field(16, ge=1, le=10_000_000)
    add_special_tokens: bool = Field(
        True, description="vLLM: add the tokenizer's special tokens (BOS) to the prompt"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationParams):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=10_000_000)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced call is one call
    add_special_tokens: bool = Field(
        False, description="vLLM: also add the tokenizer's special tokens (BOS) to the chat"
    )


# Responses.


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "alise"
    max_model_len: int | None = None  # context a request may use (model length, KV pool)
    max_kv_tokens: int | None = None  # tokens the largest executor KV pool holds


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
