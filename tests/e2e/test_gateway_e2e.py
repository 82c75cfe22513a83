"""End to end with the real bundled SmolLM2 model: gateway -> predictor -> scheduler ->
executor, through the official openai client and a headless Chromium on the playground.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from lab.gateway.testing import inprocess_backend, running_gateway
from services.common.redis_runner import EmbeddedRedis
from services.common.settings import GatewaySettings, PredictorSettings

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from services.predictor.server import start_predictor

    run_dir = tmp_path_factory.mktemp("gw-e2e")
    with (
        EmbeddedRedis(run_dir / "redis") as redis,
        inprocess_backend(
            run_dir,
            "smollm2-135m-instruct",
            redis.url,
            # the file's weights dequantized (not `auto`'s 4-bit products): these checks compare
            # with transformers on that copy and lean on its greedy answers; `alise serve`'s
            # default is tested in test_serve.py
            executor_kw={
                "data_dir": PredictorSettings().data_dir,
                "kv_memory_gb": 0.25,
                "quantization": "none",
            },
        ) as backend,
    ):
        loop = backend["loop"]
        predictor = loop.run(
            start_predictor(
                PredictorSettings(data_dir=run_dir, predictor_port=0, predictor_seed=False)
            )
        )
        try:
            settings = GatewaySettings(
                scheduler_address=backend["address"],
                predictor_addresses=[f"127.0.0.1:{predictor.port}"],
                predictor_timeout_ms=2000,
            )
            with running_gateway(settings) as url:
                yield {"url": url, "predictor": predictor, **backend}
        finally:
            loop.run(predictor.stop())


@pytest.fixture
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=180)


def stored(stack) -> int:
    """Points in the store's collections (every temperature regime's)."""
    return sum(stack["predictor"].predictors.count("smollm2-135m-instruct").values())


def test_chat_answers_the_capital_of_france_and_teaches_the_predictor(stack, client):
    before = stored(stack)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    prediction = raw.headers["x-alise-prediction"]
    assert prediction.startswith("length=") and "source=" in prediction
    answer = raw.parse()
    assert "Paris" in answer.choices[0].message.content, answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"  # ended on EOS: a true length
    deadline = time.monotonic() + 30
    while stored(stack) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stored(stack) == before + 1


def test_requests_cut_by_max_tokens_are_observed_as_censored(stack, client):
    """A cut answer only says the length is >= max_tokens: the predictor learns it as such
    (P(runs to the cap) = 1 for that prompt), not as a length of 3."""
    prompt = "Write a long poem about the sea."
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": prompt}],
    )
    rid = key(out.id)
    assert out.choices[0].finish_reason == "length"
    assert wait_until(lambda: observed(stack, rid))
    stack["loop"].run(stack["predictor"].observer.drain())  # learned in the background
    # learnt by the request's regime (greedy: t0, seeded from its bundled greedy file)
    got = stack["predictor"].predictors.predict("smollm2-135m-instruct", [prompt], 0.0)[0]
    assert (got.source.split("@")[0], got.p_capped, got.length) == ("retrieval", 1.0, 3)


def observed(stack, request_id: str) -> bool:
    """Whether the predictor ever received an Observe for this request."""
    return ("smollm2-135m-instruct", request_id) in stack["predictor"].observer.seen


def aborted(stack) -> int:
    from services.common.grpc_client import aio_channel
    from services.common.pb import scheduler_pb2, scheduler_pb2_grpc

    async def ask():
        async with aio_channel(stack["address"]) as channel:
            return await scheduler_pb2_grpc.SchedulerStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=5
            )

    return stack["loop"].run(ask()).aborted


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


def key(response_id: str) -> str:
    """The scheduler's key of a generation: its response id without the prefix."""
    return response_id.split("-", 1)[1]


def test_requests_ended_by_a_stop_string_or_an_abort_are_not_observed(stack, client):
    ids = {}
    ask = dict(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )

    start = aborted(stack)
    cut = client.chat.completions.create(**ask, stop=["Paris"])
    ids["stop"] = key(cut.id)
    assert cut.choices[0].finish_reason == "stop"
    assert "Paris" not in cut.choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stop=["Paris"], stream=True))
    ids["stream"] = key(chunks[0].id)
    assert "Paris" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    # Both were aborted upstream at the match (background calls: wait for them).
    assert wait_until(lambda: aborted(stack) >= start + 2)
    before = aborted(stack)
    body = {
        **ask,
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    }
    with httpx.stream(
        "POST", stack["url"] + "/v1/chat/completions", json=body, timeout=180
    ) as response:
        line = next(line for line in response.iter_lines() if '"content":"' in line)
        ids["abort"] = key(json.loads(line[len("data: ") :])["id"])
    assert wait_until(lambda: aborted(stack) > before), "the dropped stream was not aborted"

    # Control: the same question without a stop string ends on EOS ("Paris" in it) and is
    # observed; by the time it is, the three above would have been too.
    full = client.chat.completions.create(**ask)
    ids["eos"] = key(full.id)
    assert full.choices[0].finish_reason == "stop" and "Paris" in full.choices[0].message.content
    assert wait_until(lambda: observed(stack, ids["eos"]))
    time.sleep(1.0)
    assert [kind for kind in ("stop", "stream", "abort") if observed(stack, ids[kind])] == []


def test_multibyte_answer_streams_valid_text(stack, client):
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        stream=True,
        temperature=0,
        max_tokens=40,
        messages=[{"role": "user", "content": "Repeat exactly: café, naïve, 東京, 😀"}],
    )
    chunks = [c for c in stream if c.choices]
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    text = "".join(pieces)
    # an answer cut by max_tokens inside a character ends with that character's bytes
    whole = text.rstrip("\ufffd") if chunks[-1].choices[0].finish_reason == "length" else text
    assert "\ufffd" not in whole, text
    assert "東京" in text or "😀" in text, text  # 3- and 4-byte characters came through
    assert len([p for p in pieces if p]) > 3


def test_playground_streams_an_answer_in_headless_chromium(stack):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.exists(), "install Debian chromium: apt-get install -y chromium"
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(stack["url"] + "/")
            page.fill("#prompt", "What is the capital of France?")
            page.fill("#max_tokens", "32")
            page.fill("#ttft_ms", "5000")
            page.click("#send")
            page.wait_for_function(
                "document.getElementById('output').textContent.length > 0", timeout=120_000
            )
            page.wait_for_function(
                "document.getElementById('output').dataset.state === 'done'", timeout=120_000
            )
            page.screenshot(path=str(artifacts / "gateway_playground.png"), full_page=True)
            output = page.text_content("#output")
            ttft = page.text_content("#ttft")
            prediction = page.text_content("#prediction")
            error = page.text_content("#error")
        finally:
            browser.close()
    assert not error, error
    assert "Paris" in output, output
    assert ttft.endswith(" ms")
    assert "tokens" in prediction or "length=" in prediction
    assert (artifacts / "gateway_playground.png").stat().st_size > 10_000


def test_health_reports_the_real_model_length(stack):
    body = httpx.get(stack["url"] + "/health", timeout=10).json()
    assert body["scheduler"] is True and body["predictor"] is True
    assert body["max_model_len"] >= 2048


def test_chat_logprobs_streamed_and_not(client):
    """Greedy: the sampled token is the most likely one, so it heads its top_logprobs list;
    the tokens' texts join to the answer; streaming gives the same entries chunk by chunk."""
    ask = dict(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        logprobs=True,
        top_logprobs=3,
    )
    out = client.chat.completions.create(**ask)
    content = out.choices[0].logprobs.content
    eos = out.choices[0].finish_reason == "stop"  # the EOS token has no text and no entry
    assert len(content) == out.usage.completion_tokens - eos
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )
        assert bytes(t.bytes).decode() == t.token
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [
        (t.token, round(t.logprob, 4)) for t in content
    ]
    plain = client.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    only_chosen = client.chat.completions.create(**{**ask, "top_logprobs": 0})
    assert all(t.top_logprobs == [] for t in only_chosen.choices[0].logprobs.content)


def test_completions_logprobs_and_echo(client):
    prompt = "The capital of France is"
    out = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top, key=top.get) == token
        assert top[token] == pytest.approx(value, abs=1e-5)
    echoed = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompt + out.choices[0].text


def test_echo_logprobs_score_the_prompt_as_transformers_does(stack, client):
    """lm-eval's loglikelihood request (token ids, echo, logprobs, max_tokens 1): one entry per
    prompt token, the first null, the rest equal to transformers' log-softmax of the bundled
    model; streamed the same; and the prompt is computed in full although a request with the
    same prompt just filled the prefix cache."""
    from transformers import AutoModelForCausalLM

    from services.common.models import load_tokenizer, weights_dir

    data_dir = PredictorSettings().data_dir
    tok = load_tokenizer("smollm2-135m-instruct", data_dir)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    kw = dict(model="smollm2-135m-instruct", prompt=ids, max_tokens=1, temperature=0)
    client.completions.create(**kw)  # fills the prefix cache with this prompt's blocks
    out = client.completions.create(**kw, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == out.choices[0].text
    model = AutoModelForCausalLM.from_pretrained(
        weights_dir("smollm2-135m-instruct", data_dir), dtype=torch.float32
    )
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1 : len(ids)], want)) < 2e-3
    for top in lp.top_logprobs[1 : len(ids)]:
        assert 1 <= len(top) <= 2
    streamed = client.completions.create(**kw, echo=True, logprobs=2, stream=True)
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def prefix_hits(stack) -> float:
    registry = stack["scheduler"].service.metrics.registry
    return registry.get_sample_value("alise:prefix_cache_hits_total") or 0.0


def test_n_answers_share_the_prefilled_prompt_streamed_and_not(stack, client):
    """n = 3: three choices, the usage counts the prompt once; the siblings start after the
    first answer's first token and find its prompt blocks in the prefix cache."""
    ask = dict(
        model="smollm2-135m-instruct",
        temperature=1.0,
        seed=7,
        max_tokens=8,
        n=3,
        messages=[
            {"role": "system", "content": "You are a poet. " * 8},
            {"role": "user", "content": "Write one line about rain."},
        ],
    )
    before = prefix_hits(stack)
    out = client.chat.completions.create(**ask)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1  # seeds 7, 8, 9 differ
    prompt = httpx.post(stack["url"] + "/tokenize", json={"messages": ask["messages"]}).json()
    assert out.usage.prompt_tokens == prompt["count"]
    assert out.usage.completion_tokens <= 3 * 8 and out.usage.completion_tokens >= 3
    full_blocks = prompt["count"] // 16 * 16
    assert wait_until(lambda: prefix_hits(stack) - before >= 2 * full_blocks)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    texts: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and len({c.id for c in chunks}) == 1
    assert texts == {c.index: c.message.content for c in out.choices}  # same seeds, same text


def test_best_of_keeps_the_most_likely_answers(client):
    ask = dict(
        model="smollm2-135m-instruct",
        prompt="My favourite colour is",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=0,
    )
    one = client.completions.create(**ask, n=1, best_of=4)
    four = client.completions.create(**ask, n=4)
    totals = sorted((sum(c.logprobs.token_logprobs) for c in four.choices), reverse=True)
    assert len(one.choices) == 1
    assert sum(one.choices[0].logprobs.token_logprobs) == pytest.approx(totals[0], abs=1e-3)
    with pytest.raises(Exception) as err:
        client.completions.create(**ask, n=3, best_of=2)
    assert getattr(err.value, "status_code", None) == 400


# Greedy SmolLM2-135M loops inside a JSON string for a few countries (India, Peru) until the
# cap: the grammar holds (the text is a valid JSON prefix) but the answer never closes. These
# twenty end.
COUNTRIES = [
    "France", "Japan", "Brazil", "Kenya", "Canada", "Italy", "Sweden", "Mexico", "Egypt", "Spain",
    "Germany", "Chile", "Norway", "Turkey", "China", "Greece", "Ghana", "Nepal", "Cuba", "Poland",
]  # fmt: skip


def _concurrently(fn, items):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_json_mode_answers_parse_for_20_prompts(client):
    import json as jsonlib

    def ask(country: str):
        return client.chat.completions.create(
            model="smollm2-135m-instruct",
            temperature=0,
            max_tokens=96,
            response_format={"type": "json_object"},
            messages=[
                {
                    "role": "user",
                    "content": f'Return a JSON object with the keys "country" and "capital" '
                    f"for {country}.",
                }
            ],
        )

    for out in _concurrently(ask, COUNTRIES):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(jsonlib.loads(choice.message.content), dict)


def test_json_schema_answers_validate_for_20_prompts(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=40)
        capital: str = Field(max_length=40)
        continent: Literal["Africa", "Asia", "Europe", "North America", "South America"]

    def ask(country: str):
        return client.beta.chat.completions.parse(
            model="smollm2-135m-instruct",
            temperature=0,
            max_tokens=96,
            response_format=Capital,
            messages=[{"role": "user", "content": f"What is the capital of {country}?"}],
        )

    for out in _concurrently(ask, COUNTRIES):
        parsed = out.choices[0].message.parsed
        assert isinstance(parsed, Capital), out.choices[0].message.content
        assert parsed.country and parsed.capital


def test_vllm_guided_choice_regex_and_refusals(client):
    import re

    base = dict(model="smollm2-135m-instruct", temperature=0, max_tokens=16)
    msg = [{"role": "user", "content": "Is the sky blue? Answer."}]
    choice = client.chat.completions.create(
        **base, messages=msg, extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert choice.choices[0].message.content in {"yes", "no", "maybe"}
    regex = client.completions.create(
        **base, prompt="The year is", extra_body={"guided_regex": r" [12][0-9]{3}\."}
    )
    assert re.fullmatch(r" [12][0-9]{3}\.", regex.choices[0].text), regex.choices[0].text
    streamed = client.chat.completions.create(
        **base, messages=msg, stream=True, extra_body={"guided_choice": ["yes", "no"]}
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text in {"yes", "no"}
    for extra, field in (
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ):
        with pytest.raises(Exception) as err:
            client.chat.completions.create(**base, messages=msg, extra_body=extra)
        assert getattr(err.value, "status_code", None) == 400, extra
        assert field in str(err.value)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
        },
    },
}


def test_required_and_named_tool_calls_always_parse(stack, client):
    import json as jsonlib

    def ask(city: str):
        return client.chat.completions.create(
            model="smollm2-135m-instruct",
            temperature=0,
            max_tokens=64,
            tools=[WEATHER, TIME],
            tool_choice="required",
            messages=[{"role": "user", "content": f"What's the weather like in {city}?"}],
        )

    for out in _concurrently(ask, ["Paris", "Tokyo", "Lima", "Oslo", "Cairo"]):
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name in {"get_weather", "get_time"}
        args = jsonlib.loads(call.function.arguments)
        assert set(args) == ({"city"} if call.function.name == "get_weather" else {"zone"})
    named = client.chat.completions.create(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=64,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in named:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and calls[0]["name"] == "get_time"
    assert jsonlib.loads(calls[0]["arguments"])["zone"] in {"UTC", "CET", "JST"}


def test_tool_round_trip_renders_calls_and_results(stack, client):
    """The assistant's call and the tool's result go back into the prompt; the answer is
    text again (tool_choice none)."""
    history = [
        {"role": "user", "content": "What's the weather like in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "temp_c": 24}'},
    ]
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=32,
        tools=[WEATHER],
        tool_choice="none",
        messages=history,
    )
    assert out.choices[0].finish_reason in {"stop", "length"}
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    rendered = httpx.post(stack["url"] + "/tokenize", json={"messages": history}).json()
    text = httpx.post(stack["url"] + "/detokenize", json={"tokens": rendered["tokens"]}).json()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text["prompt"]
    assert '<tool_response>\n{"sky": "sunny", "temp_c": 24}\n</tool_response>' in text["prompt"]
    # a call whose arguments are not JSON (a model can write that; clients echo it back) is
    # rendered as sent, not refused with a 500
    broken = [dict(history[1], tool_calls=[dict(history[1]["tool_calls"][0])])]
    broken[0]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": '{"city": "Par'}
    rendered = httpx.post(stack["url"] + "/tokenize", json={"messages": history[:1] + broken})
    assert rendered.status_code == 200, rendered.text
    text = httpx.post(stack["url"] + "/detokenize", json={"tokens": rendered.json()["tokens"]})
    assert '"arguments": "{\\"city\\": \\"Par"}' in text.json()["prompt"]
    for bad, field in (
        ({"tools": [{"type": "function"}]}, "tools.0"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ):
        with pytest.raises(Exception) as err:
            client.chat.completions.create(
                model="smollm2-135m-instruct", max_tokens=4, messages=history[:1], **bad
            )
        assert getattr(err.value, "status_code", None) == 400 and err.value.param == field


def test_bad_words_keep_a_word_out_of_the_answer(client):
    ask = dict(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    plain = client.chat.completions.create(**ask).choices[0].message.content
    assert "Paris" in plain
    banned = client.chat.completions.create(**ask, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].message.content


def test_a_batch_of_prompts_gets_choices_prompt_by_prompt(stack, client):
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [
        client.completions.create(
            model="smollm2-135m-instruct", prompt=p, max_tokens=5, temperature=0
        )
        for p in prompts
    ]
    batch = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompts, max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in batch.choices]
    assert texts == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = [[1, 2, 3], [4, 5, 6, 7]]
    tokens = client.completions.create(
        model="smollm2-135m-instruct", prompt=ids, max_tokens=2, temperature=0
    )
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 7


def test_langchain_structured_output_tools_and_batch(stack):
    """langchain-openai as users write it: with_structured_output on a pydantic model,
    bind_tools with a tool call round trip, and .batch() on the completions model."""
    from typing import Literal

    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAI
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=40)
        capital: str = Field(max_length=40)
        continent: Literal["Africa", "Asia", "Europe", "North America", "South America"]

    base = stack["url"] + "/v1"
    chat = ChatOpenAI(
        base_url=base, api_key="none", model="smollm2-135m-instruct", temperature=0, max_tokens=64
    )
    answer = chat.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital) and answer.capital

    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    question = HumanMessage("What's the weather like in Paris?")
    called = chat.bind_tools([get_weather], tool_choice="required").invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    result = ToolMessage(content=get_weather(**call["args"]), tool_call_id=call["id"])
    final = chat.bind_tools([get_weather], tool_choice="none").invoke([question, called, result])
    assert isinstance(final.content, str) and final.content and not final.tool_calls

    completions = OpenAI(
        base_url=base, api_key="none", model="smollm2-135m-instruct", temperature=0, max_tokens=5
    )
    outs = completions.batch(["The capital of France is", "One, two, three,"])
    assert len(outs) == 2 and all(isinstance(o, str) and o for o in outs)


def test_litellm_completion_with_api_base(stack, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    out = litellm.completion(
        model="openai/smollm2-135m-instruct",
        api_base=stack["url"] + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in out.choices[0].message.content


def test_responses_api_answers_as_the_chat_path(client):
    """The real model through `/v1/responses`: the chat path's greedy answer, streamed and
    not, with the same usage."""
    question = "What is the capital of France?"
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=48,
        messages=[{"role": "user", "content": question}],
    )
    resp = client.responses.create(
        model="smollm2-135m-instruct", input=question, temperature=0, max_output_tokens=48
    )
    assert "Paris" in resp.output_text, resp.output_text
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == "completed"  # ended on EOS, as the chat answer did
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(
        model="smollm2-135m-instruct", input=question, temperature=0, max_output_tokens=48
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == resp.output_text
