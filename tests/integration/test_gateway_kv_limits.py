"""A prompt that fits the model's length but no executor's KV pool is refused at once (400
naming the limit) instead of waiting and failing; `/v1/models` shows both limits."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from lab.gateway.testing import inprocess_stack
from lab.scheduler.testing import gen_request
from services.common.grpc_client import sync_channel
from services.common.pb import scheduler_pb2_grpc

KV_GB = 0.0005  # a pool far smaller than the model's context


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    with inprocess_stack(
        tmp_path_factory.mktemp("kv-limits"), model, executor_kw={"kv_memory_gb": KV_GB}
    ) as s:
        yield s


def card(url: str) -> dict:
    for _ in range(100):  # the gateway learns the limits from the scheduler's Stats
        data = httpx.get(f"{url}/v1/models").json()["data"][0]
        if data.get("max_kv_tokens"):
            return data
        time.sleep(0.1)
    raise AssertionError("max_kv_tokens never reported")


def test_models_show_the_kv_limit_and_prompts_over_it_are_400_at_once(stack):
    info = card(stack["url"])
    kv = info["max_kv_tokens"]
    executor = stack["executor"].engine
    assert kv == executor.num_device_blocks * executor.block_size
    assert info["max_model_len"] == kv < executor.max_model_len  # the pool binds here
    words = " ".join(["token"] * (kv + 20))
    started = time.monotonic()
    reply = httpx.post(
        f"{stack['url']}/v1/completions", json={"prompt": words, "max_tokens": 4}, timeout=30
    )
    assert time.monotonic() - started < 5  # refused, not queued
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"{kv} tokens" in error["message"] and "KV pool" in error["message"]
    short = httpx.post(
        f"{stack['url']}/v1/completions",
        json={"prompt": "token token", "max_tokens": kv},  # prompt + max_tokens over the pool
        timeout=30,
    )
    assert short.status_code == 400 and "max_tokens" in short.json()["error"]["message"]


def test_the_scheduler_itself_refuses_what_no_pool_can_hold(stack):
    kv = card(stack["url"])["max_kv_tokens"]
    with sync_channel(stack["address"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for prompt_len, max_tokens in ((kv + 1, 1), (10, kv)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(gen_request("kv", [5] * prompt_len, max_tokens), timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"KV pool holds {kv} tokens" in err.value.details()
