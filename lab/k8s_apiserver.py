"""A real Kubernetes API server on loopback, for checks that rendering cannot make: etcd and
kube-apiserver started in a temporary directory (a generated CA and serving certificate, a
service-account signing key, one static token in `system:masters`, RBAC, the default
admission plugins with PodSecurity and RuntimeClass), and a kubeconfig for kubectl.

lab/k8s_check.py (`make k8s-server-check`) applies every overlay of deploy/k8s to it. The
binaries are looked up in $KUBE_APISERVER and $ETCD, then on PATH, then in
~/.cache/alise-k8s/bin; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "alise-k8s" / "bin"
BINARIES = {"kube-apiserver": "KUBE_APISERVER", "etcd": "ETCD"}
READY_TIMEOUT_S = 120.0


def find_binary(name: str) -> str | None:
    """`name`'s path from its environment variable, PATH or the cache; None if absent."""
    explicit = os.environ.get(BINARIES[name])
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    cached = CACHE_BIN / name
    return shutil.which(name) or (str(cached) if os.access(cached, os.X_OK) else None)


def missing_binaries() -> list[str]:
    names = [n for n in BINARIES if find_binary(n) is None]
    return names + [t for t in ("kubectl", "openssl") if shutil.which(t) is None]


def tool_versions() -> dict[str, str]:
    """etcd's and kubectl's versions, for the check's report."""
    etcd = subprocess.run([str(find_binary("etcd")), "--version"], capture_output=True, text=True)
    kubectl = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True)
    return {
        "etcd": etcd.stdout.split("\n")[0].removeprefix("etcd Version: "),
        "kubectl": json.loads(kubectl.stdout)["clientVersion"]["gitVersion"],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ApiServer:
    url: str
    kubeconfig: Path
    workdir: Path

    @property
    def cache(self) -> Path:
        return self.workdir / "kube-cache"

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """kubectl against this server; raises with kubectl's stderr when `check` and it fails."""
        done = subprocess.run(
            [
                "kubectl",
                "--kubeconfig",
                str(self.kubeconfig),
                "--cache-dir",
                str(self.cache),
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def version(self) -> str:
        out = self.kubectl("version", "-o", "json").stdout
        return str(json.loads(out)["serverVersion"]["gitVersion"])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def write_pki(pki: Path) -> None:
    """A CA, the server's certificate for 127.0.0.1 signed by it, and the service-account key."""
    pki.mkdir(parents=True)
    new_key = ["-newkey", "rsa:2048", "-nodes"]
    ca = ["-x509", *new_key, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=alise-check-ca"]
    _openssl("req", *ca, "-days", "2", cwd=pki)
    csr = [*new_key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kube-apiserver"]
    _openssl("req", *csr, cwd=pki)
    (pki / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    sign = ["-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"]
    _openssl(
        "x509", "-req", *sign, "-out", "server.crt", "-extfile", "san.ext", "-days", "2", cwd=pki
    )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)


def apiserver_args(workdir: Path, etcd_url: str, port: int) -> list[str]:
    pki = workdir / "pki"
    return [
        f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={workdir / 'certs'}",
        f"--tls-cert-file={pki / 'server.crt'}",
        f"--tls-private-key-file={pki / 'server.key'}",
        f"--token-auth-file={workdir / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.key'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-cluster-ip-range=10.96.0.0/16",
        # the defaults (NamespaceLifecycle, ServiceAccount, PodSecurity, RuntimeClass,
        # DefaultStorageClass, ...) named explicitly where the check relies on them
        "--enable-admission-plugins=PodSecurity,RuntimeClass,ServiceAccount,NamespaceLifecycle",
        # no controller manager or nodes: do not publish the server's own address
        "--endpoint-reconciler-type=none",
        "--profiling=false",
    ]


def etcd_args(data: Path, client: int, peer: int) -> list[str]:
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    return [
        "--name=check",
        f"--data-dir={data}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=check={peer_url}",
        "--listen-metrics-urls=",
        "--log-level=warn",
    ]


def wait_until(
    probe: str, proc: subprocess.Popen[bytes], ctx: ssl.SSLContext | None, token: str = ""
) -> None:
    """Poll `probe` (a URL) until it answers 200 "ok"-like, or fail when `proc` exits or time
    runs out (with the tail of its log)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    request = urllib.request.Request(probe, headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(request, None, 5, context=ctx) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{probe} not ready after {READY_TIMEOUT_S:.0f} s")


def write_kubeconfig(workdir: Path, url: str, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "check",
                "cluster": {"server": url, "certificate-authority": str(workdir / "pki/ca.crt")},
            }
        ],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "check", "context": {"cluster": "check", "user": "admin"}}],
        "current-context": "check",
    }
    path = workdir / "kubeconfig"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _start(name: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    binary = find_binary(name)
    if binary is None:
        raise FileNotFoundError(f"{name} not found ({BINARIES[name]}, PATH, {CACHE_BIN})")
    with log.open("wb") as out:
        return subprocess.Popen([binary, *args], stdout=out, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def api_server(workdir: Path) -> Iterator[ApiServer]:
    """etcd and kube-apiserver on free loopback ports under `workdir`, stopped on exit."""
    write_pki(workdir / "pki")
    token = secrets.token_hex(16)
    (workdir / "tokens.csv").write_text(f'{token},alise-check,alise-check,"system:masters"\n')
    client, peer, port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    # etcd syncs every write to disk: in memory (/dev/shm) where there is one, as CI runs do
    shm = Path("/dev/shm")
    data = Path(tempfile.mkdtemp(prefix="alise-etcd-", dir=shm if shm.is_dir() else workdir))
    try:
        etcd = _start("etcd", etcd_args(data, client, peer), workdir / "etcd.log")
        procs.append(etcd)
        wait_until(f"http://127.0.0.1:{client}/health", etcd, None)
        args = apiserver_args(workdir, f"http://127.0.0.1:{client}", port)
        apiserver = _start("kube-apiserver", args, workdir / "kube-apiserver.log")
        procs.append(apiserver)
        url = f"https://127.0.0.1:{port}"
        ctx = ssl.create_default_context(cafile=str(workdir / "pki/ca.crt"))
        wait_until(f"{url}/readyz", apiserver, ctx, token)
        yield ApiServer(url, write_kubeconfig(workdir, url, token), workdir)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(data, ignore_errors=True)
