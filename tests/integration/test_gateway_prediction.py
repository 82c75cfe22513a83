"""The gateway's predictor side over loopback, with a real scheduler and executor (tiny
random-weight model): a predictor that never answers or is not there costs at most the
predictor timeout and the request goes on without a prediction; several predictor addresses
(host names) are used round-robin by real predictor services.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from lab.gateway.testing import inprocess_backend, running_gateway
from services.common.redis_runner import EmbeddedRedis, free_port
from services.common.settings import GatewaySettings

PREDICTOR_TIMEOUT_MS = 300.0
BODY = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def backend(tiny_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gw-prediction")
    with (
        EmbeddedRedis(run_dir / "redis") as redis,
        inprocess_backend(run_dir, tiny_model, redis.url) as backend,
    ):
        yield backend


@contextmanager
def gateway(
    tiny_model, backend, predictor_addresses: list[str], timeout_ms: float = PREDICTOR_TIMEOUT_MS
) -> Iterator[str]:
    settings = GatewaySettings(
        model=str(tiny_model),
        scheduler_address=backend["address"],
        predictor_addresses=predictor_addresses,
        predictor_timeout_ms=timeout_ms,
    )
    with running_gateway(settings) as url:
        yield url


@contextmanager
def silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A loopback TCP port that accepts connections and never sends a byte (a hung server).
    Yields (port, the connections accepted so far)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


def timed_completion(url: str, stream: bool = False, **more) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    body = {**BODY, "stream": stream, **more}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    return response, time.monotonic() - started


def test_predictor_that_never_answers_costs_at_most_its_timeout(tiny_model, backend):
    timeout_s = PREDICTOR_TIMEOUT_MS / 1000
    with gateway(tiny_model, backend, [f"127.0.0.1:{free_port()}"]) as url:  # closed port
        timed_completion(url)  # warm-up: tokenizer, channels, the executor's first step
        closed = [timed_completion(url) for _ in range(3)]
    for response, _ in closed:
        assert response.status_code == 200, response.text
        assert response.headers["x-alise-prediction"] == "none"
        assert response.json()["usage"]["completion_tokens"] == 4
    normal_s = sorted(s for _, s in closed)[1]
    # A refused connection fails at once, well inside the predictor timeout.
    assert normal_s < timeout_s + 1.0, closed

    with (
        silent_server() as (port, accepted),
        gateway(tiny_model, backend, [f"127.0.0.1:{port}"]) as url,
    ):
        silent = [timed_completion(url), timed_completion(url, stream=True)]
        assert accepted, "the gateway never connected to the predictor"
    for response, seconds in silent:
        assert response.status_code == 200, response.text
        assert response.headers["x-alise-prediction"] == "none"
        # It waited for the predictor (the timeout), then went on as a normal request.
        assert timeout_s * 0.9 <= seconds < timeout_s + normal_s + 1.5, (seconds, normal_s)
    assert silent[0][0].json()["usage"]["completion_tokens"] == 4
    assert silent[1][0].text.rstrip().endswith("data: [DONE]")


def predictions_served(handle) -> float:
    return sum(
        sample.value
        for family in handle.metrics.predictions.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


@pytest.fixture(scope="module")
def embedder():
    from services.predictor.embedder import Embedder

    return Embedder()  # one loaded model shared by every predictor replica here


def start_predictor_on(backend, embedder, model_dir, data_dir, port: int = 0):
    from services.common.models import served_model_id
    from services.common.settings import PredictorSettings
    from services.predictor.server import start_predictor

    settings = PredictorSettings(
        data_dir=data_dir,
        predictor_port=port,
        predictor_seed=False,
        predictor_models=[served_model_id(str(model_dir))],
    )
    return backend["loop"].run(start_predictor(settings, embedder=embedder))


def test_two_predictor_host_names_are_used_round_robin(tiny_model, backend, embedder, tmp_path):
    handles = []
    try:
        for name in ("p1", "p2"):
            handles.append(start_predictor_on(backend, embedder, tiny_model, tmp_path / name))
        addresses = [f"localhost:{h.port}" for h in handles]
        # A generous timeout: a CPU embedding on a busy host can take longer than 300 ms.
        with gateway(tiny_model, backend, addresses, timeout_ms=10_000) as url:
            responses = [timed_completion(url)[0] for _ in range(8)]
            greedy = timed_completion(url, temperature=0.0)[0]
            health = httpx.get(url + "/health", timeout=10).json()
    finally:
        for handle in handles:
            backend["loop"].run(handle.stop())
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.headers["x-alise-prediction"].startswith("length=")
        assert "@" not in response.headers["x-alise-prediction"]  # temperature 1: regime t1
    # temperature 0 reaches the predictor, which has no t0 file for this model: t1 answers
    assert greedy.headers["x-alise-prediction"].endswith("@t1"), greedy.headers
    served = [predictions_served(h) for h in handles]
    assert sum(served) == 9
    assert min(served) >= 2, served  # round-robin: both replicas answered
    assert health["predictor"] is True


def test_predictions_resume_when_the_predictor_comes_up(tiny_model, backend, embedder, tmp_path):
    port = free_port()
    with gateway(tiny_model, backend, [f"127.0.0.1:{port}"], timeout_ms=10_000) as url:
        for _ in range(3):  # down: no prediction (and no waiting for one)
            response, _ = timed_completion(url)
            assert response.status_code == 200
            assert response.headers["x-alise-prediction"] == "none"
        handle = start_predictor_on(backend, embedder, tiny_model, tmp_path / "p", port)
        try:
            deadline = time.monotonic() + 30
            header = "none"
            while header == "none" and time.monotonic() < deadline:
                time.sleep(0.25)
                header = timed_completion(url)[0].headers["x-alise-prediction"]
        finally:
            backend["loop"].run(handle.stop())
    assert header.startswith("length="), "predictions did not resume within 30 s"
    assert predictions_served(handle) >= 1


async def test_unreachable_predictors_cost_no_retry_backoff():
    from services.gateway.upstream import Upstream

    upstream = Upstream(
        GatewaySettings(
            scheduler_address=f"127.0.0.1:{free_port()}",
            predictor_addresses=[f"127.0.0.1:{free_port()}", f"localhost:{free_port()}"],
        )
    )
    try:
        assert await upstream.predict("m", "hello") is None  # learns both are refused
        for _ in range(5):
            started = time.monotonic()
            assert await upstream.predict("m", "hello") is None
            # Calling anyway would cost the retries' backoff, about 150 ms.
            assert time.monotonic() - started < 0.05
            await asyncio.sleep(0.3)  # spans gRPC's first reconnect attempts (1 s backoff)
    finally:
        await upstream.close()
