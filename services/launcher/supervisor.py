"""Child-process supervision for `alise serve`: start in order, wait for health, restart
crashed services with exponential backoff, stop everything in reverse order.

Each child runs `python -m services <command>` in its own session (a terminal Ctrl-C
reaches only the launcher, which then stops the children in order) and asks the kernel for a
parent-death signal as its first act (services/main.py, `ALISE_DIE_WITH_PARENT`), so no child
outlives a launcher that was killed outright. (Not a `preexec_fn`: forking a process whose
gRPC threads are running crashes gRPC's fork handlers; without one, Python spawns with vfork.)
Logs go to `<run_dir>/<service>.log`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.grpc_client import check_health_sync
from services.common.redis_runner import ping
from services.launcher.topology import ServiceSpec

log = logging.getLogger(__name__)


def healthy(spec: ServiceSpec, timeout: float = 2.0) -> bool:
    kind, target = spec.health
    if kind == "grpc":
        return check_health_sync(target, timeout=timeout)
    if kind == "redis":
        return ping(target, timeout=timeout)
    try:
        return httpx.get(target, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Child:
    spec: ServiceSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = field(default=1.0)

    def start(self, base_env: dict[str, str]) -> None:
        env = {**base_env, **self.spec.env, "ALISE_DIE_WITH_PARENT": str(os.getpid())}
        log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services", *self.spec.command],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        self.started_at = time.monotonic()
        log.info("started %s (pid %d), log %s", self.spec.name, self.process.pid, self.log_path)

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def stop(self, timeout: float) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.spec.name, timeout)
            proc.kill()
            proc.wait()


class Supervisor:
    def __init__(
        self,
        specs: list[ServiceSpec],
        run_dir: Path,
        env: dict[str, str],
        max_backoff: float = 30.0,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.children = [Child(s, run_dir / f"{s.name}.log") for s in specs]
        self.env = env
        self.max_backoff = max_backoff

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    def start_all(self, health_timeout: float) -> None:
        """Start each service once its dependencies are healthy; wait for all to be healthy."""
        for child in self.children:
            for dep in child.spec.depends_on:
                self.wait_healthy(self.child(dep), health_timeout)
            child.start(self.env)
        for child in self.children:
            self.wait_healthy(child, health_timeout)
        self.write_pids()

    def wait_healthy(self, child: Child, timeout: float, attempts: int = 3) -> None:
        """Wait for `child` to pass its health check. A child that exits while starting is
        started again (after 1 s, then 2 s) before giving up: its port can be held for a
        moment, e.g. by another process's outgoing connection, since the default gRPC ports
        lie in Linux's ephemeral range (a live sweep hit this between two stacks)."""
        deadline = time.monotonic() + timeout
        failures = 0
        while time.monotonic() < deadline:
            if child.exited():
                failures += 1
                if failures >= attempts:
                    reason = failure_reason(child.log_path)
                    raise RuntimeError(
                        f"{child.spec.name} exited with code {child.process.returncode} while "
                        f"starting ({failures} attempts)"
                        + (f": {reason}" if reason else "")
                        + f"; see {child.log_path}"
                    )
                delay = float(2 ** (failures - 1))
                log.warning(
                    "%s exited with code %s while starting; trying again in %.0fs",
                    child.spec.name,
                    child.process.returncode,
                    delay,
                )
                time.sleep(delay)
                child.restarts += 1
                child.start(self.env)
                continue
            if healthy(child.spec):
                return
            time.sleep(0.25)
        raise TimeoutError(
            f"{child.spec.name} not healthy after {timeout:.0f}s; see {child.log_path}"
        )

    def poll(self) -> list[str]:
        """Restart crashed children (with backoff); returns the names restarted now."""
        now = time.monotonic()
        restarted = []
        for child in self.children:
            if not child.exited():
                if now - child.started_at > 60:
                    child.backoff = 1.0  # ran stably: forget earlier crashes
                continue
            if child.next_start == 0.0:
                child.next_start = now + child.backoff
                log.warning(
                    "%s exited with code %s; restarting in %.0fs",
                    child.spec.name,
                    child.process.returncode,
                    child.backoff,
                )
            elif now >= child.next_start:
                child.backoff = min(child.backoff * 2, self.max_backoff)
                child.next_start = 0.0
                child.restarts += 1
                child.start(self.env)
                restarted.append(child.spec.name)
        if restarted:
            self.write_pids()
        return restarted

    def stop_all(self, timeout: float = 20.0) -> None:
        """Reverse start order: the gateway drains first, Redis-backed state last."""
        for child in reversed(self.children):
            child.stop(timeout)

    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.process.pid for c in self.children if c.process}

    def write_pids(self) -> None:
        """`<run_dir>/pids.json`: each service's current process id (rewritten after every
        restart), for operators and the chaos benchmark."""
        tmp = self.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps(self.pids()))
        tmp.replace(self.run_dir / "pids.json")


_EXCEPTION = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception): .+")


def failure_reason(log_path: Path, tail_bytes: int = 65536) -> str:
    """The last exception named in the end of a service's log (`ValueError: unsupported
    architecture ...`, from a traceback or a logged error), or "" when it names none."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    found = [m.group(0).strip() for m in map(_EXCEPTION.search, lines) if m]
    return found[-1] if found else ""


def base_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(overrides)
    return env
