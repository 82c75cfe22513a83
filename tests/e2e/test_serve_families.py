"""`alise serve --model DIR` with a family other than the bundled model's: a tiny Gemma 3
image-text checkpoint (its vision tower skipped) streams a chat answer through the whole
stack; a checkpoint of an architecture no family serves stops the launcher with the reason
printed on its own output, not only in the executor's log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.executor.tiny import make_tiny_model
from lab.launcher.serve_stack import free_local_ports
from services.common.redis_runner import free_port

ROOT = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, model: Path) -> tuple[subprocess.Popen, Path, str]:
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "ALISE_RUN_DIR": str(run_dir),
        "ALISE_GATEWAY_PORT": str(port),
        "ALISE_INTERNAL_PORT_BASE": str(free_local_ports(1, 1).base),
        "ALISE_KV_MEMORY_GB": "0.1",
        "ALISE_SWAP_MEMORY_GB": "0.1",
        "PYTHONUNBUFFERED": "1",
    }
    out = run_dir / "launcher.out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "serve", "--model", str(model)],
        env=env,
        stdout=open(out, "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    return proc, out, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_alise_serve_streams_a_gemma3_image_text_checkpoint(tmp_path):
    from openai import OpenAI

    model = make_tiny_model(tmp_path / "tiny-gemma3", "gemma3", seed=2, head_dim=64)
    proc, out, url = _launch(tmp_path / "run", model)
    try:
        deadline = time.monotonic() + 420
        while "ALISE is ready" not in out.read_text():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "alise serve did not become ready"
            time.sleep(1)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            stream=True,
            max_tokens=8,
            messages=[{"role": "user", "content": "Describe a sunset."}],
            extra_body={"ignore_eos": True},
        )
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len(chunks) >= 8 and "".join(chunks)
        log = (tmp_path / "run" / "executor-0.log").read_text()
        assert "vision tower" in log  # the skipped tensors are logged
    finally:
        _stop(proc)


def test_alise_serve_prints_why_a_model_is_refused(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "llama", seed=2)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "mamba"}))
    proc, out, _ = _launch(tmp_path / "run", model)
    try:
        assert proc.wait(420) == 1
    finally:
        _stop(proc)
    text = out.read_text()
    assert "unsupported architecture 'mamba'" in text and "qwen3" in text, text[-3000:]


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
