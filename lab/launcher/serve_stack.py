"""`alise serve` as a subprocess, for tests and the chaos benchmark: the exact one-command
topology (embedded Redis supervised by the launcher, predictor, executors, scheduler(s),
gateway), with only the launcher restarting what dies. `model="tiny"` builds a random-weight
model with the bundled tokenizer. Children are found by name through the launcher's
`pids.json`; `redis_url()` reads the URL (with its generated password) from a scheduler's
environment, as only the launcher's children are given it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from services.common.internal_auth import TOKEN_ENV
from services.common.redis_runner import free_port, generate_password
from services.launcher.topology import LocalPorts, scheduler_names, scheduler_ports


def free_local_ports(num_executors: int, num_schedulers: int) -> LocalPorts:
    """A port base whose every `alise serve` port is free now on loopback."""
    rng = random.Random()
    for _ in range(200):
        ports = LocalPorts(rng.randrange(20000, 40000))
        if all(_is_free(p) for p in ports.all(num_executors, num_schedulers)):
            return ports
    raise RuntimeError("no free range of loopback ports for a serve stack")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class ServeStack:
    def __init__(
        self,
        run_dir: Path,
        model: str = "tiny",
        num_executors: int = 1,
        num_schedulers: int = 1,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 420.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.model = model
        self.num_executors = num_executors
        self.num_schedulers = num_schedulers
        self.extra_env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.model_id = ""
        # internal ports of its own, so a stack already running on the machine is left alone
        self.ports = free_local_ports(num_executors, num_schedulers)
        self.scheduler_addresses = [
            f"127.0.0.1:{p}" for p in scheduler_ports(num_schedulers, self.ports)
        ]
        self.supervises_redis = True  # the launcher restarts Redis, not the caller
        self.out_path = self.run_dir / "launcher.out"

    def _model_setting(self) -> str:
        if self.model != "tiny":
            return self.model
        from lab.executor.tiny import make_tiny_model

        return str(make_tiny_model(self.run_dir / "tiny-model"))

    def __enter__(self) -> ServeStack:
        from services.common.models import served_model_id

        self.run_dir.mkdir(parents=True, exist_ok=True)
        model = self._model_setting()
        self.model_id = served_model_id(model)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "ALISE_MODEL": model,
            "ALISE_DATA_DIR": str(self.run_dir / "data"),
            "ALISE_RUN_DIR": str(self.run_dir / "logs"),
            "ALISE_GATEWAY_PORT": str(port),
            "ALISE_INTERNAL_PORT_BASE": str(self.ports.base),
            "ALISE_NUM_EXECUTORS": str(self.num_executors),
            "ALISE_NUM_SCHEDULERS": str(self.num_schedulers),
            "ALISE_KV_MEMORY_GB": "0.25",
            "ALISE_SWAP_MEMORY_GB": "0.1",
            "ALISE_DEVICE": "cpu",
            "PYTHONUNBUFFERED": "1",
            # the launcher stops the stack when this process dies, however it dies
            "ALISE_DIE_WITH_PARENT": str(os.getpid()),
            **self.extra_env,
        }
        env.pop("ALISE_REDIS_URL", None)
        # the internal plane's secret: given to the stack and kept here while it runs, so this
        # process's gRPC channels (Stats, say) carry it; __exit__ takes it back out
        self._own_token = TOKEN_ENV not in os.environ
        os.environ.setdefault(TOKEN_ENV, generate_password())
        env[TOKEN_ENV] = os.environ[TOKEN_ENV]
        with open(self.out_path, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services", "serve"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            text = self.out_path.read_text(errors="replace")
            if "ALISE is ready" in text:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"alise serve exited: {text[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"alise serve not ready after {self.ready_timeout_s:g}s")

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        return json.loads((self.run_dir / "logs" / "pids.json").read_text())

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.pids()[name], sig)

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 60.0) -> int:
        """The new process id of `name` once the launcher restarted it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.pids().get(name)
            if pid and pid != old_pid:
                return pid
            time.sleep(0.1)
        raise TimeoutError(f"{name} not restarted after {timeout_s:g}s")

    def leader(self, timeout_s: float = 15.0) -> str:
        """The name of the scheduler that leads now (waits for one during a takeover)."""
        from services.common.grpc_client import SCHEDULER_SERVICE, check_health_sync

        deadline = time.monotonic() + timeout_s
        while True:
            for name, address in zip(
                scheduler_names(self.num_schedulers), self.scheduler_addresses
            ):
                if check_health_sync(address, SCHEDULER_SERVICE, timeout=1.0):
                    return name
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler leads after {timeout_s:g}s")
            time.sleep(0.1)

    def scheduler_address_of(self, name: str) -> str:
        return self.scheduler_addresses[scheduler_names(self.num_schedulers).index(name)]

    def redis_url(self) -> str:
        pid = self.pids()["scheduler"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in environ:
            if item.startswith(b"ALISE_REDIS_URL="):
                return item.split(b"=", 1)[1].decode()
        raise KeyError("ALISE_REDIS_URL not in the scheduler's environment")

    def __exit__(self, *exc: object) -> None:
        if getattr(self, "_own_token", False):
            os.environ.pop(TOKEN_ENV, None)  # later servers in this process check no token
            self._own_token = False
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
