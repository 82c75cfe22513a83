"""docs/gateway.md's table of request fields says what the code does with every field."""

from __future__ import annotations

import re
from pathlib import Path

from services.gateway.params import NO_EFFECT, REFUSED
from services.gateway.responses_api import chat as responses
from services.gateway.responses_api.schemas import ResponsesRequest
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|")


def table(heading: str = "### Every request field", row: re.Pattern = ROW) -> dict[str, tuple]:
    text = DOC.read_text(encoding="utf-8").split(heading, 1)[1]
    text = re.split(r"\n#", text, maxsplit=1)[0]  # up to the next heading
    rows = {}
    for line in text.splitlines():
        if (m := row.match(line)) is not None:
            rows[m.group(1)] = tuple(g.strip() for g in m.groups()[1:])
    return rows


def test_every_field_has_one_row_with_its_status():
    rows = table()
    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert set(rows) == declared | set(REFUSED) | NO_EFFECT
    for name, (endpoint, status) in rows.items():
        if name in declared:
            assert status in ("honoured", "accepted, no effect"), name
        elif name in NO_EFFECT:
            assert status == "accepted, no effect", name
        else:
            assert status.startswith("400"), name
        chat = name in ChatCompletionRequest.model_fields
        completion = name in CompletionRequest.model_fields
        if chat != completion:
            assert endpoint == ("chat" if chat else "completions"), name


def test_every_responses_field_has_one_row_with_its_status():
    rows = table("#### Every Responses field", re.compile(r"^\| `(\w+)` \| ([^|]+) \|"))
    declared = set(ResponsesRequest.model_fields)
    assert set(rows) == declared | set(responses.REFUSED) | responses.NO_EFFECT
    for name, (status,) in rows.items():
        if name in declared:
            assert status in ("honoured", "accepted, no effect"), name
        elif name in responses.NO_EFFECT:
            assert status == "accepted, no effect", name
        else:
            assert status.startswith("400"), name
