"""The OpenAI protocol over loopback: a real gateway backed by the real scheduler and executor
(tiny random-weight model with the bundled tokenizer). SSE framing byte-wise with httpx, the
official openai client for every endpoint, stop strings, disconnect -> upstream abort, 429.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from lab.gateway.testing import inprocess_backend, inprocess_stack, running_gateway
from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    # vLLM's priority scheduling: the only policy that takes a non-zero `priority`
    with inprocess_stack(
        tmp_path_factory.mktemp("gw-protocol"), tiny_model, scheduler_kw={"policy": "priority"}
    ) as stack:
        yield stack


@pytest.fixture
def openai_client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def model(openai_client):
    return openai_client.models.list().data[0].id


def stats(stack):
    from services.common.grpc_client import aio_channel
    from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

    async def ask():
        async with aio_channel(stack["address"]) as channel:
            return await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=5
            )

    return stack["loop"].run(ask())


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    return [e[len(b"data: ") :] for e in events]


def test_chat_sse_framing_is_byte_exact(stack, model):
    body = {
        "model": model,
        "messages": CHAT,
        "stream": True,
        "max_tokens": 7,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", stack["url"] + "/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-alise-prediction"] == "none"  # predictor is down
        raw = b"".join(response.iter_raw())
    payloads = sse_events(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == model for c in chunks)
    assert all(c["system_fingerprint"].startswith("alise-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, final, usage = chunks[1:]
    assert content and all(c["choices"][0]["finish_reason"] is None for c in content)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert final["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 7


def test_completion_sse_without_usage_has_no_usage_chunk(stack, model):
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "stream": True,
        "max_tokens": 5,
        "ignore_eos": True,
    }
    raw = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=60).content
    payloads = sse_events(raw)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == b"[DONE]"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_client_chat_streaming_matches_non_streaming(openai_client, model):
    kwargs = dict(
        model=model, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    full = openai_client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 5
    stream = openai_client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_return_token_ids_streams_every_id_once_and_decodes_to_the_text(stack, model, tiny_model):
    """vLLM's `return_token_ids`: each chunk's choice carries the ids it covers (a chunk whose
    text is held back by the detokenizer still carries its id), so the ids add up to
    exactly the answer: max_tokens of them with ignore_eos, the same as the full response's,
    and the tokenizer decodes them to the streamed text."""
    from transformers import AutoTokenizer

    body = {
        "model": model,
        "messages": CHAT,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = httpx.post(stack["url"] + "/v1/chat/completions", json=body, timeout=60).json()
    ids, text = [], ""
    with httpx.stream(
        "POST", stack["url"] + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids") or []
                    text += (choice.get("delta") or {}).get("content") or ""
    assert len(ids) == 16 and ids == full["choices"][0]["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_openai_client_completions(openai_client, model):
    full = openai_client.completions.create(
        model=model,
        prompt="The weather today",
        max_tokens=9,
        temperature=0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 9 and full.choices[0].text
    pieces = list(
        openai_client.completions.create(
            model=model,
            prompt="The weather today",
            max_tokens=9,
            temperature=0,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == full.choices[0].text


def test_token_id_prompt_and_max_completion_tokens(openai_client, model):
    out = openai_client.completions.create(
        model=model, prompt=[1, 2, 3, 4], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3
    chat = openai_client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=4, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 4


def scheduler_params(stack, request_id: str) -> dict:
    """What the scheduler stored for a request when it admitted it (its Redis record)."""
    loaded = stack["loop"].run(stack["scheduler"].service.store.load(request_id))
    assert loaded is not None, f"the scheduler never admitted {request_id}"
    return json.loads(loaded[0]["params"])


@pytest.mark.parametrize(
    "route,body,headers,priority,slo",
    [
        (
            "chat",
            {"priority": 7, "slo": {"ttft_ms": 1500, "tbt_ms": 80, "deadline_ms": 20000}},
            {},
            7,
            (1.5, 0.08, 20.0),
        ),
        (
            "completion",
            {},
            {
                "x-priority": "-3",
                "x-slo-ttft-ms": "2500",
                "x-slo-tbt-ms": "120",
                "x-slo-deadline-ms": "30000",
            },
            -3,
            (2.5, 0.12, 30.0),
        ),
        # The body wins field by field; headers fill what it leaves out.
        (
            "chat",
            {"priority": 5, "slo": {"ttft_ms": 1000}},
            {"x-priority": "9", "x-slo-ttft-ms": "4000", "x-slo-tbt-ms": "50"},
            5,
            (1.0, 0.05, None),
        ),
        ("completion", {}, {}, 0, (None, None, None)),
    ],
)
def test_priority_and_slo_reach_the_scheduler(stack, model, route, body, headers, priority, slo):
    request_id = f"prio-{uuid.uuid4().hex[:12]}"
    if route == "chat":
        path, base = "/v1/chat/completions", {"messages": CHAT}
    else:
        path, base = "/v1/completions", {"prompt": "Once upon a time"}
    response = httpx.post(
        stack["url"] + path,
        timeout=60,
        headers={"X-Request-Id": request_id, **headers},
        json={"model": model, "max_tokens": 2, "ignore_eos": True, **base, **body},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    # the client's id is echoed, never the scheduler's key: that is the body's id
    key = response.json()["id"].split("-", 1)[1]
    assert key != request_id
    params = scheduler_params(stack, key)
    assert params["priority"] == priority
    stored = params["slo"]
    assert (stored["ttft_s"], stored["tbt_s"], stored["deadline_s"]) == pytest.approx(slo)


def test_stop_string_cuts_text_and_aborts_upstream(openai_client, model, stack):
    kwargs = dict(model=model, prompt="Numbers:", temperature=0, extra_body={"ignore_eos": True})
    reference = openai_client.completions.create(max_tokens=24, **kwargs).choices[0].text
    stop = next(
        reference[i : i + 3]
        for i in range(4, len(reference) - 3)
        if reference[i : i + 3].strip() and reference[i : i + 3] not in reference[: i + 2]
    )
    aborted = stats(stack).aborted
    for stream in (False, True):
        result = openai_client.completions.create(
            max_tokens=24, stop=[stop, "\x00never"], stream=stream, **kwargs
        )
        if stream:
            chunks = list(result)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = result.choices[0].text, result.choices[0].finish_reason
        assert text == reference[: reference.index(stop)]
        assert reason == "stop"
    assert wait_for(lambda: stats(stack).aborted >= aborted + 2)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_aborts_upstream_and_frees_kv(stack, model):
    before = stats(stack)
    body = {
        "model": model,
        "prompt": "Go on forever",
        "stream": True,
        "max_tokens": 1000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", stack["url"] + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        mid = stats(stack)
        assert mid.running >= 1

    # Leaving the block closed the connection mid-stream.
    def freed():
        now = stats(stack)
        ex = now.executors[0]
        return (
            now.aborted > before.aborted
            and now.running == 0
            and ex.free_device_blocks == ex.num_device_blocks
        )

    assert wait_for(freed), stats(stack)


def test_full_queue_is_429_with_retry_after(tmp_path, model, redis_server):
    # A scheduler with room for one waiting request and no executor to drain it.
    with inprocess_backend(tmp_path, None, redis_server.url, max_waiting_requests=1) as backend:
        settings = GatewaySettings(
            scheduler_address=backend["address"], predictor_addresses=[f"127.0.0.1:{free_port()}"]
        )
        with running_gateway(settings) as url:
            body = {"prompt": "hello", "max_tokens": 4, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as first:
                assert first.status_code == 200  # accepted; waits in the queue
                second = httpx.post(url + "/v1/completions", json=body, timeout=30)
                assert second.status_code == 429, second.text
                assert int(second.headers["retry-after"]) >= 1
                assert second.json()["error"]["type"] == "rate_limit_error"


def test_health_and_metrics_with_scheduler_up(stack):
    health = httpx.get(stack["url"] + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["scheduler"] is True
    text = httpx.get(stack["url"] + "/metrics", timeout=10).text
    assert 'alise:gateway_request_success_total{finished_reason="length"}' in text
    assert "alise:gateway_time_to_first_token_seconds_count" in text


def test_request_timeout_is_504_and_aborts_upstream(tmp_path, redis_server):
    # No executor: the request waits in the scheduler's queue until the gateway gives up.
    with inprocess_backend(tmp_path, None, redis_server.url) as backend:
        settings = GatewaySettings(
            scheduler_address=backend["address"],
            request_timeout_s=1.5,
            predictor_addresses=[f"127.0.0.1:{free_port()}"],
        )
        with running_gateway(settings) as url:
            body = {"prompt": "hello", "max_tokens": 4}
            response = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "timeout"
            raw = httpx.post(
                url + "/v1/completions", json={**body, "stream": True}, timeout=30
            ).content
            payloads = sse_events(raw)
            assert payloads[-1] == b"[DONE]"
            assert json.loads(payloads[-2])["error"]["code"] == "timeout"
            assert wait_for(lambda: stats(backend).aborted >= 2 and stats(backend).waiting == 0)


def test_models_retrieve_answers_the_served_model_and_404s_others(openai_client, model):
    import openai

    card = openai_client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_sampling_controls_are_honoured_and_nulls_accepted(openai_client, model):
    def complete(**kw):
        kw.setdefault("max_tokens", 6)
        return openai_client.completions.create(
            model=model, prompt="Once upon a time", temperature=0, **kw
        )

    plain = complete()
    # a +100 bias makes one token win every step: its text repeated
    forced = complete(logit_bias={"330": 100}, extra_body={"ignore_eos": True})
    piece = forced.choices[0].text[: len(forced.choices[0].text) // 6]
    assert forced.choices[0].text == piece * 6 and forced.choices[0].text != plain.choices[0].text
    # a strong frequency penalty keeps greedy decoding from repeating a token
    looped = complete(logit_bias={"330": 3}, max_tokens=8)
    spread = complete(logit_bias={"330": 3}, max_tokens=8, frequency_penalty=2.0)
    assert spread.choices[0].text != looped.choices[0].text
    # explicit nulls and any integer seed, as OpenAI clients send them
    ok = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=None,
        top_p=None,
        n=None,
        seed=-1,
        presence_penalty=None,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert ok.choices[0].message.content is not None and ok.usage.completion_tokens >= 1


def test_stop_token_ids_end_the_answer_with_or_without_their_text(openai_client, model):
    def complete(**extra):
        return openai_client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=6,
            temperature=0,
            logit_bias={"330": 100},  # token 330 every step
            extra_body=extra,
        )

    forced = complete(ignore_eos=True)
    cut = complete(stop_token_ids=[330])
    kept = complete(stop_token_ids=[330], include_stop_str_in_output=True)
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == kept.usage.completion_tokens == 1
    assert cut.choices[0].text == ""
    assert kept.choices[0].text == forced.choices[0].text[: len(forced.choices[0].text) // 6]
    with pytest.raises(__import__("openai").BadRequestError):
        complete(stop_token_ids=[10**8])


def test_tokenize_detokenize_and_version(stack, model):
    """vLLM's utility routes use the served tokenizer and chat template; `developer` renders
    as `system`, and text parts are joined with newlines."""
    url = stack["url"]
    plain = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "Hello world"}).json()
    assert plain["count"] == len(plain["tokens"]) > 0 and plain["max_model_len"] > 0
    back = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == "Hello world"
    chat = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}, *CHAT]}
    ).json()
    as_system = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}, *CHAT]}
    ).json()
    assert chat["tokens"] == as_system["tokens"] and chat["count"] > plain["count"]
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    joined = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": parts}]}
    ).json()
    single = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Be\nbrief."}]}
    ).json()
    assert joined["tokens"] == single["tokens"]
    both = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": CHAT})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert other.status_code == 404
    assert httpx.get(f"{url}/version").json()["version"]


def test_a_reused_client_request_id_is_echoed_and_never_collides(stack, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    headers = {"X-Request-Id": "same-id"}
    first, second = (
        httpx.post(stack["url"] + "/v1/completions", json=body, headers=headers, timeout=60)
        for _ in range(2)
    )
    assert first.status_code == second.status_code == 200
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same-id"
    assert first.json()["id"] != second.json()["id"]
