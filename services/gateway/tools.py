"""Tool calling: `tools`, `tool_choice` and tool messages in, `tool_calls` out.

Rendering: a chat template that knows tools gets them (`tools=` of `apply_chat_template`);
otherwise (SmolLM2's template does not) the tools are described in the system message in the
Hermes style: their JSON signatures inside `<tools></tools>`, and each call expected as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. History is rendered the same
way: an assistant turn's `tool_calls` become those tags, a `tool` message a
`<tool_response>` block.

Choices: `none` renders no tools and parses nothing; `auto` (the default with tools) parses
`<tool_call>` blocks out of the answer (the text around them stays the content);
`required` and a named function constrain the answer with a JSON schema guide
(`services/common/guided.py`): one object `{"name", "arguments"}` whose arguments follow
that function's parameters, so it always parses. One call per answer is forced that way;
`auto` returns as many as the model writes.

Parsing `auto` answers is per model family (`PARSERS`, chosen by `parser_for` from the chat
template unless `ALISE_TOOL_PARSER` names one): `hermes` takes `<tool_call>` blocks;
`llama3_json` takes an answer that is only calls, Llama 3's way: JSON objects `{"name",
"parameters"}` (or `arguments`), separated by `;`, after an optional `<|python_tag|>`. A new
family is one function of (text) -> (content, calls) registered in `PARSERS`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import bad_request

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "" (no tools) | "auto" | "forced"
    guide: tuple[str, str] = ("", "")  # the JSON-schema guide of a forced call


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"tools[{i}]: expected {{type: function, function: {{name, parameters}}}}",
                param=f"tools.{i}",
            )
        out.append(fn)
    return out


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan_tools(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None) -> ToolPlan:
    """What the request's tools ask for (a 400 for a malformed tool or an unknown choice)."""
    if not tools or choice == "none":
        if isinstance(choice, dict) or choice == "required":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan("")
    fns = _functions(tools)
    if choice in (None, "auto"):
        return ToolPlan("auto")
    if choice == "required":
        schemas = [_call_schema(fn) for fn in fns]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return ToolPlan("forced", ("json_schema", json.dumps(schema)))
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    chosen = [fn for fn in fns if fn["name"] == name]
    if not chosen:
        raise bad_request(
            f"tool_choice: expected none, auto, required or one of the tools, got {choice!r}",
            param="tool_choice",
        )
    return ToolPlan("forced", ("json_schema", json.dumps(_call_schema(chosen[0]))))


def system_prompt(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The function "
        f"signatures are within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    )


def _arguments(args: Any) -> Any:
    """A past call's arguments as the template writes them: parsed when they are JSON, else the
    string as sent (a model may have produced malformed JSON and the client echoes it back;
    OpenAI's API accepts that too)."""
    if not isinstance(args, str):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args


def history_text(role: str, content: str, extra: dict[str, Any]) -> tuple[str, str]:
    """(role, text) of one message with its tool calls or tool result written out."""
    if role == "assistant" and extra.get("tool_calls"):
        calls = []
        for call in extra["tool_calls"]:
            fn = call.get("function") or {}
            args = _arguments(fn.get("arguments") or "{}")
            calls.append(json.dumps({"name": fn.get("name"), "arguments": args}))
        blocks = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        return role, (content + "\n" if content else "") + blocks
    if role == "tool":
        return role, f"<tool_response>\n{content}\n</tool_response>"
    return role, content


def _call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def parse(text: str, mode: str, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: a forced answer is the call's JSON itself; `auto`
    asks the model family's parser (`PARSERS`)."""
    if mode == "forced":
        try:
            call = _call(json.loads(text))
        except json.JSONDecodeError:
            call = None
        return (None, [call]) if call else (text, [])
    return PARSERS[parser](text)


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Every well-formed `<tool_call>` block; the rest stays the content."""
    calls = []
    for block in CALL.findall(text):
        try:
            call = _call(json.loads(block))
        except json.JSONDecodeError:
            call = None
        if call:
            calls.append(call)
    if not calls:
        return text, []
    rest = CALL.sub("", text).strip()
    return (rest or None), calls


def _llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """An answer that is only calls: JSON objects separated by `;` (after an optional
    `<|python_tag|>`); anything else is content, with no calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
    return (None, calls) if calls else (text, [])


PARSERS: dict[str, Callable[[str], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
}


def parser_for(chat_template: str | None, setting: str = "auto") -> str:
    """The tool parser of a model: the setting when it names one, else by its chat template
    (Llama 3's mentions `<|python_tag|>`); Hermes-style otherwise."""
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"tool parser must be auto or one of {sorted(PARSERS)}: {setting!r}")
        return setting
    return "llama3_json" if PYTHON_TAG in (chat_template or "") else "hermes"
