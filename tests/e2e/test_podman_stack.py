"""The CPU compose stack in containers (`make test-containers`: podman-compose on locally built
images; outside `make test`, which skips it), serving a model directory of the user's (a
random-weight Llama-shaped model with the bundled tokenizer, mounted through MODEL_DIR), not the
bundled model: every health check turns healthy, the gateway reports the directory's name and
context length, an answer streams through the gateway container, two predictor replicas share
the predictions, a killed scheduler container is ridden through by its standby, and
`down`/`up` keeps Redis's data (each predictor replica's embedded store lives in its
container's own volume, so it is not kept). Also the CUDA executor image, without a GPU: the
CUDA build of torch, Triton's ptxas, and a clean "no GPU" exit."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "alise-ct"
URL = "http://127.0.0.1:8000"
# The served model: its directory's name. Under /tmp (podman mounts it at the same path),
# readable by the containers' user 10001.
MODEL_DIR = Path("/tmp/alise-ct-models/tiny-llama-ct")
MODEL = MODEL_DIR.name

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
        env={**os.environ, "MODEL_DIR": str(MODEL_DIR), **SECRETS},
    )


# What compose requires from .env: the internal token and Redis's password (fixed for the
# module: `down` then `up` must find Redis's data behind the same password).
SECRETS = {"ALISE_INTERNAL_TOKEN": secrets.token_hex(24), "REDIS_PASSWORD": secrets.token_hex(24)}


def write_model() -> None:
    """A Llama-shaped random-weight model (config, safetensors, the bundled tokenizer): a
    Hugging Face directory like a user's, 2048 tokens of context (the bundled model has 8192)."""
    from lab.executor.tiny import make_tiny_model

    shutil.rmtree(MODEL_DIR.parent, ignore_errors=True)
    make_tiny_model(MODEL_DIR, arch="llama", seed=31)
    for path in (MODEL_DIR.parent, MODEL_DIR, *MODEL_DIR.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)


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


def chat(
    content: str, max_tokens: int = 48, on_piece: Callable[[list[str]], None] | None = None
) -> tuple[list[str], str | None, int]:
    """Streamed greedy answer: (text pieces as they came, finish reason, completion tokens);
    `on_piece` sees the pieces so far after each one. EOS ignored: a random-weight model would
    otherwise stop anywhere."""
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    pieces: list[str] = []
    finish, tokens = None, 0
    with httpx.stream("POST", f"{URL}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                        if on_piece is not None:
                            on_piece(pieces)
                    finish = choice.get("finish_reason") or finish
    return pieces, finish, tokens


def container(service: str, index: int = 1) -> str:
    return f"{PROJECT}_{service}_{index}"


@pytest.fixture(scope="module")
def stack():
    write_model()
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
    pieces, finish, tokens = chat("What is the capital of France?")
    assert "".join(pieces) and (finish, tokens) == ("length", 48)


def test_the_users_model_directory_is_served(stack):
    """MODEL_DIR, not the bundled model: the gateway names it and takes its context length from
    its config; the predictor starts on it with the warning that it has no calibration."""
    (card,) = httpx.get(f"{URL}/v1/models", timeout=10).json()["data"]
    assert (card["id"], card["max_model_len"]) == (MODEL, 2048)
    other = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{URL}/v1/chat/completions", json=other, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    # podman logs: the container's stdout on its stdout, stderr (the log records) on stderr
    logs = subprocess.run(
        ["podman", "logs", container("predictor")], capture_output=True, text=True, timeout=60
    ).stderr
    assert f"no calibration file for {MODEL}" in logs


def test_both_predictor_replicas_answer(stack):
    for i in range(8):
        chat(f"Tell me one fact about the number {i}.", max_tokens=4)
    counts = [predictions(container("predictor", index)) for index in (1, 2)]
    assert all(counts), f"predictions per replica: {counts}; the gateway's: {gateway_sources()}"


def gateway_sources() -> list[str]:
    """The gateway's predictions by source (`none`: no replica answered in time)."""
    text = httpx.get(f"{URL}/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith("alise:gateway_predictions_t")]


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
    """The leader is killed mid-answer: the standby takes over and the stream goes on to its
    full length. What the client had before the kill is the reference's beginning (the same
    steps, alone in the batch). Past it, the text may differ in bf16 (the executor's default
    dtype on CPUs with native bf16): the resumed request is prefilled again from its
    committed tokens, a different batch shape from the decode steps it replaces."""
    prompt = "Describe a quiet morning in a small town."
    reference, _, _ = chat(prompt, max_tokens=MAX_TOKENS)
    name = leader()
    seen: list[str] = []

    def kill_after_some(pieces: list[str]) -> None:
        if len(pieces) == 8 and not seen:
            podman("kill", container(name))
            seen.extend(pieces)

    pieces, finish, tokens = chat(prompt, max_tokens=MAX_TOKENS, on_piece=kill_after_some)
    assert seen, "the answer ended before the kill"
    assert (finish, tokens) == ("length", MAX_TOKENS)
    assert pieces[: len(seen)] == seen == reference[: len(seen)]


# Long enough that the answer is still streaming when the kill lands and the standby takes over
# (~4 s: lease TTL + half a renewal), at the tiny model's speed.
MAX_TOKENS = 1500


def test_down_and_up_keep_redis_data(stack):
    before = podman("exec", container("redis"), "python3", "-c", REDIS_FINISHED)
    down()
    compose("up", "-d", "--scale", "predictor=2")
    wait_healthy()
    after = podman("exec", container("redis"), "python3", "-c", REDIS_FINISHED)
    assert int(after.strip()) >= int(before.strip()) > 0  # the counters survived down/up


# inside the redis container, which holds the password in its environment
REDIS_FINISHED = (
    "import os, redis; r = redis.Redis(password=os.environ['REDIS_PASSWORD']); "
    "print(int(r.hget('alise:stats', 'finished') or 0))"
)


EXECUTOR_IMAGE = "localhost/alise-executor:latest"
# As the compose stack runs them here: podman cannot raise the limits past the host's.
RUN = ["podman", "run", "--rm", "--network", "none", "--no-healthcheck"]
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
CUDA_CHECK = (
    "import pathlib, subprocess, torch, triton\n"
    "from triton.backends.nvidia import compiler\n"
    "ptxas = pathlib.Path(compiler.__file__).parent / 'bin' / 'ptxas'\n"
    "version = subprocess.run([str(ptxas), '--version'], capture_output=True, text=True)\n"
    "print(torch.version.cuda, triton.__version__, torch.cuda.is_available())\n"
    "print(' '.join(version.stdout.split()))\n"
)


def test_the_cuda_executor_image_without_a_gpu():
    """docker/Dockerfile.executor on a plain Debian base: PyPI's CUDA build of torch (it carries
    the CUDA runtime), Triton with the ptxas it compiles kernels with, and the entrypoint, asked
    for CUDA where there is no GPU, ending with the one-line reason (exit 1), not a traceback."""
    out = podman(*RUN[1:], *LIMITS, EXECUTOR_IMAGE, "python", "-c", CUDA_CHECK)
    versions, ptxas = out.strip().splitlines()
    cuda, _triton, available = versions.split()
    assert cuda.split(".")[0].isdigit() and available == "False", versions
    assert "Cuda compilation tools" in ptxas, ptxas
    run = subprocess.run(
        [*RUN, *LIMITS, "-e", "ALISE_DEVICE=cuda", EXECUTOR_IMAGE],
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = run.stdout + run.stderr
    assert run.returncode == 1, logs
    assert "executor start-up failed" in logs and "CUDA is not available" in logs, logs
    assert "Traceback" not in logs, logs
