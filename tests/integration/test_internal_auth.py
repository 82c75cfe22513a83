"""The internal plane refuses strangers: with ALISE_INTERNAL_TOKEN set, the real executor
and scheduler (and any server `start_server` builds, the predictor's included) answer a
call without the token, or with a wrong one, UNAUTHENTICATED; health stays open for probes;
channels made by grpc_client carry the token, so the stack itself works (a generation
goes through the gateway -> scheduler -> executor, all authenticated)."""

from __future__ import annotations

import grpc
import httpx
import pytest

from lab.gateway.testing import inprocess_stack
from services.common.internal_auth import METADATA_KEY, TOKEN_ENV
from services.common.pb import executor_pb2, executor_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    mp = pytest.MonkeyPatch()
    mp.setenv(TOKEN_ENV, TOKEN)
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    try:
        with inprocess_stack(tmp_path_factory.mktemp("auth"), model) as st:
            yield st
    finally:
        mp.undo()


def _calls(stack) -> list:
    """One unary call per internal service, on a plain channel (no token added)."""
    executor = f"127.0.0.1:{stack['executor'].port}"
    return [
        (
            executor,
            lambda ch: executor_pb2_grpc.ExecutorStub(ch).Describe(
                executor_pb2.DescribeRequest(), timeout=5
            ),
        ),
        (
            stack["address"],
            lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Stats(
                scheduler_pb2.StatsRequest(), timeout=5
            ),
        ),
    ]


@pytest.mark.parametrize("metadata", [None, ((METADATA_KEY, "wrong"),)])
def test_calls_without_the_token_are_refused(stack, metadata):
    for address, call in _calls(stack):
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                call(_with_metadata(channel, metadata))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, address


def test_health_stays_open_and_the_token_opens_the_rest(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for address, call in _calls(stack):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert call(_with_metadata(channel, ((METADATA_KEY, TOKEN),))) is not None


def test_a_generation_goes_through_the_authenticated_plane(stack):
    model = httpx.get(stack["url"] + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    reply = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def _with_metadata(channel: grpc.Channel, metadata) -> grpc.Channel:
    if metadata is None:
        return channel
    from services.common.internal_auth import CallDetails

    class Add(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, d, request):
            details = CallDetails(d.method, d.timeout, list(metadata), None, None, None)
            return continuation(details, request)

    return grpc.intercept_channel(channel, Add())
