"""Error statuses, auth, request ids, CORS and limits of a real gateway (uvicorn on loopback)
whose scheduler and predictor are down: the real gRPC channels fail as they would in production.
"""

from __future__ import annotations

import time

import httpx
import pytest

from lab.gateway.testing import running_gateway
from services.common.redis_runner import free_port
from services.common.settings import GatewaySettings

KEY = "sk-test-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    settings = GatewaySettings(
        scheduler_address=f"127.0.0.1:{free_port()}",
        predictor_addresses=[f"127.0.0.1:{free_port()}"],
        api_keys=[KEY, "second-key"],
        cors_origins=["https://app.example"],
        max_body_bytes=64 * 1024,
        admission_hold_s=0.5,  # a request no scheduler admits is held this long, then 503
    )
    with running_gateway(settings) as base:
        yield base


@pytest.fixture
def client(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param
    return body["error"]


def test_health_is_503_while_the_scheduler_is_down(client):
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["scheduler"] is False and response.json()["predictor"] is False


def test_live_is_200_and_ready_is_503_with_the_reason_while_the_scheduler_is_down(client):
    assert client.get("/health/live").status_code == 200
    response = client.get("/health/ready")
    assert response.status_code == 503
    assert response.json()["reason"].startswith("no scheduler leads")


def test_generate_is_503_while_the_scheduler_is_down(client):
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=CHAT)
    error = assert_error(response, 503)
    assert time.monotonic() - started >= 0.5  # held for admission_hold_s first
    assert error["code"] == "scheduler_unavailable" and "within 0.5s" in error["message"]
    assert response.headers["Retry-After"] == "2"
    error = assert_error(client.post("/v1/completions", json={"prompt": "x", "stream": True}), 503)


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smollm2-135m-instruct"]
    assert data[0]["max_model_len"] > 0


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": ""},
    ],
)
def test_missing_or_wrong_key_is_401(url, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        response = httpx.request(method, url + path, headers=headers, json=CHAT)
        assert assert_error(response, 401)["code"] == "invalid_api_key"


def test_second_key_works_and_health_needs_none(url):
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer second-key"}).is_success
    assert httpx.get(url + "/health").status_code == 503  # not 401


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "slo": {"ttft_ms": -5}}, "slo.ttft_ms"),
        ({"messages": [{"role": "user", "content": "x"}], "slo": {"tbt": 5}}, "slo.tbt"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools.0",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "sometimes"}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}},
            "logit_bias",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}},
            "logit_bias.5",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
            "presence_penalty",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, "min_p"),
        (
            {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0},
            "repetition_penalty",
        ),
    ],
)
def test_invalid_chat_parameters_are_400(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt.1"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": [1, 99_999_999]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_parameters_are_400(client, body, param):
    assert_error(client.post("/v1/completions", json=body), 400, param)


def test_malformed_json_and_bad_headers_are_400(client):
    response = client.post(
        "/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert "invalid JSON" in assert_error(response, 400)["message"]
    for header in ("X-SLO-TTFT-MS", "X-SLO-TBT-MS", "X-SLO-Deadline-MS", "X-Priority"):
        response = client.post("/v1/completions", json={"prompt": "x"}, headers={header: "soon"})
        assert_error(response, 400, header.lower())
    response = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-SLO-TBT-MS": "-1"})
    assert_error(response, 400, "slo")


def test_unknown_model_is_404(client):
    error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found"


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.delete("/v1/models"), 405)


def test_prompt_over_the_model_length_is_400_context_length_exceeded(client):
    max_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    words = " ".join(["token"] * (max_len + 10))  # one token per word, well over the limit
    error = assert_error(client.post("/v1/completions", json={"prompt": words[:60_000]}), 400)
    assert error["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413_declared_or_chunked(client):
    big = {"prompt": "x" * 70_000}
    assert assert_error(client.post("/v1/completions", json=big), 413)["code"] == "body_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"y" * 1000
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert assert_error(response, 413)["code"] == "body_too_large"


def test_request_ids_are_echoed_or_made(client):
    assert (
        client.get("/v1/models", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"]
        == "abc-123"
    )
    made = client.get("/v1/models", headers={"X-Request-Id": "bad id!"}).headers["x-request-id"]
    assert made != "bad id!" and len(made) == 32
    a, b = (client.post("/v1/completions", json={}).headers["x-request-id"] for _ in range(2))
    assert a != b


def test_cors_preflight_allows_the_configured_origin_only(url):
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(
        url + "/v1/chat/completions", headers={**ask, "Origin": "https://app.example"}
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    denied = httpx.options(
        url + "/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in denied.headers


def test_metrics_count_requests_by_status(client):
    client.post("/v1/chat/completions", json={**CHAT, "n": 0})
    text = client.get("/metrics").text
    assert 'alise:gateway_requests_total{route="/v1/chat/completions",status="400"}' in text


ORIGIN = {"Origin": "https://app.example"}


def test_every_error_response_carries_cors_headers(url):
    """A browser app can read every error: 400, 401, 404, 413 and 503 all carry CORS
    headers for the configured origin (the body limit's 413 included)."""
    auth = {"Authorization": f"Bearer {KEY}", **ORIGIN}
    cases = [
        (400, httpx.post(url + "/v1/chat/completions", headers=auth, json={**CHAT, "n": 0})),
        (400, httpx.post(url + "/v1/completions", headers=auth, content=b"{not json")),
        (401, httpx.post(url + "/v1/chat/completions", headers=ORIGIN, json=CHAT)),
        (404, httpx.post(url + "/v1/chat/completions", headers=auth, json={**CHAT, "model": "x"})),
        (404, httpx.get(url + "/v1/nothing-here", headers=auth)),
        (413, httpx.post(url + "/v1/completions", headers=auth, content=b"x" * (65 * 1024))),
        (503, httpx.post(url + "/v1/chat/completions", headers=auth, json=CHAT)),
    ]
    for status, response in cases:
        assert_error(response, status)
        assert response.headers.get("access-control-allow-origin") == ORIGIN["Origin"], status
        assert "x-request-id" in response.headers


def test_unexpected_errors_are_openai_500s_with_cors_headers():
    """An exception no handler takes becomes a JSON 500 inside the CORS layer."""
    from fastapi.testclient import TestClient

    from services.gateway.app import create_app

    app = create_app(GatewaySettings(cors_origins=["https://app.example"]))

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("kaboom")

    client = TestClient(app, raise_server_exceptions=False)  # no `with`: no lifespan, no model
    response = client.get("/v1/boom", headers=ORIGIN)
    error = assert_error(response, 500)
    assert error["code"] == "internal_error" and "RuntimeError" in error["message"]
    assert response.headers["access-control-allow-origin"] == ORIGIN["Origin"]


def _get_on(sock, path: str) -> bytes:
    """One HTTP/1.1 GET on an open socket; returns the status line (reads the whole reply)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
                 .split(b":")[1])  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_idle_connections_outlive_the_clients_own_expiry_then_close():
    """A server that closes an idle keep-alive connection first races the client's next request
    on it (the client sees a reset: seen once in 7,113 soak requests with uvicorn's 5 s against
    httpx's 5 s). The gateway keeps them open longer than clients do, and does close them."""
    import socket

    from services.gateway.cli import server_config

    assert GatewaySettings().keep_alive_s > httpx.Limits().keepalive_expiry
    settings = GatewaySettings(
        scheduler_address=f"127.0.0.1:{free_port()}",
        predictor_addresses=[f"127.0.0.1:{free_port()}"],
        keep_alive_s=2,
    )
    assert server_config(None, settings).timeout_keep_alive == 2  # what `alise serve` runs
    with running_gateway(settings) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            assert _get_on(sock, "/health/live").endswith(b"200 OK")
            time.sleep(0.5)
            assert _get_on(sock, "/health/live").endswith(b"200 OK")  # the same connection
            idle_from = time.monotonic()
            assert sock.recv(1) == b""  # closed by the server ...
            assert time.monotonic() - idle_from >= 1.5  # ... after its keep-alive, not before
