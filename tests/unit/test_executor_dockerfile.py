"""docker/Dockerfile.executor, read statically: it can compile Triton kernels at run time, runs
as a non-root user, takes a model directory and a data volume, and its health check is the
executor's gRPC health, which only a warm executor passes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from services.common.settings import ExecutorSettings

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = (ROOT / "docker" / "Dockerfile.executor").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def args(word: str) -> list[str]:
    return [rest for w, rest in instructions() if w == word]


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def exec_form(text: str) -> list[str]:
    """A JSON-array (exec form) command; the shell form is refused."""
    assert text.startswith("["), f"not exec form: {text}"
    return json.loads(text)


def env() -> dict[str, str]:
    out = {}
    for rest in args("ENV"):
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            out[key] = value
    return out


def test_the_running_image_can_compile_triton_kernels():
    """Triton builds a C launcher per kernel with the system compiler against Python.h."""
    runs = " ".join(rest for w, rest in final_stage() if w == "RUN")
    packages = set(re.findall(r"apt-get install[^&]*", runs)[0].split())
    assert {"gcc", "libc6-dev", "python3-dev"} <= packages
    assert not re.search(r"apt-get (remove|purge|autoremove)", runs)  # not removed afterwards
    assert env()["TRITON_CACHE_DIR"].startswith("/data/")  # a writable, persistent volume


def test_the_running_images_can_build_the_cpu_kernels():
    """cpu_kernels.py compiles C++ at first start and caches it on the data volume, in the
    executor image and in the CPU image that runs CPU executors."""
    runs = " ".join(rest for w, rest in final_stage() if w == "RUN")
    assert "g++" in re.findall(r"apt-get install[^&]*", runs)[0].split()
    assert env()["TORCH_EXTENSIONS_DIR"].startswith("/data/")
    cpu = (ROOT / "docker" / "Dockerfile").read_text()
    final = cpu[cpu.rindex("FROM ") :]
    assert re.search(r"apt-get install[^&]*\bg\+\+", final)
    assert "TORCH_EXTENSIONS_DIR=/data/" in final


def test_it_runs_as_a_non_root_user_owning_its_volumes():
    stage = final_stage()
    users = [rest for w, rest in stage if w == "USER"]
    assert users and users[-1] == "10001"
    last_user = max(i for i, (w, _) in enumerate(stage) if w == "USER")
    assert all(w != "RUN" for w, _ in stage[last_user:])  # nothing runs as root after it
    runs = " ".join(rest for w, rest in stage if w == "RUN")
    assert "useradd --uid 10001" in runs
    assert re.search(r"chown alise:alise /data /models", runs)


def test_it_mounts_a_model_directory_and_a_data_volume():
    volumes = [v for rest in args("VOLUME") for v in exec_form(rest)]
    assert {"/data", "/models"} <= set(volumes)
    assert env()["ALISE_DATA_DIR"] == "/data"


def test_the_health_check_is_the_executors_grpc_health():
    """gRPC health of the whole server: NOT_SERVING until loading and warm-up are done
    (tests/unit/test_executor_warmup.py checks the server side)."""
    (check,) = args("HEALTHCHECK")
    options, _, command = check.partition(" CMD ")
    port = env()["ALISE_EXECUTOR_PORT"]
    assert exec_form(command) == ["alise", "health", "grpc", f"127.0.0.1:{port}"]
    assert args("EXPOSE") == [port]
    start = int(re.search(r"--start-period=(\d+)s", options).group(1))
    assert start >= 300  # a large model loads, compiles and captures for minutes
    assert exec_form(args("CMD")[-1]) == ["alise", "executor", "serve"]


@pytest.mark.parametrize("name", ["ALISE_EXECUTOR_PORT", "ALISE_EXECUTOR_HOST", "ALISE_DATA_DIR"])
def test_its_settings_are_real_executor_settings(name):
    assert name.removeprefix("ALISE_").lower() in ExecutorSettings.model_fields
