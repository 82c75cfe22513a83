"""docker-compose.yml and `alise serve` (services/launcher/topology.py) describe the same stack."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cli.main import build_parser
from services.common.settings import env_var_names
from services.launcher.topology import local_topology

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
INFRA = {"redis", "qdrant"}


def _alise_services():
    return {name: svc for name, svc in SERVICES.items() if name not in INFRA}


def test_same_services_with_same_commands_as_the_launcher():
    launcher = {s.name: s for s in local_topology(2, "redis://x", num_schedulers=2)}
    compose = _alise_services()
    assert set(compose) == set(launcher)
    for name, svc in compose.items():
        assert svc["command"][0] == "alise"
        assert tuple(svc["command"][1:]) == launcher[name].command, name


def test_every_command_is_a_real_alise_subcommand():
    parser = build_parser()
    commands = [svc["command"][1:] for svc in _alise_services().values()]
    commands += [svc["healthcheck"]["test"][2:] for svc in _alise_services().values()]
    for argv in commands:
        args = parser.parse_args(list(argv))
        assert callable(getattr(args, "func", None)), argv


def test_every_environment_variable_is_a_real_setting():
    known = env_var_names()
    for name, svc in _alise_services().items():
        for var in svc.get("environment", {}):
            assert var in known, f"{name}: {var} is not an ALISE setting"
        launcher = {s.name: s for s in local_topology(2, "redis://x", num_schedulers=2)}[name]
        assert set(launcher.env) <= set(svc["environment"]), name


def test_every_service_has_a_health_check_and_dependencies_are_ordered():
    for name, svc in SERVICES.items():
        assert "healthcheck" in svc, name
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            assert cond["condition"] == "service_healthy"
    deps = {n: set(s.get("depends_on") or {}) for n, s in SERVICES.items()}
    assert {"redis", "executor-0"} <= deps["scheduler"]
    assert deps["scheduler-1"] == deps["scheduler"]  # the standby
    assert {"scheduler", "predictor"} <= deps["gateway"]
    assert "qdrant" in deps["predictor"]
    for spec in local_topology(
        2, "redis://x", num_schedulers=2
    ):  # launcher order respects the same edges
        for dep in spec.depends_on:
            assert dep in SERVICES


def test_gateways_share_the_schedulers_redis_for_stored_responses():
    """`previous_response_id` works on any gateway replica: they all use the one Redis."""
    launcher = {s.name: s for s in local_topology(1, "redis://x")}
    assert launcher["gateway"].env["ALISE_REDIS_URL"] == "redis://x"
    for services in (SERVICES, CPU):
        redis = services["scheduler"]["environment"]["ALISE_REDIS_URL"]
        assert services["gateway"]["environment"]["ALISE_REDIS_URL"] == redis


def test_predictor_replicas_and_gpu_reservation():
    assert SERVICES["predictor"]["deploy"]["replicas"] == 2
    gateway_env = SERVICES["gateway"]["environment"]
    assert gateway_env["ALISE_PREDICTOR_ADDRESSES"].startswith("dns:///predictor")
    devices = SERVICES["executor-0"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert SERVICES["gateway"]["ports"] == ["8000:8000"]


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed"
)
def test_docker_compose_config_validates_and_requires_the_secrets():
    secrets = {"ALISE_INTERNAL_TOKEN": "t0ken", "REDIS_PASSWORD": "passw0rd"}
    base = {k: v for k, v in os.environ.items() if k not in secrets}
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        command = ["docker-compose", "-f", str(ROOT / name), "config", "-q"]
        result = subprocess.run(command, capture_output=True, text=True, env={**base, **secrets})
        assert result.returncode == 0, result.stderr
        for missing in secrets:  # no open stack by default
            env = {**base, **{k: v for k, v in secrets.items() if k != missing}}
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            assert result.returncode != 0 and f"set {missing} in .env" in result.stderr


def test_every_service_authenticates_and_only_the_gateway_is_published():
    """The internal token goes to every ALISE service, Redis's password to every service with
    a Redis URL and to redis-server (requirepass, and its health check), both from .env; no
    port but the gateway's is published on the host."""
    for services in (SERVICES, CPU):
        redis = services["redis"]
        assert "requirepass" in " ".join(redis["command"])
        assert "$$REDIS_PASSWORD" in " ".join(redis["command"])
        assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?")
        assert "REDIS_PASSWORD" in " ".join(redis["healthcheck"]["test"])
        for name, svc in services.items():
            assert ("ports" in svc) == (name == "gateway"), name
            if name in INFRA:
                continue
            env = svc["environment"]
            assert env["ALISE_INTERNAL_TOKEN"].startswith("${ALISE_INTERNAL_TOKEN:?"), name
            if "ALISE_REDIS_URL" in env:
                assert env["ALISE_REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?"), name


CPU = yaml.safe_load((ROOT / "docker-compose.cpu.yml").read_text())["services"]


def test_the_cpu_stack_runs_the_launcher_services_on_local_images():
    launcher = {s.name: s for s in local_topology(1, "redis://x", num_schedulers=2)}
    alise = {name: svc for name, svc in CPU.items() if name != "redis"}
    assert set(alise) == set(launcher)
    known = env_var_names()
    for name, svc in alise.items():
        assert tuple(svc["command"][1:]) == launcher[name].command, name
        assert set(svc["environment"]) <= known, name
        assert set(launcher[name].env) <= set(svc["environment"]), name
    images = {svc["image"] for svc in CPU.values()}
    assert images == {"alise:latest"}  # nothing pulled from a registry
    assert "qdrant" not in CPU and "ALISE_QDRANT_URL" not in alise["predictor"]["environment"]
    assert CPU["executor-0"]["environment"]["ALISE_DEVICE"] == "cpu"
    assert CPU["gateway"]["environment"]["ALISE_SCHEDULER_ADDRESS"] == (
        "scheduler:50051,scheduler-1:50051"
    )
    assert all(svc["ulimits"]["nofile"]["hard"] == 1024 for svc in CPU.values())


def test_dockerfiles_take_a_base_and_run_as_non_root():
    cpu = (ROOT / "docker" / "Dockerfile").read_text()
    executor = (ROOT / "docker" / "Dockerfile.executor").read_text()
    for text in (cpu, executor):
        assert "ARG BASE=" in text and "FROM ${BASE}" in text
        assert "USER 10001" in text and "useradd --uid 10001" in text
    assert cpu.count("FROM ${BASE}") == 2  # build stage, then a runtime without build tools
    assert "gcc" in executor and "python3-dev" in executor  # Triton compiles at run time
    assert "HEALTHCHECK" in executor
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
