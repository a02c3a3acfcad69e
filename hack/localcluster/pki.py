"""The local CA, component certificates, ServiceAccount key, token file and kubeconfigs (openssl)."""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .layout import ClusterError, Layout
from .node import NODE_IP, NODE_NAME

def openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise ClusterError("openssl is missing: install it (apt-get install openssl)")
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed: {proc.stderr.strip().splitlines()[-1:]}")


def issue_cert(pki: Path, name: str, cn: str, sans: str = "", org: str = "", ca: str = "ca") -> None:
    """An EC P-256 key and a cert signed by the local CA `ca` (server and client usage)."""
    ext = pki / f"{name}.ext"
    lines = ["keyUsage=critical,digitalSignature,keyEncipherment", "extendedKeyUsage=serverAuth,clientAuth"]
    if sans:
        lines.append(f"subjectAltName={sans}")
    ext.write_text("\n".join(lines) + "\n")
    subject = f"/CN={cn}" + (f"/O={org}" if org else "")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-set_serial", f"0x{secrets.token_hex(16)}", "-days", "3650", "-extfile", ext.name,
            "-out", f"{name}.crt", cwd=pki)


def make_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-subj", "/CN=consort-local-ca", cwd=pki)
    loopback = "IP:127.0.0.1,DNS:localhost"
    apiserver_sans = (f"{loopback},IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,"
                      "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    issue_cert(pki, "apiserver", "kube-apiserver", apiserver_sans)
    issue_cert(pki, "etcd", "etcd", loopback)
    issue_cert(pki, "apiserver-etcd-client", "kube-apiserver-etcd-client")
    issue_cert(pki, "kwok", "kwok", loopback)
    # The real node (node.py): the kubelet serves on the node's bridge address; the apiserver
    # authenticates to kubelets (logs, exec, port-forward) with a client cert.
    issue_cert(pki, "kubelet", "consort-node-0", f"IP:{NODE_IP},{loopback}")
    issue_cert(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", org="system:masters")
    # Front-proxy (requestheader) CA: kube-controller-manager and kube-scheduler read it for their
    # delegated authentication, and aggregated API servers need it.
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt", "-days", "3650",
            "-subj", "/CN=consort-local-front-proxy-ca", cwd=pki)
    issue_cert(pki, "front-proxy-client", "front-proxy-client", ca="front-proxy-ca")
    # ServiceAccount tokens are signed ES256: an EC key is generated in milliseconds, RSA is not.
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key", cwd=pki)
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for p in pki.iterdir():
        if p.suffix in (".key",):
            p.chmod(0o600)


@dataclass(frozen=True)
class Identity:
    """A token-file user; components get their real RBAC identities, people get system:masters."""

    name: str  # kubeconfig file stem
    user: str
    groups: tuple[str, ...]


IDENTITIES = (
    Identity("admin", "consort-admin", ("system:masters",)),
    Identity("kube-controller-manager", "system:kube-controller-manager", ()),
    Identity("kube-scheduler", "system:kube-scheduler", ()),
    Identity("kwok", "kwok-controller", ("system:masters",)),
    # The real node's identities, authorized by the Node authorizer and the default RBAC bindings.
    Identity("kubelet", f"system:node:{NODE_NAME}", ("system:nodes",)),
    Identity("kube-proxy", "system:kube-proxy", ()),
)


def kubeconfig_text(server: str, ca_file: Path, token: str, user: str) -> str:
    ca = base64.b64encode(ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "consort-local", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "consort-local", "context": {"cluster": "consort-local", "user": user}}],
        "current-context": "consort-local",
    }
    return json.dumps(config, indent=2) + "\n"  # JSON is YAML; no PyYAML needed here


def write_credentials(layout: Layout, apiserver_port: int) -> None:
    server = f"https://127.0.0.1:{apiserver_port}"
    rows = []
    for ident in IDENTITIES:
        token = secrets.token_urlsafe(32)
        groups = ",".join(ident.groups)
        rows.append(f'{token},{ident.user},{ident.user}' + (f',"{groups}"' if groups else ""))
        path = layout.kubeconfig if ident.name == "admin" else layout.component_kubeconfig(ident.name)
        path.write_text(kubeconfig_text(server, layout.pki / "ca.crt", token, ident.user))
        path.chmod(0o600)
    tokens = layout.pki / "tokens.csv"
    tokens.write_text("\n".join(rows) + "\n")
    tokens.chmod(0o600)
