"""The CPU compose stack in containers (`make test-containers`: podman-compose on locally built
images; outside `make test`, which skips it): every health check turns healthy, an answer
streams through the gateway container, two predictor replicas share the predictions, a killed
scheduler container is ridden through by its standby, and `down`/`up` keeps Redis's data (each
predictor replica's embedded store lives in its container's own volume, so it is not kept)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "alise-ct"
URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.skipif(
    os.environ.get("ALISE_TEST_CONTAINERS") != "1",
    reason="container test: run `make test-containers` (needs podman, podman-compose, images)",
)


def compose(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    tool = os.environ.get("PODMAN_COMPOSE") or shutil.which("podman-compose") or "podman-compose"
    return subprocess.run(
        [tool, "-p", PROJECT, "-f", str(ROOT / "docker-compose.cpu.yml"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        cwd=ROOT,
    )


def down(*flags: str) -> None:
    """`down`, then remove what podman-compose 1.6 leaves of a scaled service (its extra
    replicas keep running)."""
    compose("down", *flags, timeout=300)
    left = podman("ps", "-aq", "--filter", f"label=io.podman.compose.project={PROJECT}").split()
    if left:
        podman("rm", "-f", *left)


def podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def wait_healthy(timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{URL}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    raise AssertionError("the gateway container never became healthy")


def chat(content: str, max_tokens: int = 48) -> tuple[str, str | None]:
    body = {
        "model": "smollm2-135m-instruct",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    text, finish = [], None
    with httpx.stream("POST", f"{URL}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def container(service: str, index: int = 1) -> str:
    return f"{PROJECT}_{service}_{index}"


@pytest.fixture(scope="module")
def stack():
    down("-v")
    compose("up", "-d", "--scale", "predictor=2")
    try:
        wait_healthy()
        yield
    finally:
        down("-v")


def test_healthy_and_streams_an_answer(stack):
    names = podman(
        "ps", "--filter", f"label=io.podman.compose.project={PROJECT}", "--format", "{{.Names}}"
    ).split()
    assert len(names) == 7, names  # redis, 2 predictors, executor, 2 schedulers, gateway
    # Podman runs health checks from systemd timers, absent in this container: run each now.
    for name in names:
        deadline = time.monotonic() + 300  # the executor may still be loading the model
        while True:
            check = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True)
            if check.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert check.returncode == 0, (name, check.stdout, check.stderr)
    text, finish = chat("What is the capital of France?")
    assert text.strip() and finish in ("stop", "length")


def test_both_predictor_replicas_answer(stack):
    for i in range(8):
        chat(f"Tell me one fact about the number {i}.", max_tokens=4)
    counts = [predictions(container("predictor", index)) for index in (1, 2)]
    assert all(counts), f"predictions per replica: {counts}"


def predictions(name: str) -> float:
    """The replica's prediction counter, read from its Prometheus endpoint."""
    out = podman("exec", name, "python3", "-c", METRICS_READ)
    return float(out.strip() or 0)


METRICS_READ = (
    "import httpx\n"
    "text = httpx.get('http://127.0.0.1:9100/metrics').text\n"
    "print(sum(float(l.split()[-1]) for l in text.splitlines()"
    " if l.startswith('alise:predictor_predictions_total')))"
)


def leader() -> str:
    """The scheduler container that leads: the one whose `alise.v1.Scheduler` is SERVING."""
    for name in ("scheduler", "scheduler-1"):
        out = podman("exec", container(name), "python3", "-c", LEADER_CHECK)
        if out.strip() == "True":
            return name
    raise AssertionError("no scheduler leads")


LEADER_CHECK = (
    "from services.common.grpc_client import check_health_sync as c\n"
    "print(c('127.0.0.1:50051', 'alise.v1.Scheduler'))"
)


def test_a_killed_scheduler_container_is_ridden_through(stack):
    reference, _ = chat("Describe a quiet morning in a small town.", max_tokens=96)
    result: dict[str, object] = {}

    def run() -> None:
        result["answer"] = chat("Describe a quiet morning in a small town.", max_tokens=96)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(2.0)
    podman("kill", container(leader()))
    thread.join(180)
    assert result["answer"] == (reference, "length")


def test_down_and_up_keep_redis_data(stack):
    before = podman(
        "exec",
        container("redis"),
        "python3",
        "-c",
        "import redis; print(int(redis.Redis().hget('alise:stats', 'finished') or 0))",
    )
    down()
    compose("up", "-d", "--scale", "predictor=2")
    wait_healthy()
    after = podman(
        "exec",
        container("redis"),
        "python3",
        "-c",
        "import redis; print(int(redis.Redis().hget('alise:stats', 'finished') or 0))",
    )
    assert int(after.strip()) >= int(before.strip()) > 0  # the counters survived down/up
