"""The Responses API on the chat path: a `/v1/responses` request becomes one chat request
(`to_chat`, then the same `PromptBuilder.chat` -> `Plan` as `/v1/chat/completions`), and the
finished generation becomes a Response object (`Turn.response`).

The conversation a request continues (`previous_response_id`) is the stored record's input
items followed by its output items; this request's `input` is appended, `instructions` go
first as a system message (they are not carried over, as OpenAI). Items map onto chat
messages: a message keeps its role and text, consecutive `function_call` items become one
assistant turn's `tool_calls`, a `function_call_output` a `tool` message. Function tools,
`tool_choice` and `text.format` map onto the chat fields of the same meaning.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from services.gateway import tools as tool_calls
from services.gateway.errors import APIError, bad_request
from services.gateway.params import ANY
from services.gateway.render import final_extension
from services.gateway.responses_api.schemas import InputItem, InputText, ResponsesRequest
from services.gateway.schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from services.gateway.generation import Generation
    from services.gateway.responses_api.store import ResponseStore

# OpenAI fields not served: the value that changes nothing (or ANY: refused unless null)
REFUSED: dict[str, tuple[Any, str]] = {
    "background": (False, "background responses are not supported"),
    "background_options": (ANY, "background responses are not supported"),
    "conversation": (ANY, "conversation objects are not supported; use previous_response_id"),
    "prompt": (ANY, "stored prompt templates are not supported"),
    "reasoning": (ANY, "reasoning models are not supported"),
    "include": ([], "no additional output data is served (include must be empty)"),
    "max_tool_calls": (ANY, "max_tool_calls is not supported; parallel_tool_calls: false"),
    "top_logprobs": (0, "log-probabilities are served on /v1/chat/completions"),
    "truncation": ("disabled", "a conversation is never truncated; one too long is a 400"),
    "context_management": (ANY, "context management is not supported"),
    "moderation": (ANY, "moderation is not supported"),
    "image": (ANY, "image output is not supported"),
    "access_programs": (ANY, "access programs are not supported"),
    "prompt_cache_options": (ANY, "the prefix cache is automatic; it takes no options"),
}
# Accepted, no effect here (routing and bookkeeping hints).
NO_EFFECT = {"service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"}
# A chat field named in an error -> the Responses field the client sent.
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
EXTENSIONS = (
    "priority",
    "slo",
    "seed",
    "ignore_eos",
    "top_k",
    "min_tokens",
    "min_p",
    "repetition_penalty",
)


def renamed(exc: APIError) -> APIError:
    """A chat-path error, naming the Responses field instead of the chat one."""
    if exc.param in PARAMS:
        new = PARAMS[exc.param]
        if exc.message.startswith(exc.param):
            exc.message = new + exc.message[len(exc.param) :]
        exc.param = new
    return exc


async def conversation(store: ResponseStore, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The items this response answers: the previous response's, then this input's."""
    items: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        record = await store.get(body.previous_response_id)
        if record is None:
            raise APIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items = [*record["items"], *record["response"]["output"]]
    return items + input_items(body.input)


def input_items(given: str | list[InputItem | dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as plain items; an item or content part not served is a 400 naming it."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    out = []
    for i, item in enumerate(given):
        if isinstance(item, dict):
            kind = item.get("type", "message")
            if kind in ("message", "function_call", "function_call_output"):
                raise bad_request(f"input.{i}: not a valid {kind} item", param=f"input.{i}")
            raise bad_request(
                f"input.{i}.type: item type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param=f"input.{i}.type",
            )
        dumped = item.model_dump(exclude_none=True)
        for key in ("content", "output"):
            _check_parts(getattr(item, key, None), f"input.{i}.{key}")
        if dumped["type"] == "function_call":
            _check_arguments(dumped["arguments"], f"input.{i}.arguments")
        out.append(dumped)
    return out


def _check_parts(parts: object, param: str) -> None:
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        if not isinstance(part, InputText):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad_request(
                f"{param}.{j}: content type {kind!r} is not supported (input_text, output_text)",
                param=f"{param}.{j}",
            )


def _check_arguments(arguments: str, param: str) -> None:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(f"{param}: expected a JSON object", param=param)


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append(
                {"role": "tool", "content": _text(item["output"]), "tool_call_id": item["call_id"]}
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{type, name, parameters}`) in the chat shape."""
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools.{i}.type: only function tools are served (got {tool.get('type')!r})",
                param=f"tools.{i}.type",
            )
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools.{i}.name: a function name is required", param=f"tools.{i}")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools.{i}.parameters: expected a JSON schema object", f"tools.{i}")
        fn: dict[str, Any] = {"name": name, "parameters": params or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    function = isinstance(choice, dict) and choice.get("type") == "function"
    if function and isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice: expected none, auto, required or {{type: function, name}}, got {choice!r}",
        param="tool_choice",
    )


def chat_response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("text.format.schema: expected a JSON schema object", "text.format")
        name = fmt.get("name") if isinstance(fmt.get("name"), str) else "response"
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    raise bad_request(
        f"text.format.type {kind!r}: expected text, json_object or json_schema", "text.format"
    )


def to_chat(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates this response (what the chat path plans)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(items, body.instructions),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": chat_response_format(body.text.format if body.text else None),
        "stream": bool(body.stream),
        **{name: getattr(body, name) for name in EXTENSIONS},
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"input ({loc}): {first['msg']}", param="input") from None


def usage(gen: Generation) -> dict[str, Any]:
    prompt, output = len(gen.plan.prompt_ids), gen.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": gen.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }


@dataclass
class Turn:
    """One response being made: the request and the conversation it answers."""

    body: ResponsesRequest
    items: list[dict[str, Any]]  # the conversation's input items (stored for continuation)
    model: str
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    _output: list[dict[str, Any]] | None = field(default=None, init=False, repr=False)

    def output(self, gen: Generation) -> list[dict[str, Any]]:
        """The output items: the answer's text as a message, and its function calls (at most
        one with `parallel_tool_calls: false`); always a message when there is no call.
        Made once (the calls' ids stay the same in every event and the stored record)."""
        if self._output is None:
            self._output = self._make_output(gen)
        return self._output

    def _make_output(self, gen: Generation) -> list[dict[str, Any]]:
        plan = gen.plan
        content: str | None = gen.text
        calls: list[dict[str, Any]] = []
        if plan.tools_mode:
            content, calls = tool_calls.parse(gen.text, plan.tools_mode, plan.tool_parser)
        if self.body.parallel_tool_calls is False:
            calls = calls[:1]
        status = "incomplete" if gen.finish_reason == "length" else "completed"
        out = [message_item(self.message_id, content or "", status)] if content or not calls else []
        return out + [call_item(c) for c in calls]

    def response(self, gen: Generation | None, status: str = "") -> dict[str, Any]:
        """The Response object: in progress (no generation yet) or finished."""
        body = self.body
        if gen is not None:
            status = "incomplete" if gen.finish_reason == "length" else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output(gen) if gen is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
            "truncation": "disabled",
            "usage": usage(gen) if gen is not None else None,
            "store": body.store is not False,
            "metadata": body.metadata or {},
            "user": body.user,
            "background": False,
            "service_tier": "default",
            "alise": final_extension(gen) if gen is not None else {},
        }

    def record(self, response: dict[str, Any]) -> dict[str, Any]:
        """What the store keeps: the response and the input items it answered."""
        return {"response": response, "items": self.items}
