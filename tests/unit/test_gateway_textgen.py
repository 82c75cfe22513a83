"""Incremental detokenization (UTF-8 safety) and stop strings across token boundaries."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.textgen import IncrementalDetokenizer, StopMatcher


@pytest.fixture(scope="module")
def tokenizer():
    from services.common.models import load_tokenizer
    from services.common.settings import GatewaySettings

    s = GatewaySettings()
    return load_tokenizer(s.model, s.data_dir)


def stream(tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "日本語のテキスト 😀👍🏽",
        "plain ascii text.",
        "  leading spaces\nand\ttabs",
        "Ελληνικά — ∑ ≠ ∞",
    ],
)
def test_multibyte_text_streams_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(tokenizer, ids, tokenizer.encode("Say:", add_special_tokens=False))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Some emoji/CJK split over several byte tokens: at least one token emits nothing.
    if any(ord(c) > 0x2FFF for c in text):
        assert "" in pieces[:-1]


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Paris", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "Paris"


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == expected


def feed(matcher, chunks):
    out, matched = [], False
    for chunk in chunks:
        text, matched = matcher.push(chunk)
        out.append(text)
        if matched:
            break
    if not matched:
        out.append(matcher.flush())
    return "".join(out), matched


def test_stop_across_boundaries():
    text, matched = feed(StopMatcher(["END"]), ["hello E", "N", "D world"])
    assert (text, matched) == ("hello ", True)


def test_partial_stop_prefix_is_released_when_it_diverges():
    m = StopMatcher(["STOP"])
    assert m.push("a ST") == ("a ", False)
    assert m.push("ART") == ("START", False)


def test_earliest_of_several_stops_wins():
    text, matched = feed(StopMatcher(["world", "lo"]), ["hel", "lo world"])
    assert (text, matched) == ("hel", True)


def test_no_stop_passes_everything_through():
    text, matched = feed(StopMatcher([]), ["a", "b"])
    assert (text, matched) == ("ab", False)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stop=st.text(alphabet="abc\n", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matches_like_str_find(text, stop, cuts):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, matched = feed(StopMatcher([stop]), chunks)
    index = text.find(stop)
    assert matched == (index >= 0)
    assert out == (text[:index] if index >= 0 else text)


def test_stop_matcher_can_keep_the_stop_string():
    from services.gateway.textgen import StopMatcher

    kept = StopMatcher(["END"], include_stop=True)
    assert kept.push("abc EN") == ("abc ", False)  # "EN" may start the stop: held back
    assert kept.push("D tail") == ("END", True)  # the stop string itself, nothing after it
    assert StopMatcher(["END"]).push("xyENDz") == ("xy", True)
    assert StopMatcher(["END"], include_stop=True).push("xyENDz") == ("xyEND", True)
    # the earliest match wins, whichever stop it is
    assert StopMatcher(["b", "abc"], include_stop=True).push("xabcb") == ("xabc", True)


def test_tool_calls_are_parsed_out_of_auto_and_forced_answers():
    import json

    from services.gateway.tools import parse

    auto = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse(auto, "auto")
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    two = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    assert [c["function"]["name"] for c in parse(two, "auto")[1]] == ["f", "g"]
    assert parse("<tool_call>not json</tool_call>", "auto") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    assert parse("plain answer", "auto") == ("plain answer", [])
    content, calls = parse('{"name": "f", "arguments": {"x": "y"}}', "forced")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": "y"}
    assert parse('{"name": "f", "argu', "forced") == ('{"name": "f", "argu', [])  # cut


def test_llama3_json_tool_calls_and_the_parser_chosen_per_model_family():
    import json
    import typing

    import pytest

    from services.common.settings import GatewaySettings
    from services.gateway.tools import PARSERS, parse, parser_for

    one = '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}'
    content, calls = parse(one, "auto", "llama3_json")
    assert content is None and calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    two = '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}'
    assert [c["function"]["name"] for c in parse(two, "auto", "llama3_json")[1]] == ["f", "g"]
    for text in ("The weather is fine.", '{"name": "f"} and then words', '{"city": "Paris"}'):
        assert parse(text, "auto", "llama3_json") == (text, [])
    hermes = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse(hermes, "auto", "llama3_json") == (hermes, [])  # not this family's format
    assert parser_for("{{ '<|python_tag|>' }}{% if tools %}...") == "llama3_json"
    assert parser_for("{% for message in messages %}<|im_start|>") == "hermes"
    assert parser_for(None) == "hermes" and parser_for(None, "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="tool parser"):
        parser_for(None, "mistral")
    setting = GatewaySettings.model_fields["tool_parser"].annotation
    assert set(typing.get_args(setting)) == {"auto", *PARSERS}


def test_completion_prompts_get_the_tokenizers_bos_and_chat_prompts_do_not(tmp_path):
    """A tokenizer that adds BOS (Llama-style) gets it on a raw completion prompt, as
    transformers adds it; the rendered chat text is encoded as is."""
    import asyncio

    from transformers import AutoTokenizer

    from services.common.models import tokenizer_dir
    from services.common.settings import GatewaySettings
    from services.gateway.prompts import PromptBuilder
    from services.gateway.schemas import CompletionRequest

    settings = GatewaySettings()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(settings.model, settings.data_dir))
    tok.add_bos_token = True
    tok.bos_token = "<|endoftext|>"
    tok.update_post_processor()
    assert tok("Hi")["input_ids"][0] == tok.bos_token_id
    builder = PromptBuilder(tok, "m", lambda: 2048)
    (plan,) = asyncio.run(builder.completion(CompletionRequest(prompt="Hi"), {}, "r1"))
    assert plan.prompt_ids[0] == tok.bos_token_id and len(plan.prompt_ids) == 2
    assert builder._encode("Hi") == tok("Hi", add_special_tokens=False)["input_ids"]
