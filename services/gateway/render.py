"""OpenAI response objects and SSE framing for chat and text completions.

Chunks are built as plain dicts and serialized once (`json.dumps`, compact) because this is
the per-token hot path. SSE events are `data: <json>\n\n`; the stream ends with
`data: [DONE]\n\n`. ALISE extensions ride in an `alise` key that OpenAI clients ignore.
"""

from __future__ import annotations

import json
import time

from google.protobuf.json_format import MessageToDict

from services.common.pb import common_pb2
from services.gateway import tools
from services.gateway.generation import Generation
from services.gateway.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from services.gateway.version import VERSION

DONE = b"data: [DONE]\n\n"
FINGERPRINT = "alise-" + VERSION  # OpenAI's system_fingerprint: the serving build


def sse(payload: dict) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        + b"\n\n"
    )


def prediction_dict(prediction: common_pb2.Prediction | None) -> dict | None:
    if prediction is None:
        return None
    return {
        "length": prediction.length,
        "source": prediction.source,
        "similarity": round(prediction.similarity, 4),
        "neighbors": prediction.neighbors,
        "p_capped": round(prediction.p_capped, 4),
        "spread": round(prediction.spread, 4),
        "regime": prediction.regime,
    }


def prediction_header(prediction: common_pb2.Prediction | None) -> str:
    """`length=123; source=retrieval` (or `none`), for the X-ALISE-Prediction header."""
    if prediction is None:
        return "none"
    return f"length={prediction.length}; source={prediction.source}"


def usage_dict(gen: Generation, *more: Generation) -> dict:
    """The usage of one answer, or of several (each prompt counted once)."""
    prompts = {g.plan.prompt_index: len(g.plan.prompt_ids) for g in (gen, *more)}
    prompt = sum(prompts.values())
    completion = gen.completion_tokens + sum(g.completion_tokens for g in more)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def final_extension(gen: Generation) -> dict:
    ext = {"prediction": prediction_dict(gen.used_prediction or gen.prediction)}
    if gen.usage is not None:
        ext["timing"] = MessageToDict(gen.usage, preserving_proto_field_name=True)
    return ext


class ChunkMaker:
    """Builds the stream's chunks for one request (chat or text completion)."""

    def __init__(
        self,
        gen: Generation,
        chat: bool,
        include_usage: bool,
        token_times: bool,
        index: int = 0,
        response_id: str | None = None,
    ) -> None:
        self.gen = gen
        self.chat = chat
        self.include_usage = include_usage
        self.token_times = token_times
        self.index = index  # the choice this maker writes (n > 1: one maker per choice)
        self.id = response_id or ("chatcmpl-" if chat else "cmpl-") + gen.plan.request_id
        # echo + logprobs: the prompt's text goes with its log-probabilities, in the first
        # token's chunk (they come with the first token); plain echo sends it at once
        self.echo_later = gen.plan.echo and gen.plan.logprobs is not None
        echo_now = gen.plan.echo and not self.echo_later
        self.offset = len(gen.plan.prompt_text) if echo_now else 0  # completions text_offset
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict, extension: dict | None = None) -> bytes:
        payload = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.gen.plan.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [choice],
        }
        if self.include_usage:
            payload["usage"] = None
        if extension:
            payload["alise"] = extension
        return sse(payload)

    def _choice(
        self,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        shaped = None
        if logprobs:
            shaped = (
                chat_logprobs(logprobs) if self.chat else completion_logprobs(logprobs, self.offset)
            )
            self.offset += sum(len(e.token) for e in logprobs)
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""}
                if role
                else ({} if text is None else {"content": text})
            )
            return {
                "index": self.index,
                "delta": delta,
                "logprobs": shaped,
                "finish_reason": finish_reason,
            }
        return {
            "index": self.index,
            "text": text or "",
            "logprobs": shaped,
            "finish_reason": finish_reason,
        }

    def first(self) -> bytes | None:
        """Chat streams open with the role; it carries the request's prediction."""
        ext = {
            "request_id": self.gen.plan.request_id,
            "prediction": prediction_dict(self.gen.prediction),
        }
        if self.chat:
            return self._chunk(self._choice(None, None, role=True), ext)
        if self.gen.plan.echo and not self.echo_later:
            return self._chunk(self._choice(self.gen.plan.prompt_text, None), ext)
        return None

    def piece(
        self,
        text: str,
        token_time: float,
        logprobs: list[TokenLogprob] | None = None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        """One piece's chunk (b"" while an answer that may hold tool calls is held back)."""
        if self.gen.plan.tools_mode:
            return b""
        if self.echo_later:
            self.echo_later = False
            text = self.gen.plan.prompt_text + text
        ext = {"time": token_time} if self.token_times else None
        choice = self._choice(text, None, logprobs=logprobs)
        if self.gen.plan.return_token_ids:
            choice["token_ids"] = token_ids or []
        return self._chunk(choice, ext)

    def finish(self) -> bytes:
        """This choice's last chunk: its finish reason (after the held-back answer's content
        or tool calls, when the request has tools)."""
        if not self.gen.plan.tools_mode:
            return self._chunk(
                self._choice(None, self.gen.finish_reason), final_extension(self.gen)
            )
        plan = self.gen.plan
        content, calls = tools.parse(self.gen.text, plan.tools_mode, plan.tool_parser)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        body = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        done = self._choice(None, _finish_reason(self.gen, calls))
        return self._chunk(body) + self._chunk(done, final_extension(self.gen))

    def tail(self, gens: list[Generation]) -> list[bytes]:
        """The usage chunk (when asked) over every answer, then [DONE]."""
        out = []
        if self.include_usage:
            out.append(
                sse(
                    {
                        "id": self.id,
                        "object": self.object,
                        "created": self.created,
                        "model": self.gen.plan.model,
                        "system_fingerprint": FINGERPRINT,
                        "choices": [],
                        "usage": usage_dict(*gens),
                    }
                )
            )
        out.append(DONE)
        return out

    def last(self) -> list[bytes]:
        return [self.finish(), *self.tail([self.gen])]


def full_response(gen: Generation, chat: bool, *more: Generation) -> dict:
    """The non-streaming body: one choice per answer (`more`: the other answers of n > 1)."""
    gens = [gen, *more]
    head = (
        {"id": "chatcmpl-" + gen.plan.request_id, "object": "chat.completion"}
        if chat
        else {"id": "cmpl-" + gen.plan.request_id, "object": "text_completion"}
    )
    return {
        **head,
        "created": int(time.time()),
        "model": gen.plan.model,
        "system_fingerprint": FINGERPRINT,
        "choices": [_full_choice(g, chat, i) for i, g in enumerate(gens)],
        "usage": usage_dict(*gens),
        "alise": final_extension(gen),
    }


def _full_choice(gen: Generation, chat: bool, index: int) -> dict:
    plan = gen.plan
    asked = plan.logprobs is not None
    if chat:
        message: dict = {"role": "assistant", "content": gen.text}
        calls: list = []
        if plan.tools_mode:
            message["content"], calls = tools.parse(gen.text, plan.tools_mode, plan.tool_parser)
            if calls:
                message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(gen.logprobs) if asked else None,
            "finish_reason": _finish_reason(gen, calls),
            **({"token_ids": gen.token_ids} if plan.return_token_ids else {}),
        }
    prefix = plan.prompt_text if plan.echo else ""
    shaped = None
    if asked and plan.echo:  # the prompt's entries first; offsets count from the prompt's start
        shaped = completion_logprobs(gen.prompt_logprobs + gen.logprobs, 0)
    elif asked:
        shaped = completion_logprobs(gen.logprobs, len(prefix))
    return {
        "index": index,
        "text": prefix + gen.text,
        "logprobs": shaped,
        "finish_reason": gen.finish_reason,
        **({"token_ids": gen.token_ids} if plan.return_token_ids else {}),
    }


def _finish_reason(gen: Generation, calls: list) -> str | None:
    """OpenAI's `tool_calls` when the answer ended (not cut) on tool calls."""
    return "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
