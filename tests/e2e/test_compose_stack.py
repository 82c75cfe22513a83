"""Where a Docker engine is reachable: build the images, start the compose stack and stream
one answer through the gateway. Skips with the reason where there is no engine (the
development machine and CI have only the docker client)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _engine_or_skip():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:
        pytest.skip(f"no Docker engine reachable ({type(exc).__name__}: {exc})")
    compose = (
        ["docker", "compose"]
        if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
        else (["docker-compose"] if shutil.which("docker-compose") else None)
    )
    if compose is None:
        pytest.skip("a Docker engine is reachable but no compose CLI is installed")
    gpus = client.info().get("Runtimes", {})
    if "nvidia" not in gpus:
        pytest.skip("the compose stack reserves an NVIDIA GPU; this engine has no nvidia runtime")
    return client, compose


def test_compose_stack_streams_an_answer():
    _, compose = _engine_or_skip()
    project = ["-p", "alise-test", "-f", str(ROOT / "docker-compose.yml")]
    subprocess.run([*compose, *project, "build"], check=True, cwd=ROOT, timeout=3600)
    subprocess.run([*compose, *project, "up", "-d"], check=True, cwd=ROOT, timeout=1800)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(5)
        else:
            pytest.fail("the compose stack's gateway never became healthy")
        body = {
            "stream": True,
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
        text = []
        with httpx.stream(
            "POST", "http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=120
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        text.append(choice["delta"].get("content") or "")
        assert "Paris" in "".join(text)
    finally:
        subprocess.run([*compose, *project, "down", "-v"], cwd=ROOT, timeout=600)
