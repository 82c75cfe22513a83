"""The Kubernetes manifests (deploy/k8s) render with kustomize and describe the same services as
`alise serve` (services/launcher/topology.py): same commands, real settings, both schedulers
listed for the gateway, probes on the right ports, non-root containers with limits, GPUs on
the gpu overlay's executors, and only the gateway reachable from outside."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.settings import env_var_names
from services.launcher.topology import local_topology

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
INFRA = {"redis", "qdrant"}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed"
)


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def objects(request) -> list[dict]:
    return render(request.param)


def workloads(objects: list[dict]) -> dict[str, dict]:
    kinds = {"Deployment", "StatefulSet"}
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in kinds}


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(objects: list[dict], workload: dict) -> dict[str, str]:
    """The container's environment: its ConfigMap/Secret sources, then its own entries."""
    sources = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("ConfigMap", "Secret")}
    env: dict[str, str] = {}
    for ref in container(workload).get("envFrom", []):
        name = (ref.get("configMapRef") or ref.get("secretRef"))["name"]
        src = sources[name]
        env.update(src.get("data") or src.get("stringData") or {})
    env.update({e["name"]: e.get("value", "") for e in container(workload).get("env", [])})
    return env


def test_the_same_services_and_commands_as_the_launcher(objects):
    # executor-0, executor-1 -> the executor StatefulSet; scheduler, scheduler-1 -> scheduler
    launcher = {s.name.split("-")[0]: s for s in local_topology(2, "redis://x", num_schedulers=2)}
    apps = {n: w for n, w in workloads(objects).items() if n not in INFRA}
    assert set(apps) == set(launcher)
    for name, workload in apps.items():
        assert container(workload)["command"] == ["alise", *launcher[name].command], name


def test_every_environment_variable_is_a_real_setting(objects):
    known = env_var_names() | {"HF_HUB_OFFLINE", "POD_NAME"}
    launcher = {s.name: s for s in local_topology(2, "redis://x", num_schedulers=2)}
    for name, workload in workloads(objects).items():
        if name in INFRA:
            continue
        env = env_of(objects, workload)
        unknown = set(env) - known
        assert not unknown, f"{name}: {unknown} are not ALISE settings"
        spec = launcher.get(name) or launcher[f"{name}-0"]
        missing = set(spec.env) - set(env)
        assert not missing, f"{name} lacks {missing}"


def test_the_gateway_lists_both_schedulers_and_executors_register(objects):
    apps = workloads(objects)
    gateway = env_of(objects, apps["gateway"])
    schedulers = gateway["ALISE_SCHEDULER_ADDRESS"].split(",")
    assert schedulers == [f"scheduler-{i}.scheduler:50051" for i in range(2)]
    assert apps["scheduler"]["spec"]["replicas"] == len(schedulers)
    executor = env_of(objects, apps["executor"])
    assert executor["ALISE_REGISTRY_URL"].startswith("redis://")
    assert executor["ALISE_ADVERTISE_ADDRESS"] == "$(POD_NAME).executor:50061"
    assert gateway["ALISE_PREDICTOR_ADDRESSES"] == "dns:///predictor:50052"
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert pdbs and pdbs[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == (
        "scheduler"
    )


def test_probes_use_each_service_port(objects):
    ports = {"predictor": 50052, "executor": 50061, "scheduler": 50051}
    apps = workloads(objects)
    for name, port in ports.items():
        c = container(apps[name])
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert c["livenessProbe"]["grpc"]["port"] == port
        assert c["ports"][0]["containerPort"] == port
    assert container(apps["gateway"])["readinessProbe"]["httpGet"]["path"] == "/health"


def test_containers_run_as_non_root_with_limits(objects):
    for name, workload in workloads(objects).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        c = container(workload)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"], name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), name


def test_gpus_only_on_the_gpu_overlay():
    def gpus(overlay: str) -> object:
        return container(workloads(render(overlay))["executor"])["resources"]["limits"].get(
            "nvidia.com/gpu"
        )

    assert gpus("gpu") == 1
    assert gpus("cpu") is None


def test_only_the_gateway_is_reachable_from_outside(objects):
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny, "no default-deny ingress policy"
    open_to_all = [
        p for p in policies for rule in p["spec"].get("ingress", []) if "from" not in rule
    ]
    assert [p["spec"]["podSelector"] for p in open_to_all] == [
        {"matchLabels": {"app.kubernetes.io/name": "gateway"}}
    ]
    services = [o for o in objects if o["kind"] == "Service"]
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services)
    ingress = [o for o in objects if o["kind"] == "Ingress"]
    backends = {
        p["backend"]["service"]["name"]
        for i in ingress
        for r in i["spec"]["rules"]
        for p in r["http"]["paths"]
    }
    assert backends == {"gateway"}
