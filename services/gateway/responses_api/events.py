"""A streamed Response as OpenAI's typed server-sent events (`event: <type>` + `data: <json>`,
each with its `sequence_number`; no `[DONE]`), in the order the openai SDK's stream
accumulator expects:

`response.created`, `response.in_progress`; a text answer opens its message at once
(`response.output_item.added`, `response.content_part.added`) and streams
`response.output_text.delta` per piece; an answer that may hold function calls (tools) is held
back, as on the chat path, and written out at the end: its message (if any text) and, per
call, `output_item.added`, `function_call_arguments.delta` / `.done`, `output_item.done`.
Then `response.completed` (or `response.incomplete` when `max_output_tokens` cut it). A
failure on the way is an `error` event.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from services.gateway.responses_api.chat import message_item

if TYPE_CHECKING:
    from services.gateway.errors import APIError
    from services.gateway.generation import Generation
    from services.gateway.responses_api.chat import Turn


class ResponseEvents:
    def __init__(self, turn: Turn, gen: Generation) -> None:
        self.turn = turn
        self.gen = gen
        self.sequence = 0
        self.live_text = not gen.plan.tools_mode  # text streams as it comes

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _text_at(self, index: int, **fields: Any) -> dict[str, Any]:
        return {
            "item_id": self.turn.message_id,
            "output_index": index,
            "content_index": 0,
            **fields,
        }

    def head(self) -> list[bytes]:
        snapshot = self.turn.response(None, "in_progress")
        out = [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]
        if self.live_text:
            out += self._open_message(0)
        return out

    def _open_message(self, index: int) -> list[bytes]:
        item = message_item(self.turn.message_id, "", "in_progress")
        part = item.pop("content")[0]
        item["content"] = []
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", **self._text_at(index, part=part)),
        ]

    def piece(self, text: str) -> bytes:
        if not self.live_text or not text:
            return b""
        return self._event(
            "response.output_text.delta", **self._text_at(0, delta=text, logprobs=[])
        )

    def tail(self, final: dict[str, Any]) -> list[bytes]:
        """Every output item's closing events, then the response's last event."""
        out: list[bytes] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                out += self._close_message(index, item)
            else:
                out += self._call(index, item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=final))
        return out

    def _close_message(self, index: int, item: dict[str, Any]) -> list[bytes]:
        part = item["content"][0]
        out = [] if self.live_text else self._open_message(index)
        if part["text"] and not self.live_text:
            delta = self._text_at(index, delta=part["text"], logprobs=[])
            out.append(self._event("response.output_text.delta", **delta))
        done = self._text_at(index, text=part["text"], logprobs=[])
        return out + [
            self._event("response.output_text.done", **done),
            self._event("response.content_part.done", **self._text_at(index, part=part)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, index: int, item: dict[str, Any]) -> list[bytes]:
        opened = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": index}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", delta=item["arguments"], **where),
            self._event(
                "response.function_call_arguments.done", arguments=item["arguments"], **where
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def error(self, exc: APIError) -> bytes:
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)
