"""A request's structured-output fields -> one guide `(kind, spec)` (services/common/guided.py),
checked by compiling it: a request asking for two structures, or for one that does not
compile, is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from services.common.guided import GuideError
from services.gateway.errors import bad_request

if TYPE_CHECKING:
    from services.common.guided import GuideCompiler
    from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

Guide = tuple[str, str]  # (kind, spec); ("", "") = none
VLLM_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _spec(kind: str, value: Any) -> str:
    if kind in ("json_schema", "choice") and not isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _response_format(fmt: dict[str, Any]) -> Guide | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json", "")
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return ("json_schema", json.dumps(schema))
    raise bad_request(
        f"response_format type {kind!r}: expected text, json_object or json_schema",
        param="response_format",
    )


def requested(body: CompletionRequest | ChatCompletionRequest) -> tuple[Guide, str] | None:
    """(guide, the field it came from), or None; two structures at once are a 400."""
    found: list[tuple[Guide, str]] = []
    if body.response_format and (g := _response_format(body.response_format)):
        found.append((g, "response_format"))
    for field, kind in VLLM_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append(((kind, _spec(kind, value)), field))
    for key, value in (body.structured_outputs or {}).items():
        if key not in STRUCTURED_KEYS:
            raise bad_request(
                f"structured_outputs.{key}: expected one of {', '.join(STRUCTURED_KEYS)}",
                param="structured_outputs",
            )
        kind = STRUCTURED_KEYS[key]
        found.append(((kind, _spec(kind, value)), "structured_outputs"))
    if len(found) > 1:
        raise bad_request(
            f"one structured output at a time (got {', '.join(f for _, f in found)})",
            param=found[1][1],
        )
    return found[0] if found else None


async def checked_guide(
    body: CompletionRequest | ChatCompletionRequest, compiler: GuideCompiler
) -> Guide:
    """The request's guide, compiled once to check it (("", "") when none)."""
    got = requested(body)
    if got is None:
        return ("", "")
    (kind, spec), field = got
    try:
        await asyncio.to_thread(compiler.check, kind, spec)
    except GuideError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None
    return (kind, spec)


async def checked_tool_guide(guide: Guide, compiler: GuideCompiler) -> Guide:
    """The JSON-schema guide of a forced tool call, compiled to check the tools' schemas."""
    try:
        await asyncio.to_thread(compiler.check, *guide)
    except GuideError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None
    return guide
