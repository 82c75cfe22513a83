"""Stopping a gateway (SIGTERM, as `alise serve` does on Ctrl-C) drains open streams for a
while, then ends the rest with a clear error event and aborts them upstream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from lab.gateway.testing import inprocess_backend
from services.common.redis_runner import free_port
from tests.integration.test_gateway_protocol import sse_events, stats, wait_for

DRAIN_S = 2.5  # ALISE_DRAIN_S, not the 5 s default: the setting is read


def test_sigterm_ends_open_streams_with_an_error_and_aborts_them(tmp_path, redis_server):
    with inprocess_backend(tmp_path, None, redis_server.url) as backend:  # requests stay queued
        port = free_port()
        env = {
            **os.environ,
            "ALISE_GATEWAY_PORT": str(port),
            "ALISE_SCHEDULER_ADDRESS": backend["address"],
            "ALISE_PREDICTOR_ADDRESSES": f"127.0.0.1:{free_port()}",
            "ALISE_DRAIN_S": str(DRAIN_S),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", "gateway", "serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            assert wait_for(lambda: _up(url), timeout=120), "gateway did not start"
            body = {"prompt": "hello", "max_tokens": 4, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                assert wait_for(lambda: stats(backend).waiting == 1)
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                raw = resp.read()
            payloads = sse_events(raw)
            assert payloads[-1] == b"[DONE]"
            error = json.loads(payloads[-2])["error"]
            assert error["code"] == "shutting_down" and "shutting down" in error["message"]
            drained = time.monotonic() - started
            assert drained >= DRAIN_S - 0.5  # the drain period came first
            assert drained < 5.0  # ALISE_DRAIN_S, not the 5 s default
            assert wait_for(lambda: stats(backend).aborted >= 1 and stats(backend).waiting == 0)
            assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        finally:
            if proc.poll() is None:
                proc.kill()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
