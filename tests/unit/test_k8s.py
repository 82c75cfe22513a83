"""The Kubernetes manifests (deploy/k8s) render with kustomize and describe the same services as
`alise serve` (services/launcher/topology.py), as tests/unit/test_compose.py checks for
docker-compose.yml: same services and commands, real settings, the same ports on containers,
Services and probes, addresses that name real Services, both schedulers listed for the
gateway, non-root containers with limits and writable mounts where they write, GPUs on the gpu
overlay's executors only, and only the gateway reachable from outside. Where the
kubernetes-validate package is at hand (imported, or `make k8s-check`'s .venv-k8s), every
object is also validated against the Kubernetes 1.32 schemas (strict)."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from cli.main import build_parser
from services.common.settings import env_var_names
from services.launcher import topology
from services.launcher.topology import ServiceSpec, local_topology

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-shards")
INFRA = {"redis", "qdrant"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
K8S_VERSION = "1.32.0"
# The one variable that is not a setting: the pod's name, for ALISE_ADVERTISE_ADDRESS.
DOWNWARD_API = {"POD_NAME"}
PORTS = {
    "gateway": topology.GATEWAY_PORT,
    "predictor": topology.PREDICTOR_PORT,
    "scheduler": topology.SCHEDULER_PORT,
    "executor": topology.EXECUTOR_BASE_PORT,
}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed"
)


@functools.cache
def rendered(overlay: str) -> str:
    return subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def render(overlay: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered(overlay)) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict]:
    return render(request.param)


def of_kind(objects: list[dict], *kinds: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in kinds}


def workloads(objects: list[dict]) -> dict[str, dict]:
    return of_kind(objects, "Deployment", "StatefulSet")


def apps(objects: list[dict]) -> dict[str, dict]:
    return {n: w for n, w in workloads(objects).items() if n not in INFRA}


def role(name: str) -> str:
    """The launcher's service a workload runs (`scheduler-shard1` is a scheduler too)."""
    return name.split("-shard")[0]


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    return pod(workload)["containers"][0]


def launcher() -> dict[str, list[ServiceSpec]]:
    """The launcher's services by workload: executor-0, executor-1 -> executor; scheduler,
    scheduler-1 -> scheduler (a StatefulSet each)."""
    groups: dict[str, list[ServiceSpec]] = {}
    for spec in local_topology(2, "redis://x", num_schedulers=2):
        groups.setdefault(spec.name.split("-")[0], []).append(spec)
    return groups


def env_of(objects: list[dict], workload: dict) -> dict[str, str]:
    """The container's environment: its ConfigMap/Secret sources, then its own entries."""
    sources = of_kind(objects, "ConfigMap", "Secret")
    env: dict[str, str] = {}
    for ref in container(workload).get("envFrom", []):
        name = (ref.get("configMapRef") or ref.get("secretRef"))["name"]
        src = sources[name]
        env.update(src.get("data") or src.get("stringData") or {})
    env.update({e["name"]: e.get("value", "") for e in container(workload).get("env", [])})
    return env


def resolve(objects: list[dict], address: str) -> tuple[dict, int]:
    """The Service a `host:port` address names (`svc` or a StatefulSet pod's `pod.svc`), and
    the port, which the Service must expose."""
    host, port = address.removeprefix("dns:///").rsplit(":", 1)
    services = of_kind(objects, "Service")
    if host in services:
        service = services[host]
    else:
        pod_name, svc = host.split(".")
        service = services[svc]
        assert service["spec"].get("clusterIP") == "None", f"{svc}: pod DNS needs a headless one"
        sets = [
            w for w in of_kind(objects, "StatefulSet").values() if w["spec"]["serviceName"] == svc
        ]
        assert sets, f"{address}: no StatefulSet governs Service {svc}"
        ordinal = int(pod_name.removeprefix(sets[0]["metadata"]["name"] + "-"))
        assert 0 <= ordinal < sets[0]["spec"]["replicas"], address
    assert int(port) in [p["port"] for p in service["spec"]["ports"]], address
    return service, int(port)


def test_the_same_services_and_commands_as_the_launcher(objects: list[dict]) -> None:
    groups = launcher()
    assert {role(n) for n in apps(objects)} == set(groups)
    parser = build_parser()
    for name, workload in apps(objects).items():
        command = container(workload)["command"]
        assert command[0] == "alise"
        assert tuple(command[1:]) == groups[role(name)][0].command, name
        assert callable(getattr(parser.parse_args(command[1:]), "func", None)), command


def test_every_environment_variable_is_a_real_setting(objects: list[dict]) -> None:
    known = env_var_names() | DOWNWARD_API
    for name, cm in of_kind(objects, "ConfigMap", "Secret").items():
        keys = set(cm.get("data") or {}) | set(cm.get("stringData") or {})
        assert keys <= env_var_names(), f"{name}: {keys - env_var_names()} are not settings"
    for name, workload in apps(objects).items():
        env = env_of(objects, workload)
        assert not set(env) - known, f"{name}: {set(env) - known} are not ALISE settings"
        spec = launcher()[role(name)][0]
        assert not set(spec.env) - set(env), f"{name} lacks {set(spec.env) - set(env)}"
        for var, value in spec.env.items():
            if var.endswith("_HOST"):
                assert env[var] == "0.0.0.0", f"{name}: {var} must bind every interface"
            elif var.endswith("_PORT"):
                assert env[var] == value, f"{name}: {var} is {env[var]}, the launcher's {value}"


def test_containers_services_and_probes_use_each_service_port(objects: list[dict]) -> None:
    services = of_kind(objects, "Service")
    for name, workload in apps(objects).items():
        port = PORTS[role(name)]
        c = container(workload)
        # the gRPC services' Prometheus port (ALISE_METRICS_PORT) besides; the gateway serves
        # /metrics on its HTTP port
        metrics = (
            [] if name == "gateway" else [int(env_of(objects, workload)["ALISE_METRICS_PORT"])]
        )
        assert [p["containerPort"] for p in c["ports"]] == [port, *metrics], name
        service = services[name]
        assert [p["port"] for p in service["spec"]["ports"]] == [port, *metrics], name
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        if name == "gateway":
            assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": port}
            # Liveness must not follow readiness: a gateway is alive while the scheduler is down.
            assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": port}
            continue
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            grpc = c[probe]["grpc"]
            assert grpc["port"] == port, (name, probe)
            # The overall health status: a standby scheduler is SERVING there, and only the
            # leader serves `alise.v1.Scheduler`; naming it would kill the standby.
            assert grpc.get("service", "") == "", (name, probe)
    for name in INFRA:
        assert services[name]["spec"]["clusterIP"] == "None", name


def test_addresses_name_real_services(objects: list[dict]) -> None:
    a = apps(objects)
    gateway = env_of(objects, a["gateway"])
    schedulers = gateway["ALISE_SCHEDULER_ADDRESS"].split(",")
    assert schedulers == [f"scheduler-{i}.scheduler:{topology.SCHEDULER_PORT}" for i in range(2)]
    assert a["scheduler"]["spec"]["replicas"] == len(schedulers) == 2
    for address in schedulers:
        assert resolve(objects, address)[0]["metadata"]["name"] == "scheduler"
    predictors, port = resolve(objects, gateway["ALISE_PREDICTOR_ADDRESSES"])
    assert gateway["ALISE_PREDICTOR_ADDRESSES"].startswith("dns:///")
    assert predictors["spec"]["clusterIP"] == "None"  # one DNS name, every replica's address
    assert (predictors["metadata"]["name"], port) == ("predictor", topology.PREDICTOR_PORT)
    scheduler = env_of(objects, a["scheduler"])
    executor = env_of(objects, a["executor"])
    predictor = env_of(objects, a["predictor"])
    urls = [scheduler["ALISE_REDIS_URL"], executor["ALISE_REGISTRY_URL"]]
    urls.append(predictor["ALISE_QDRANT_URL"])
    for url in urls:
        resolve(objects, urlsplit(url).netloc)
    # Executors register where the schedulers look, under their pod DNS names.
    assert executor["ALISE_REGISTRY_URL"] == scheduler["ALISE_REDIS_URL"]
    assert scheduler["ALISE_EXECUTORS"] == ""
    advertised = executor["ALISE_ADVERTISE_ADDRESS"]
    assert advertised == f"$(POD_NAME).executor:{topology.EXECUTOR_BASE_PORT}"
    resolve(objects, advertised.replace("$(POD_NAME)", "executor-0"))
    assert container(a["executor"])["env"][0]["name"] == "POD_NAME"  # defined before its use
    pdb = of_kind(objects, "PodDisruptionBudget")["scheduler"]["spec"]
    assert pdb["minAvailable"] == 1
    assert pdb["selector"]["matchLabels"] == a["scheduler"]["spec"]["selector"]["matchLabels"]


def test_two_scheduler_shards_each_with_its_own_pods_and_the_gateway_knows_both() -> None:
    """gpu-shards: shard 0 (the base's scheduler) and shard 1 (stamped from it) each own their
    pods (Service, StatefulSet and PDB selectors do not overlap), read ALISE_SHARD 0 / 1 of
    ALISE_NUM_SHARDS 2 as the scheduler's settings, and the gateway lists each shard's leader
    and standby by their pod DNS names, the same Redis serving both."""
    from services.common.settings import GatewaySettings, SchedulerSettings
    from services.gateway.shards import shard_addresses

    objects = render("gpu-shards")
    a = apps(objects)
    services = of_kind(objects, "Service")
    pdbs = of_kind(objects, "PodDisruptionBudget")
    gateway = settings_of(GatewaySettings, env_of(objects, a["gateway"]))
    groups = shard_addresses(gateway)
    assert len(groups) == 2
    for shard, name in enumerate(("scheduler", "scheduler-shard1")):
        settings = settings_of(SchedulerSettings, env_of(objects, a[name]))
        assert (settings.shard, settings.num_shards) == (shard, 2)
        pods = a[name]["spec"]["template"]["metadata"]["labels"]
        for other in {"scheduler", "scheduler-shard1"} - {name}:
            other_pods = a[other]["spec"]["template"]["metadata"]["labels"]
            assert not services[name]["spec"]["selector"].items() <= other_pods.items()
            assert not pdbs[name]["spec"]["selector"]["matchLabels"].items() <= other_pods.items()
        assert services[name]["spec"]["selector"].items() <= pods.items()
        assert pdbs[name]["spec"]["selector"]["matchLabels"].items() <= pods.items()
        assert [resolve(objects, x)[0]["metadata"]["name"] for x in groups[shard]] == [name] * 2
        assert settings.redis_url == env_of(objects, a["scheduler"])["ALISE_REDIS_URL"]


def settings_of(cls: type, env: dict[str, str]) -> object:
    """A settings class built from a container's ALISE_* variables (the ones it knows)."""
    known = set(cls.model_fields)  # type: ignore[attr-defined]
    given = {k.removeprefix("ALISE_").lower(): v for k, v in env.items()}
    return cls(**{k: v for k, v in given.items() if k in known})


def test_containers_run_as_non_root_with_limits(objects: list[dict]) -> None:
    for name, workload in workloads(objects).items():
        spec = pod(workload)
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] > 0, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)


def test_writable_mounts_where_the_services_write(objects: list[dict]) -> None:
    for name, workload in workloads(objects).items():
        spec = pod(workload)
        claims = [t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])]
        volumes = [v["name"] for v in spec.get("volumes", [])] + claims
        mounts = {m["mountPath"]: m["name"] for m in container(workload)["volumeMounts"]}
        assert set(mounts.values()) <= set(volumes), name
        if name in INFRA:
            continue
        data_dir = env_of(objects, workload)["ALISE_DATA_DIR"]
        assert {data_dir, "/tmp", "/home/alise"} <= set(mounts), name  # data, temp, caches
    redis = of_kind(objects, "StatefulSet")["redis"]
    args = " ".join(container(redis)["command"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args and "/data" in args
    redis_mounts = {m["mountPath"]: m["name"] for m in container(redis)["volumeMounts"]}
    assert redis_mounts["/data"] == redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    qdrant = of_kind(objects, "StatefulSet")["qdrant"]
    qdrant_mounts = {m["mountPath"]: m["name"] for m in container(qdrant)["volumeMounts"]}
    assert (
        qdrant_mounts["/qdrant/storage"]
        == (qdrant["spec"]["volumeClaimTemplates"][0]["metadata"]["name"])
    )


def test_gpus_and_images_per_overlay() -> None:
    for overlay in OVERLAYS:
        objects = render(overlay)
        for name, workload in workloads(objects).items():
            resources = container(workload)["resources"]
            gpus = {k: resources[k].get("nvidia.com/gpu") for k in ("requests", "limits")}
            gpu = overlay.startswith("gpu")
            wanted = 1 if gpu and name == "executor" else None
            assert gpus == {"requests": wanted, "limits": wanted}, (overlay, name)
        a = apps(objects)
        assert env_of(objects, a["executor"])["ALISE_DEVICE"] == ("cuda" if gpu else "cpu")
        executor_image = "alise-executor:latest" if gpu else "alise:latest"
        assert container(a["executor"])["image"] == executor_image
        for name in ("gateway", "predictor", "scheduler"):
            assert container(a[name])["image"] == "alise:latest", name
    tolerations = pod(workloads(render("gpu"))["executor"])["tolerations"]
    assert tolerations[0]["key"] == "nvidia.com/gpu"


def test_only_the_gateway_is_reachable_from_outside(objects: list[dict]) -> None:
    policies = list(of_kind(objects, "NetworkPolicy").values())
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"], "no default-deny ingress"
    rules = [(p, rule) for p in policies for rule in p["spec"].get("ingress", [])]
    monitoring = {"namespaceSelector": {"matchLabels": MONITORING}}
    for _, rule in rules:  # sources other than pods of this namespace: Prometheus, on metrics
        for source in rule.get("from", []):
            assert set(source) == {"podSelector"} or source == monitoring, source
            if source == monitoring:
                assert {p["port"] for p in rule["ports"]} == {9100, topology.GATEWAY_PORT}
    open_to_all = [(p, rule) for p, rule in rules if "from" not in rule]
    gateway_labels = {"matchLabels": {"app.kubernetes.io/name": "gateway"}}
    assert [p["spec"]["podSelector"] for p, _ in open_to_all] == [gateway_labels]
    assert open_to_all[0][1]["ports"] == [{"port": topology.GATEWAY_PORT, "protocol": "TCP"}]
    services = of_kind(objects, "Service")
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services.values())
    paths = [
        p
        for i in of_kind(objects, "Ingress").values()
        for r in i["spec"]["rules"]
        for p in r["http"]["paths"]
    ]
    backends = {
        (p["backend"]["service"]["name"], p["backend"]["service"]["port"]["number"]) for p in paths
    }
    assert backends == {("gateway", topology.GATEWAY_PORT)}


def test_autoscalers_secret_and_service_monitor(objects: list[dict]) -> None:
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    deployments = of_kind(objects, "Deployment")
    assert {n: h["spec"]["scaleTargetRef"]["name"] for n, h in hpas.items()} == {
        "gateway": "gateway",
        "predictor": "predictor",
    }
    custom = {}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        # the autoscaler owns the count: a `replicas` in the manifest resets it on each apply
        assert "replicas" not in deployments[name]["spec"], name
        assert hpa["spec"]["minReplicas"] >= 2, name
        pods = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        custom[name] = [m["metric"]["name"] for m in pods]
    # gateways on their streams in flight, predictors on their Predict calls in flight: the
    # series the services export (alise:... renamed by prometheus-adapter's rules)
    assert custom == {
        "gateway": ["alise_gateway_active_streams"],
        "predictor": ["alise_predictor_predict_in_flight"],
    }
    rules = (K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text()
    for series in ("alise:gateway_active_streams", "alise:predictor_predict_in_flight"):
        assert series in rules
    secret = of_kind(objects, "Secret")["alise-api-keys"]
    assert set(secret["stringData"]) == {"ALISE_API_KEYS"}
    gateway = apps(objects)["gateway"]
    assert {"secretRef": {"name": "alise-api-keys"}} in container(gateway)["envFrom"]
    assert all(
        r != {"secretRef": {"name": "alise-api-keys"}}
        for w in apps(objects).values()
        if w is not gateway
        for r in container(w)["envFrom"]
    )


def test_internal_token_and_redis_password_come_from_secrets(objects: list[dict]) -> None:
    """Every ALISE service takes the internal plane's token from its Secret; every one that
    reaches Redis (a Redis or registry URL) takes Redis's password from the alise-redis Secret,
    which redis-server requires (`--requirepass`, no start while empty) and its probe uses."""
    secrets = of_kind(objects, "Secret")
    assert set(secrets["alise-internal-token"]["stringData"]) == {"ALISE_INTERNAL_TOKEN"}
    assert set(secrets["alise-redis"]["stringData"]) == {"ALISE_REDIS_PASSWORD"}
    for name, workload in apps(objects).items():
        refs = container(workload)["envFrom"]
        assert {"secretRef": {"name": "alise-internal-token"}} in refs, name
        env = env_of(objects, workload)
        uses_redis = bool(env.get("ALISE_REDIS_URL") and role(name) != "predictor")
        uses_redis |= role(name) == "executor" and bool(env.get("ALISE_REGISTRY_URL"))
        assert ({"secretRef": {"name": "alise-redis"}} in refs) == uses_redis, name
        assert "ALISE_REDIS_PASSWORD" not in {e["name"] for e in container(workload)["env"]}
    redis = container(workloads(objects)["redis"])
    script = " ".join(redis["command"])
    assert 'test -n "$REDIS_PASSWORD"' in script and '--requirepass "$REDIS_PASSWORD"' in script
    (source,) = [e for e in redis["env"] if e["name"] == "REDIS_PASSWORD"]
    assert source["valueFrom"]["secretKeyRef"] == {
        "name": "alise-redis",
        "key": "ALISE_REDIS_PASSWORD",
    }
    assert "REDISCLI_AUTH" in " ".join(redis["readinessProbe"]["exec"]["command"])


def test_every_service_is_scraped(objects: list[dict]) -> None:
    """A ServiceMonitor per ALISE service (no schema for the Prometheus operator's CRD in
    kubernetes-validate: checked here), each selecting the Services of its pods and naming the
    port where the container serves its metrics."""
    monitors = of_kind(objects, "ServiceMonitor")
    services = of_kind(objects, "Service")
    for name, workload in apps(objects).items():
        monitor = monitors[role(name)]
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        service = services[name]
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        assert selector <= service["metadata"]["labels"].items(), name
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        env = env_of(objects, workload)
        wanted = env["ALISE_GATEWAY_PORT"] if name == "gateway" else env["ALISE_METRICS_PORT"]
        assert port["port"] == int(wanted), name
        assert int(wanted) in [p["containerPort"] for p in container(workload)["ports"]], name


def _validate_with_cli(cli: Path, overlay: str, tmp_path: Path) -> None:
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(rendered(overlay))
    result = subprocess.run(
        [str(cli), "--strict", "--no-warn", "-k", K8S_VERSION, str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed for resource statefulset/scheduler" in result.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_the_kubernetes_schemas(overlay: str, tmp_path: Path) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        cli = ROOT / ".venv-k8s" / "bin" / "kubernetes-validate"
        if not cli.exists():
            pytest.skip("kubernetes-validate is not installed (`make k8s-check` installs it)")
        return _validate_with_cli(cli, overlay, tmp_path)
    for obj in render(overlay):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema there (test_autoscalers_secret_and_service_monitor)
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
