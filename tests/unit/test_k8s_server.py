"""deploy/k8s applied to a real kube-apiserver (with etcd) on loopback (lab/k8s_apiserver.py,
lab/k8s_check.py): every overlay passes `kubectl apply --dry-run=server`, a real apply and a
second apply that changes nothing, its pods pass Pod Security `restricted` and RuntimeClass
admission, and the upgrade paths between overlays are refused exactly where Kubernetes forbids
a change in place. The server is shown to refuse what rendering cannot catch (an unknown kind,
an unknown field, a pod that breaks `restricted`, a missing RuntimeClass), so its acceptance
means something. Skipped where kube-apiserver, etcd, kubectl or openssl is missing
(docs/kubernetes.md, "Checks")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.k8s_apiserver import ApiServer, api_server, missing_binaries
from lab.k8s_check import UPGRADES, VARIANTS, dump, pod_of, render, retarget, run_check

pytestmark = [
    pytest.mark.skipif(
        bool(missing_binaries()),
        reason=f"no API server to apply to: {', '.join(missing_binaries())} missing",
    ),
    pytest.mark.slow,  # ~30 s of CPU time; 40-70 s on the shared development machine
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    with api_server(tmp_path_factory.mktemp("apiserver")) as running:
        yield running


@pytest.fixture(scope="module")
def report(server: ApiServer) -> dict[str, Any]:
    return run_check(server)


def test_every_overlay_applies_to_a_real_api_server(report: dict[str, Any]) -> None:
    assert report["kube_apiserver"].startswith("v1.32"), report["kube_apiserver"]
    assert report["failures"] == 0, json.dumps(report, indent=1)
    assert set(report["overlays"]) == set(VARIANTS)
    for name, overlay in report["overlays"].items():
        objects = overlay["objects"]  # the namespace first (made beforehand), then the rest
        assert objects >= 28, name
        created = {"created": objects - 1, "unchanged": 1}
        assert overlay["dry_run"]["verbs"] == created, name
        assert overlay["apply"]["verbs"] == created, name
        assert overlay["on_server"] == objects - 1, name
        # kubectl reports a few objects "configured" on every apply (the Secret's stringData,
        # StatefulSets' claim templates, ...), but a second apply writes nothing
        assert overlay["rewritten"] == [], name
        assert overlay["unplaced"] == [], name
        assert overlay["pods"]["verbs"]["created"] >= 6, name


def test_upgrades_are_refused_where_kubernetes_forbids_the_change(report: dict[str, Any]) -> None:
    upgrades = report["upgrades"]
    assert len(upgrades) == len(UPGRADES)
    assert upgrades["cpu -> gpu"]["refused"] == []
    # gpu-shards labels shard 0's selector: delete the StatefulSet first (docs/kubernetes.md)
    shards = upgrades["gpu -> gpu-shards"]
    assert shards["refused"] == ["statefulset/scheduler"]
    assert "Forbidden" in shards["errors"][0]
    assert shards["after_delete"].get("created") == 1, shards
    # model-copy turns the model claim ReadWriteMany: a claim's access modes are immutable
    copy = upgrades["gpu -> gpu-model-copy"]
    assert copy["refused"] == ["persistentvolumeclaim/alise-model"]
    assert "immutable" in copy["errors"][0]


def refusal(server: ApiServer, doc: dict[str, Any]) -> str:
    done = server.kubectl("apply", "--dry-run=server", "-f", "-", stdin=dump([doc]), check=False)
    assert done.returncode != 0, f"accepted: {doc['kind']} {doc['metadata']['name']}"
    return done.stderr


def test_the_server_refuses_what_rendering_cannot_catch(server: ApiServer, tmp_path: Path) -> None:
    docs = retarget(render("gpu", tmp_path), "alise-refusals")
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    server.kubectl("apply", "-f", "-", stdin=dump([namespace]))
    server.kubectl("create", "serviceaccount", "default", "-n", "alise-refusals")
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    unknown_kind = {**monitor, "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor"}
    assert 'no matches for kind "PodMonitor"' in refusal(server, unknown_kind)
    typo = json.loads(json.dumps(monitor))
    typo["spec"]["endpoints"][0]["intervall"] = "15s"
    assert 'unknown field "spec.endpoints[0].intervall"' in refusal(server, typo)
    executor = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "executor"
    )
    root = pod_of(executor)
    root["spec"]["securityContext"]["runAsNonRoot"] = False
    assert "violates PodSecurity" in refusal(server, root)
    no_runtime = pod_of(executor)
    no_runtime["spec"]["runtimeClassName"] = "nvidia-missing"
    assert 'RuntimeClass "nvidia-missing" not found' in refusal(server, no_runtime)
