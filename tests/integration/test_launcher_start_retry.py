"""The launcher starts a service again when it exits while starting (a port held for a
moment), and still gives up with a clear error when it keeps failing."""

from __future__ import annotations

import socket
import threading

import pytest

from services.common.redis_runner import free_port
from services.launcher.supervisor import Supervisor, base_env
from services.launcher.topology import ServiceSpec


def _scheduler_spec(port: int, redis_url: str) -> ServiceSpec:
    return ServiceSpec(
        "scheduler",
        ("scheduler", "serve"),
        {
            "ALISE_SCHEDULER_HOST": "127.0.0.1",
            "ALISE_SCHEDULER_PORT": str(port),
            "ALISE_EXECUTORS": f"127.0.0.1:{free_port()}",
            "ALISE_REDIS_URL": redis_url,
        },
        ("grpc", f"127.0.0.1:{port}"),
    )


def _hold(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_service_whose_port_frees_up_is_started_again(tmp_path, redis_server):
    port = free_port()
    sock = _hold(port)
    threading.Timer(2.0, sock.close).start()  # released while the first attempt fails
    sup = Supervisor(
        [_scheduler_spec(port, redis_server.url)],
        tmp_path / "run",
        base_env({"ALISE_DATA_DIR": str(tmp_path)}),
    )
    try:
        sup.start_all(health_timeout=90)
        child = sup.child("scheduler")
        assert child.restarts >= 1 and not child.exited()
    finally:
        sup.stop_all()


def test_service_that_keeps_failing_gives_up(tmp_path, redis_server):
    port = free_port()
    sock = _hold(port)
    sup = Supervisor(
        [_scheduler_spec(port, redis_server.url)],
        tmp_path / "run",
        base_env({"ALISE_DATA_DIR": str(tmp_path)}),
    )
    try:
        with pytest.raises(RuntimeError, match=r"scheduler exited .* \(3 attempts\)"):
            sup.start_all(health_timeout=90)
    finally:
        sup.stop_all()
        sock.close()
