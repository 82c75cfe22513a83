"""Per-key limits and protected routes of a real gateway: a key over its concurrent-request
limit or its request rate gets 429 with Retry-After while another key goes on; /metrics and
every other route but the probes, /version and the playground page need a key when keys are
set."""

from __future__ import annotations

import time

import httpx
import pytest

from lab.gateway.testing import inprocess_backend, running_gateway
from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings

A, B = "sk-key-a", "sk-key-b"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A real scheduler with no executor (streams stay open in its queue) behind a gateway
    whose keys may hold one request each."""
    from lab.executor.tiny import make_tiny_model
    from services.common.redis_runner import EmbeddedRedis

    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    run = tmp_path_factory.mktemp("limits")
    with EmbeddedRedis(run / "redis") as redis, inprocess_backend(run, None, redis.url) as be:
        settings = GatewaySettings(
            model=str(model),
            scheduler_address=be["address"],
            predictor_addresses=[f"127.0.0.1:{free_port()}"],
            api_keys=[A, B],
            key_max_concurrent=1,
        )
        with running_gateway(settings) as url:
            yield {"url": url}


def test_a_key_over_its_concurrent_streams_gets_429_and_others_go_on(stack):
    url = stack["url"]
    model = httpx.get(url + "/v1/models", headers=_auth(A), timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=_auth(A), timeout=30
    ) as held:
        assert held.status_code == 200  # admitted: it waits in the queue, open
        second = httpx.post(url + "/v1/completions", json=body, headers=_auth(A), timeout=30)
        assert second.status_code == 429, second.text
        assert int(second.headers["Retry-After"]) >= 1
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(url + "/v1/models", headers=_auth(B), timeout=10).status_code == 200
    deadline = time.monotonic() + 20  # the closed stream is released once its request ends
    while httpx.get(url + "/v1/models", headers=_auth(A), timeout=10).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_metrics_need_a_key_and_health_does_not(stack):
    url = stack["url"]
    assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(url + "/metrics", headers=_auth(B), timeout=10).status_code == 200
    assert httpx.get(url + "/health/live", timeout=10).status_code == 200
    ready = httpx.get(url + "/health/ready", timeout=10)  # a leader, Redis, but no executor
    assert ready.status_code == 503 and ready.json()["reason"] == "no executor is reachable"


OPEN = {"/health", "/health/live", "/health/ready", "/version", "/"}  # probes, static page


def test_with_keys_set_every_route_but_health_and_static_pages_needs_one(stack):
    """Every route the gateway documents (its OpenAPI schema, plus /metrics), called without a
    key: 401, except the probes, /version and the playground page (static HTML that asks
    for a key)."""
    url = stack["url"]
    schema = httpx.get(url + "/openapi.json", timeout=10).json()
    routes = [(m.upper(), path) for path, ops in schema["paths"].items() for m in ops]
    routes.append(("GET", "/metrics"))
    assert {("POST", "/v1/chat/completions"), ("POST", "/tokenize")} <= set(routes)
    for method, path in routes:
        concrete = path.replace("{response_id}", "resp_x").replace("{", "").replace("}", "")
        reply = httpx.request(method, url + concrete, json={}, timeout=10)
        if path in OPEN:
            assert reply.status_code != 401, (method, path)
        else:
            assert reply.status_code == 401, (method, path, reply.status_code)


def test_a_key_over_its_request_rate_gets_429_with_retry_after():
    settings = GatewaySettings(
        scheduler_address=f"127.0.0.1:{free_port()}",
        predictor_addresses=[f"127.0.0.1:{free_port()}"],
        api_keys=[A, B],
        key_rate_per_s=0.2,  # one per 5 s after a burst of 2
        key_burst=2,
    )
    with running_gateway(settings) as url:
        codes = [httpx.get(url + "/v1/models", headers=_auth(A)).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        refused = httpx.get(url + "/v1/models", headers=_auth(A))
        assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 5
        assert httpx.get(url + "/v1/models", headers=_auth(B)).status_code == 200
        wrong = httpx.get(url + "/v1/models", headers=_auth("sk-wrong"))
        assert wrong.status_code == 401  # not counted, not limited: refused
