"""`alise serve` on a GPU: the stack starts (the executor reports SERVING only after warm-up),
answers a chat completion, and the executor's start-up line reports its pool and graphs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common.redis_runner import free_port
from tests.gpu import GPU_ONLY

pytestmark = GPU_ONLY
ROOT = Path(__file__).resolve().parents[2]


def test_alise_serve_answers_on_cuda(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "ALISE_RUN_DIR": str(tmp_path),
        "ALISE_GATEWAY_PORT": str(port),
        "ALISE_DEVICE": "cuda",
        "ALISE_GPU_MEMORY_UTILIZATION": "0.5",
        "ALISE_SWAP_MEMORY_GB": "0.25",
        "ALISE_NUM_EXECUTORS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("ALISE_KV_MEMORY_GB", None)
    out = tmp_path / "launcher.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 600
            while "ALISE is ready" not in out.read_text():
                assert proc.poll() is None, out.read_text()[-3000:]
                assert time.monotonic() < deadline, "alise serve did not become ready"
                time.sleep(1)
            url = f"http://127.0.0.1:{port}/v1"
            model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
            reply = httpx.post(
                f"{url}/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "Name a colour."}],
                    "max_tokens": 16,
                },
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"].strip()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log")) + out.read_text()
    assert "executor ready" in logs and "cuda_graphs" in logs, logs[-3000:]
