"""The Responses API (`/v1/responses`) with real clients against the real stack: the openai
SDK's `responses.create` / `responses.stream` / `retrieve` / `delete` and an `openai-agents`
Agent, over a gateway backed by the real scheduler and executor (tiny random-weight model with
the bundled tokenizer; structured outputs and forced tool calls keep its answers well formed)
and an embedded Redis holding the stored responses.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from lab.gateway.testing import inprocess_backend, inprocess_stack, running_gateway
from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
# a cut at max_output_tokens, never an EOS: the answer's length is exact
EXACT = {"ignore_eos": True}
HI = [{"role": "user", "content": "Hi"}]


class Answer(BaseModel):
    answer: bool


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    with inprocess_stack(tmp_path_factory.mktemp("gw-responses"), tiny_model) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_create_text_is_stored_retrieved_and_deleted(client, model):
    from openai import NotFoundError

    plain = client.responses.create(model=model, input="Hi", max_output_tokens=6, extra_body=EXACT)
    told = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        instructions="Answer in French.",
        max_output_tokens=6,
        temperature=0.5,
        top_p=0.9,
        extra_body=EXACT,
    )
    for resp in (plain, told):
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert resp.usage.output_tokens == 6
        assert resp.usage.total_tokens == resp.usage.input_tokens + 6
        assert [item.type for item in resp.output] == ["message"]
        assert resp.output[0].content[0].type == "output_text"
    # the chat path's prompt: the instructions are a system message before the user turn
    for resp, messages in (
        (plain, HI),
        (told, [{"role": "system", "content": "Answer in French."}, *HI]),
    ):
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert told.usage.input_tokens != plain.usage.input_tokens
    assert (told.instructions, told.temperature, told.top_p) == ("Answer in French.", 0.5, 0.9)
    got = client.responses.retrieve(told.id)
    assert got.id == told.id and got.output_text == told.output_text
    client.responses.delete(told.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(told.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)


def test_json_schema_create_and_stream_parse(client, model):
    parsed = client.responses.parse(
        model=model, input="Is the sky blue?", text_format=Answer, max_output_tokens=32
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    with client.responses.stream(
        model=model, input="Is water wet?", text_format=Answer, max_output_tokens=32
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Answer)
    assert json.loads(final.output_text) == final.output_parsed.model_dump()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" in kinds
    json_mode = client.responses.create(
        model=model,
        input="Give a JSON object.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
    )
    if json_mode.status == "completed":  # a small model may wander in a string until the cap
        assert isinstance(json.loads(json_mode.output_text), dict)


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["text", "tools-auto"])
def test_raw_text_stream_events_parse_as_the_sdk_types(client, model, tools):
    """Text streams as it comes; with tools (`auto`) it is held back and written out at the
    end (the tiny model writes no call): the same events either way."""
    from openai.types.responses import ResponseIncompleteEvent, ResponseTextDeltaEvent

    extra = {} if tools is None else {"tools": tools}
    events = list(
        client.responses.create(
            model=model, input="Hi", max_output_tokens=5, stream=True, extra_body=EXACT, **extra
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
    last = events[-1]
    assert isinstance(last, ResponseIncompleteEvent)
    assert last.response.usage.output_tokens == 5
    assert "".join(deltas) == last.response.output_text
    assert [e.type for e in events if not e.type.endswith(".delta")] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]


def test_function_call_round_trip_across_gateway_replicas(stack, tiny_model, client, model):
    """A forced call, streamed; its result sent back with previous_response_id to a second
    gateway on the same Redis, which continues the stored conversation."""
    with client.responses.stream(
        model=model, input="Weather in Paris?", tools=[WEATHER], tool_choice="required"
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    settings = GatewaySettings(
        model=str(tiny_model),
        scheduler_address=stack["address"],
        predictor_addresses=[f"127.0.0.1:{free_port()}"],
        redis_url=stack["redis_url"],
    )
    from openai import OpenAI

    with running_gateway(settings) as other_url:
        other = OpenAI(base_url=other_url + "/v1", api_key="none", max_retries=0, timeout=60)
        second = other.responses.create(
            model=model,
            previous_response_id=first.id,
            input=[
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}
            ],
            tools=[WEATHER],
            max_output_tokens=4,
            extra_body=EXACT,
        )
    assert second.previous_response_id == first.id
    # the whole conversation was the prompt: the first turn, its call and the call's result,
    # the same prompt as when the client sends that history itself (as agent loops do)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        result,
    ]
    resent = client.responses.create(
        model=model, input=history, tools=[WEATHER], max_output_tokens=1, store=False
    )
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    # parallel_tool_calls false and a named function: one call of that function
    named = client.responses.create(
        model=model,
        input="Weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert [item.type for item in named.output] == ["function_call"]


def test_an_openai_agents_agent_runs_a_tool_turn(client, stack, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing leaves the machine
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(
            model=model,
            openai_client=AsyncOpenAI(
                base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=60
            ),
        ),
        model_settings=ModelSettings(tool_choice="required", max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )

    async def both() -> tuple[Any, Any, list[str]]:
        """One turn over JSON, then one over the typed SSE events."""
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        run = Runner.run_streamed(agent, "And in Oslo?", max_turns=2)
        kinds = [event.type async for event in run.stream_events()]
        return result, run, kinds

    result, streamed, kinds = asyncio.run(both())
    assert len(asked) == 2
    assert result.final_output == f"Sunny in {asked[0]}"
    assert [item.type for item in result.raw_responses[0].output] == ["function_call"]
    assert streamed.final_output == f"Sunny in {asked[1]}"
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
        ({"frobnicate": 1}, 400, "frobnicate"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"text": {"format": {"type": "text"}, "tone": "dry"}}, 400, "text.tone"),
        ({"tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
        ({"max_output_tokens": 10_000}, 400, "max_output_tokens"),
        ({"previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"priority": 1}, 400, None),  # only the priority policy orders by it, as on chat
    ],
)
def test_unsupported_fields_are_refused_by_name(stack, extra, status, param):
    body = {"input": "Hi", "max_output_tokens": 2, "include": [], "truncation": "disabled"}
    got = httpx.post(stack["url"] + "/v1/responses", json={**body, **extra}, timeout=60)
    assert got.status_code == status, got.text
    if param is not None:
        assert got.json()["error"]["param"] == param
    assert "priority" in got.text or param in got.text


def test_slo_headers_are_read_as_on_chat(stack):
    url = stack["url"] + "/v1/responses"
    bad = httpx.post(url, json={"input": "Hi"}, headers={"X-SLO-TTFT-MS": "soon"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-ttft-ms"
    ok = httpx.post(
        url,
        json={"input": "Hi", "max_output_tokens": 2, "slo": {"ttft_ms": 60000, "tbt_ms": 60000}},
        headers={"X-SLO-Deadline-MS": "60000"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2


def test_a_timeout_is_a_504_or_an_error_event(tmp_path, redis_server):
    """No executor: the request waits in the queue until the gateway gives up; a stream that
    has started ends with an `error` event the SDK parses, and nothing is stored."""
    from openai import APIStatusError, OpenAI
    from openai.types.responses import ResponseErrorEvent

    with inprocess_backend(tmp_path, None, redis_server.url) as backend:
        settings = GatewaySettings(
            scheduler_address=backend["address"],
            request_timeout_s=1.5,
            predictor_addresses=[f"127.0.0.1:{free_port()}"],
            redis_url=redis_server.url,
        )
        with running_gateway(settings) as url:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
            with pytest.raises(APIStatusError) as info:
                client.responses.create(input="Hi", max_output_tokens=4)
            assert info.value.status_code == 504
            events = list(client.responses.create(input="Hi", max_output_tokens=4, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert isinstance(events[-1], ResponseErrorEvent) and events[-1].code == "timeout"
    import redis

    assert not redis.Redis.from_url(redis_server.url).keys("alise:response:*")
