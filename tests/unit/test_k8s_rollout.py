"""deploy/k8s, rendered, holds up in a rollout: every image follows an overlay's `images:`
(init containers included), the gateway drains longer than it resumes streams within its grace
period, schedulers and executors spread over nodes with disruption budgets, GPU executors go
to GPU nodes under the nvidia runtime, thread counts come from CPU limits, and the model
volume (components/model, components/model-copy) is mounted read-only where it is read."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cli.main import build_parser
from services.common.settings import GatewaySettings
from tests.unit.test_k8s import (
    K8S,
    OVERLAYS,
    apps,
    container,
    env_of,
    of_kind,
    pod,
    render,
    role,
    workloads,
)

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed"
)

REGISTRY = "registry.example.com/team"
MODEL_COMPONENTS = ("model", "model-copy")


def render_custom(tmp_path: Path, overlay: str, components: tuple[str, ...] = ()) -> list[dict]:
    """`overlay` as a user's own overlay takes it: with their registry and tag, and optionally
    more components."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, tmp_path)],
        "components": [os.path.relpath(K8S / "components" / c, tmp_path) for c in components],
        "images": [
            {"name": n, "newName": f"{REGISTRY}/{n}", "newTag": "v1.2.3"}
            for n in ("alise", "alise-executor")
        ],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def every_container(workload: dict) -> list[dict]:
    return pod(workload)["containers"] + pod(workload).get("initContainers", [])


# The model components a user's overlay adds to each shipped one (the gpu overlays carry
# components/model already).
EXTRA = {"cpu": ("model", "model-copy"), "gpu": ("model-copy",), "gpu-shards": ("model-copy",)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_follows_the_images_list(overlay: str, tmp_path: Path) -> None:
    """Shipped: every ALISE container on a tagged local build. A user's overlay naming a
    registry and tag moves every one of them (shard 1's schedulers and the model copier's init
    containers too); Redis and Qdrant keep their pinned releases."""
    for name, workload in apps(render(overlay)).items():
        for c in every_container(workload):
            assert c["image"] in ("alise:latest", "alise-executor:latest"), (name, c["name"])
    images = {
        (name, c["name"]): c["image"]
        for name, workload in workloads(render_custom(tmp_path, overlay, EXTRA[overlay])).items()
        for c in every_container(workload)
    }
    ours = {k: v for k, v in images.items() if k[0] not in ("redis", "qdrant")}
    assert all(v.startswith(f"{REGISTRY}/") and v.endswith(":v1.2.3") for v in ours.values()), ours
    executor = "alise-executor" if overlay.startswith("gpu") else "alise"
    assert images[("executor", "executor")] == f"{REGISTRY}/{executor}:v1.2.3"
    for name in ("gateway", "predictor", "executor"):
        assert (name, "model-copy") in ours
    if overlay == "gpu-shards":
        assert ("scheduler-shard1", "scheduler") in ours
    assert images[("redis", "redis")].startswith("redis:7.")
    assert images[("qdrant", "qdrant")].startswith("qdrant/qdrant:v1.")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_names_the_namespace(overlay: str, tmp_path: Path) -> None:
    """Shipped and with a user's overlay adding the model components: every object but the
    Namespace names `alise` (an object without a namespace lands in kubectl's current one, as
    the model claim of the gpu overlay once did, away from the pods that mount it)."""
    for objects in (render(overlay), render_custom(tmp_path, overlay, EXTRA[overlay])):
        elsewhere = [
            (o["kind"], o["metadata"]["name"])
            for o in objects
            if o["kind"] != "Namespace" and o["metadata"].get("namespace") != "alise"
        ]
        assert elsewhere == []


def test_the_gateway_drains_longer_than_it_resumes_within_its_grace_period() -> None:
    """A rollout or scale-down: the pod leaves the endpoints during preStop, then open streams
    run for ALISE_DRAIN_S (at least ALISE_RESUME_TIMEOUT_S, how long a stream may wait for a
    scheduler), then uvicorn closes (2 s): all within terminationGracePeriodSeconds."""
    for overlay in OVERLAYS:
        objects = render(overlay)
        gateway = apps(objects)["gateway"]
        settings = GatewaySettings(
            drain_s=env_of(objects, gateway)["ALISE_DRAIN_S"],
            resume_timeout_s=env_of(objects, gateway)["ALISE_RESUME_TIMEOUT_S"],
        )
        pre_stop = container(gateway)["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop >= 5
        assert settings.drain_s >= settings.resume_timeout_s > 0
        assert pod(gateway)["terminationGracePeriodSeconds"] > pre_stop + settings.drain_s + 2


def _spread_on(workload: dict, label: str) -> None:
    """Preferred anti-affinity by node, and a zone spread, over the workload's own pods (a
    scheduler shard's leader and standby apart)."""
    spec = pod(workload)
    (term,) = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    (spread,) = spec["topologySpreadConstraints"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["maxSkew"] == 1
    pods = workload["spec"]["template"]["metadata"]["labels"].items()
    for selector in (term["podAffinityTerm"]["labelSelector"], spread["labelSelector"]):
        assert {"app.kubernetes.io/name": label}.items() <= selector["matchLabels"].items()
        assert selector["matchLabels"].items() <= pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schedulers_and_executors_spread_with_disruption_budgets(overlay: str) -> None:
    objects = render(overlay)
    pdbs = of_kind(objects, "PodDisruptionBudget")
    for name, workload in apps(objects).items():
        _spread_on(workload, role(name))
    executors = apps(objects)["executor"]
    budget = pdbs["executor"]["spec"]
    assert budget["maxUnavailable"] == 1  # a node drain evicts one executor at a time
    assert budget["selector"]["matchLabels"] == executors["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_nodes_runtime_and_threads_from_the_cpu_limit(overlay: str) -> None:
    a = apps(render(overlay))
    gpu = overlay.startswith("gpu")
    for name, workload in a.items():
        spec = pod(workload)
        on_gpu = gpu and name == "executor"
        assert spec.get("runtimeClassName") == ("nvidia" if on_gpu else None), name
        assert spec.get("nodeSelector") == ({"nvidia.com/gpu.present": "true"} if on_gpu else None)
        tolerated = [t["key"] for t in spec.get("tolerations", [])]
        assert tolerated == (["nvidia.com/gpu"] if on_gpu else []), name
    for name, var in (("executor", "ALISE_NUM_THREADS"), ("predictor", "ALISE_PREDICTOR_THREADS")):
        (entry,) = [e for e in container(a[name])["env"] if e["name"] == var]
        field = entry["valueFrom"]["resourceFieldRef"]
        assert (field["containerName"], field["resource"]) == (name, "limits.cpu")
        assert container(a[name])["resources"]["limits"]["cpu"]


def _mounts(workload: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container(workload)["volumeMounts"]}


@pytest.mark.parametrize("overlay", ["gpu", "gpu-shards"])
def test_the_model_volume_is_mounted_read_only_where_the_model_is_read(overlay: str) -> None:
    """gpu overlays serve the model on the claim `alise-model` (ReadOnlyMany): the gateway
    (tokenizer, context length), predictors and executors mount it read-only and ALISE_MODEL
    names a directory on it; schedulers take only the model's name from the setting."""
    objects = render(overlay)
    (claim,) = [
        c for n, c in of_kind(objects, "PersistentVolumeClaim").items() if n == "alise-model"
    ]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for name, workload in apps(objects).items():
        volumes = {v["name"]: v for v in pod(workload)["volumes"]}
        if role(name) == "scheduler":
            assert "model" not in volumes
            continue
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "alise-model"
        mount = _mounts(workload)["model"]
        assert mount["readOnly"] is True
        model = env_of(objects, workload)["ALISE_MODEL"]
        assert model.startswith(mount["mountPath"].rstrip("/") + "/"), (name, model)


def test_the_model_copy_component_fills_the_volume_once(tmp_path: Path) -> None:
    """components/model-copy: each model reader first runs `alise model copy SOURCE
    $ALISE_MODEL` (a real command) with the model volume writable and the source read-only;
    the claim becomes ReadWriteMany, the serving container's mount stays read-only."""
    objects = render_custom(tmp_path, "gpu", ("model-copy",))
    claims = of_kind(objects, "PersistentVolumeClaim")
    assert claims["alise-model"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims["alise-model-source"]["spec"]["accessModes"] == ["ReadOnlyMany"]
    parser = build_parser()
    for name in ("gateway", "predictor", "executor"):
        workload = apps(objects)[name]
        (init,) = pod(workload)["initContainers"]
        assert callable(parser.parse_args(init["command"][1:]).func)
        assert init["command"][1:3] == ["model", "copy"]
        assert init["command"][4] == "$(ALISE_MODEL)"
        mounts = {m["name"]: m for m in init["volumeMounts"]}
        assert not mounts["model"].get("readOnly") and mounts["model-source"]["readOnly"]
        assert _mounts(workload)["model"]["readOnly"] is True
