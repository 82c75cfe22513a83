"""deploy/k8s against a real API server (lab/k8s_apiserver.py): `make k8s-server-check`.

First what a cluster's operators would have installed: deploy/k8s/check's minimal
ServiceMonitor CRD and the RuntimeClass `nvidia`. Then each overlay (cpu, gpu, gpu-shards, and
gpu with components/model-copy), rendered by `kubectl kustomize` and moved to a fresh namespace
`alise-<overlay>` (Pod Security `restricted` enforced, as the manifests label it), goes through
`kubectl apply --dry-run=server`, a real `kubectl apply` and a second apply that must change
nothing; every Deployment's and StatefulSet's pod template is then created as a Pod with
`--dry-run=server`, which Pod Security and RuntimeClass admission judge as they would the
controllers' pods (no controller manager or nodes run here, so no pod is really created).
Last, the upgrade paths: one overlay applied over another in one namespace, where the server
must refuse exactly the changes Kubernetes does not allow in place (a StatefulSet's selector,
a claim's access modes), and the documented remedy (delete the StatefulSet) must then apply.

`python -m lab.k8s_check [--out FILE]` prints the outcome as JSON and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from lab.k8s_apiserver import ApiServer, api_server, missing_binaries, tool_versions

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
PREREQUISITES = ("servicemonitor-crd.yaml", "runtimeclass-nvidia.yaml")
# name -> (overlay, components added to it)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu": ("cpu", ()),
    "gpu": ("gpu", ()),
    "gpu-shards": ("gpu-shards", ()),
    "gpu-model-copy": ("gpu", ("model-copy",)),
}
# (from, to, objects the server must refuse to change in place, remedy: delete them first)
UPGRADES: tuple[tuple[str, str, frozenset[str], bool], ...] = (
    ("cpu", "gpu", frozenset(), False),
    ("gpu", "gpu-shards", frozenset({"statefulset/scheduler"}), True),
    ("gpu", "gpu-model-copy", frozenset({"persistentvolumeclaim/alise-model"}), False),
)
WORKLOADS = ("Deployment", "StatefulSet")
# `StatefulSet.apps "scheduler" is invalid`, `pods "x" is forbidden` in kubectl's errors
_REFUSED = re.compile(r'(\w+(?:\.[\w.]+)?) "([^"]+)" is (?:invalid|forbidden)')


def render(variant: str, tmp: Path) -> list[dict[str, Any]]:
    """The variant's objects, as `kubectl kustomize` renders them."""
    overlay, components = VARIANTS[variant]
    target = K8S / "overlays" / overlay
    if components:
        target = tmp / f"render-{variant}"
        target.mkdir(parents=True, exist_ok=True)
        kustomization = {
            "resources": [os.path.relpath(K8S / "overlays" / overlay, target)],
            "components": [os.path.relpath(K8S / "components" / c, target) for c in components],
        }
        (target / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run(
        ["kubectl", "kustomize", str(target)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def retarget(docs: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The objects moved to `namespace` (the Namespace object renamed with them)."""
    moved = json.loads(json.dumps(docs))
    for doc in moved:
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            meta["name"] = namespace
        elif "namespace" in meta:
            meta["namespace"] = namespace
    return moved


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    """The Pod a Deployment's or StatefulSet's controller would create (a StatefulSet's claim
    templates become the claims of its first replica)."""
    template = json.loads(json.dumps(workload["spec"]["template"]))
    spec = template["spec"]
    name = workload["metadata"]["name"]
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        claim_name = claim["metadata"]["name"]
        spec.setdefault("volumes", []).append(
            {"name": claim_name, "persistentVolumeClaim": {"claimName": f"{claim_name}-{name}-0"}}
        )
    metadata = {
        "name": f"{name}-check",
        "namespace": workload["metadata"]["namespace"],
        "labels": template.get("metadata", {}).get("labels", {}),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def outcome(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """kubectl apply/create's report: objects per verb, warnings and refused objects."""
    verbs: dict[str, int] = {}
    for line in done.stdout.splitlines():
        words = line.replace("(server dry run)", "").split()
        if len(words) == 2:
            verbs[words[1]] = verbs.get(words[1], 0) + 1
    warnings, errors = [], []
    for line in done.stderr.splitlines():
        if line.startswith("Warning:"):
            warnings.append(line)
        elif line.startswith(("Error from server", "error:")) or not errors:
            errors.append(line)
        else:  # an error's continuation lines
            errors[-1] += "\n" + line
    return {"verbs": verbs, "warnings": warnings, "errors": errors, "rc": done.returncode}


def refused(errors: list[str]) -> set[str]:
    """`kind/name` (lower case) of each object an apply's errors name."""
    names = set()
    for error in errors:
        names.update(f"{kind}/{name}".lower() for kind, name in _REFUSED.findall(error))
    return names


def prepare_namespace(server: ApiServer, docs: list[dict[str, Any]]) -> None:
    """The namespace with its `default` ServiceAccount, as the controller manager makes it."""
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    name = namespace["metadata"]["name"]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": name},
    }
    server.kubectl("apply", "-f", "-", stdin=dump([namespace, account]))


def reference(doc: dict[str, Any]) -> str:
    """`kind.group/name`, as kubectl names an object."""
    group = doc["apiVersion"].rpartition("/")[0]
    return f"{doc['kind'].lower()}{'.' + group if group else ''}/{doc['metadata']['name']}"


def versions(server: ApiServer, docs: list[dict[str, Any]], namespace: str) -> dict[str, str]:
    """Each object's resourceVersion on the server (it changes with every write)."""
    refs = [reference(d) for d in docs if d["kind"] != "Namespace"]
    items = json.loads(server.kubectl("get", "-n", namespace, "-o", "json", *refs).stdout)
    return {
        f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["resourceVersion"]
        for i in items["items"]
    }


def apply_fresh(server: ApiServer, docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Dry run, apply, apply again and the workloads' pods; the report, with its failures."""
    prepare_namespace(server, docs)
    (meta,) = [d["metadata"] for d in docs if d["kind"] == "Namespace"]
    namespace, manifest = meta["name"], dump(docs)
    report: dict[str, Any] = {"objects": len(docs)}
    report["pod_security"] = meta.get("labels", {}).get("pod-security.kubernetes.io/enforce")
    report["unplaced"] = [
        reference(d) for d in docs if d["kind"] != "Namespace" and "namespace" not in d["metadata"]
    ]
    dry_run = server.kubectl("apply", "--dry-run=server", "-f", "-", stdin=manifest, check=False)
    report["dry_run"] = outcome(dry_run)
    report["apply"] = outcome(server.kubectl("apply", "-f", "-", stdin=manifest, check=False))
    before = versions(server, docs, namespace)
    report["reapply"] = outcome(server.kubectl("apply", "-f", "-", stdin=manifest, check=False))
    after = versions(server, docs, namespace)
    report["rewritten"] = sorted(k for k in after if before.get(k) != after[k])
    report["on_server"] = len(after)
    pods = [pod_of(d) for d in docs if d["kind"] in WORKLOADS]
    pod_run = server.kubectl("create", "--dry-run=server", "-f", "-", stdin=dump(pods), check=False)
    report["pods"] = outcome(pod_run)
    report["failures"] = fresh_failures(report, len(pods))
    return report


def fresh_failures(report: dict[str, Any], pods: int) -> list[str]:
    failures = [f"no namespace (lands in kubectl's current one): {r}" for r in report["unplaced"]]
    failures += [f"a second apply rewrote {r}" for r in report["rewritten"]]
    if report["pod_security"] != "restricted":
        failures.append(f"the namespace enforces {report['pod_security']}, not restricted")
    if report["on_server"] != report["objects"] - 1:
        failures.append(f"{report['on_server']} objects found, {report['objects'] - 1} applied")
    for step in ("dry_run", "apply", "reapply", "pods"):
        result = report[step]
        failures += [f"{step}: {line}" for line in result["errors"] + result["warnings"]]
        if result["rc"] != 0 and not result["errors"]:
            failures.append(f"{step}: kubectl exited with {result['rc']}")
    # the namespace exists before (prepare_namespace): every other object is new
    created = report["objects"] - 1
    expected = {
        "dry_run": {"created": created, "unchanged": 1},
        "apply": {"created": created, "unchanged": 1},
        "pods": {"created": pods},
    }
    for step, verbs in expected.items():
        if report[step]["verbs"] != verbs:
            failures.append(f"{step}: {report[step]['verbs']}, expected {verbs}")
    return failures


def upgrade(
    server: ApiServer, rendered: dict[str, list[dict[str, Any]]], path: tuple[Any, ...]
) -> dict[str, Any]:
    """`to` applied over `from` in a namespace of their own: the objects refused, compared with
    those expected; where the remedy applies, they are deleted and `to` applied again."""
    source, target, expected, remedy = path
    namespace = f"alise-{source}-to-{target}"
    first, second = retarget(rendered[source], namespace), retarget(rendered[target], namespace)
    prepare_namespace(server, first)
    server.kubectl("apply", "-f", "-", stdin=dump(first))
    over = outcome(server.kubectl("apply", "-f", "-", stdin=dump(second), check=False))
    report: dict[str, Any] = {"refused": sorted(refused(over["errors"])), "errors": over["errors"]}
    failures = []
    if set(report["refused"]) != expected or len(over["errors"]) != len(expected):
        failures.append(f"refused {report['refused']}, expected {sorted(expected)}")
    if remedy and expected:
        server.kubectl("delete", "-n", namespace, "--wait=false", *sorted(expected))
        again = outcome(server.kubectl("apply", "-f", "-", stdin=dump(second), check=False))
        report["after_delete"] = again["verbs"]
        failures += [f"after delete: {line}" for line in again["errors"]]
    report["failures"] = failures
    return report


def install_prerequisites(server: ApiServer) -> None:
    for name in PREREQUISITES:
        server.kubectl("apply", "-f", str(K8S / "check" / name))
    crd = "crd/servicemonitors.monitoring.coreos.com"
    server.kubectl("wait", "--for=condition=Established", "--timeout=60s", crd)


def run_check(server: ApiServer, variants: list[str] | None = None) -> dict[str, Any]:
    """The whole check against `server`: {"overlays": ..., "upgrades": ..., "failures": n}."""
    started = time.monotonic()
    install_prerequisites(server)
    names = variants or list(VARIANTS)
    rendered = {v: render(v, server.workdir) for v in VARIANTS}
    overlays = {v: apply_fresh(server, retarget(rendered[v], f"alise-{v}")) for v in names}
    upgrades = {
        f"{p[0]} -> {p[1]}": upgrade(server, rendered, p)
        for p in UPGRADES
        if variants is None or {p[0], p[1]} <= set(names)
    }
    reports = list(overlays.values()) + list(upgrades.values())
    return {
        "kube_apiserver": server.version(),
        "overlays": overlays,
        "upgrades": upgrades,
        "failures": sum(len(r["failures"]) for r in reports),
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    missing = missing_binaries()
    if missing:
        print(f"missing: {', '.join(missing)} (docs/kubernetes.md, 'Checks')", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="alise-k8s-") as tmp, api_server(Path(tmp)) as server:
        report = run_check(server)
    report["seconds_with_startup"] = round(time.monotonic() - started, 1)
    report.update(tool_versions(), date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count())
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
