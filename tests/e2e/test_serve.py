"""`alise serve` end to end: the whole stack with the real bundled model, through the official
openai client; the launcher restarts a killed executor; shutdown leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lab.launcher.serve_stack import free_local_ports
from services.common.redis_runner import free_port, pid_alive

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        tree.setdefault(parent, []).append(child)
    found, stack = set(), [pid]
    while stack:
        for child in tree.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {
        **os.environ,
        "ALISE_RUN_DIR": str(run_dir),
        "ALISE_GATEWAY_PORT": str(port),
        # internal ports of its own: a stack already running here is left alone
        "ALISE_INTERNAL_PORT_BASE": str(free_local_ports(1, 1).base),
        "ALISE_KV_MEMORY_GB": "0.25",
        "ALISE_SWAP_MEMORY_GB": "0.25",
        "ALISE_NUM_EXECUTORS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log = open(run_dir / "launcher.out", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"alise serve exited: {(run_dir / 'launcher.out').read_text()[-3000:]}")
        if "ALISE is ready" in (run_dir / "launcher.out").read_text():
            break
        time.sleep(1)
    else:
        proc.kill()
        pytest.fail("alise serve did not become ready")
    yield {"url": url, "proc": proc, "run_dir": run_dir}
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    log.close()


def _chat(url: str, content: str, max_tokens: int = 24) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        stream=True,
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "user", "content": content}],
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_streaming_chat_answers_sensibly_and_shows_in_metrics(stack):
    text = _chat(stack["url"], "What is the capital of France? Answer in one sentence.")
    assert "Paris" in text, text
    metrics = httpx.get(f"{stack['url']}/metrics", timeout=10).text
    assert "alise:" in metrics
    served = [
        line
        for line in metrics.splitlines()
        if line.startswith("alise:") and "request" in line and not line.endswith(" 0.0")
    ]
    assert served, "no request metric recorded"


def _service_pids(launcher: int) -> dict[str, int]:
    """The launcher's services by their `alise` subcommand (gateway, executor, ...)."""
    found = {}
    for pid in _children(launcher):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "services" in argv and argv.index("services") + 1 < len(argv):
            found.setdefault(argv[argv.index("services") + 1], pid)
    return found


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_the_cpu_plan_is_printed_and_applied(stack):
    """`alise serve` says how it shares the cores, and the services run that way: the
    executor with every core and OpenMP threads that spin briefly, the control plane at nice
    10."""
    out = (stack["run_dir"] / "launcher.out").read_text()
    cores = len(os.sched_getaffinity(0))
    assert f"cpu: each executor {cores} thread(s)" in out, out[:2000]
    pids = _service_pids(stack["proc"].pid)
    executor = Path(f"/proc/{pids['executor']}/environ").read_bytes().split(b"\0")
    assert f"ALISE_NUM_THREADS={cores}".encode() in executor
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        assert b"GOMP_SPINCOUNT=20000" in executor
    base = _nice(stack["proc"].pid)
    assert _nice(pids["executor"]) == base
    for name in ("gateway", "scheduler", "predictor"):
        assert _nice(pids[name]) == min(19, base + 10), name


def test_killed_executor_is_restarted_and_inflight_requests_complete(stack):
    launcher = stack["proc"]
    executor_pid = None
    for pid in _children(launcher.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"executor" in cmdline and b"serve" in cmdline:
            executor_pid = pid
    assert executor_pid, "no executor process found under the launcher"
    results: list[str] = []
    worker = threading.Thread(
        target=lambda: results.append(
            _chat(stack["url"], "Name three colours of the rainbow.", max_tokens=48)
        )
    )
    worker.start()
    time.sleep(1.0)
    os.kill(executor_pid, signal.SIGKILL)
    worker.join(300)
    assert not worker.is_alive(), "in-flight request hung after the executor was killed"
    assert results and results[0].strip(), "in-flight request returned no text"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if "restarted executor-0" in (stack["run_dir"] / "launcher.out").read_text():
            break
        time.sleep(1)
    else:
        pytest.fail("launcher did not restart the killed executor")
    assert "Paris" in _chat(stack["url"], "What is the capital of France? One sentence.")


def test_shutdown_leaves_no_process_behind(stack):
    launcher = stack["proc"]
    descendants = _children(launcher.pid)
    assert len(descendants) >= 4  # predictor, executor, scheduler, gateway (+ redis)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(90) == 0
    time.sleep(0.5)
    alive = [pid for pid in descendants if pid_alive(pid)]
    assert not alive, f"processes left behind: {alive}"
