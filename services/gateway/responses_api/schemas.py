"""The OpenAI Responses API request (`POST /v1/responses`), with ALISE's chat extensions.

Declared here: the fields that are honoured (`chat.py` turns them into a chat request).
Input items are typed (text messages, `function_call`, `function_call_output`); any other item
or content part arrives as a plain object and is refused by name. Fields OpenAI defines that
are not served are listed in `chat.py` REFUSED (a 400 naming the field unless sent with
the value that changes nothing); unknown fields are a 400 too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.schemas import Slo


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A message: `{role, content}` (the `type` may be left out), content a string or text
    parts (`input_text`; `output_text` in an assistant turn sent back)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | dict[str, Any]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    """A call the model made (sent back so the conversation holds it)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """A function's result for the call `call_id`."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[InputText | dict[str, Any]]
    id: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"} | {"type": "json_object"} | '
        '{"type": "json_schema", "name", "schema", "strict"}',
    )
    verbosity: Literal["medium"] | None = Field(
        None, description="Only the default: the model's answers are not tuned for length."
    )


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Served model id (default: the served model).")
    input: str | list[InputItem | dict[str, Any]] = Field(
        ..., description="A user message's text, or a list of input items."
    )
    instructions: str | None = Field(
        None, description="A system message put first (not carried to later responses)."
    )
    previous_response_id: str | None = Field(
        None, description="Continue the conversation of a stored response."
    )
    store: bool | None = Field(True, description="Keep the response for GET and continuation.")
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(
        None, description="Accepted (include_obfuscation has no effect: nothing is padded)."
    )
    max_output_tokens: int | None = Field(None, ge=1, le=10_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools: {"type": "function", "name", "parameters", ...}.'
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none" | "auto" | "required" | {"type": "function", "name"}.'
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one function call per response."
    )
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, description="Echoed back in the response.")
    user: str | None = None
    # ALISE's chat extensions (the same meaning as on /v1/chat/completions).
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    slo: Slo | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    ignore_eos: bool = False
    top_k: int = Field(0, ge=0, le=1_000_000)
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
