"""Runs the local Kubernetes control plane as background processes on 127.0.0.1.

Called by hack/controlplane.sh (up|down|status|env) after the binaries are built. Standard library
only, so it also runs under a bare python3. The cluster is: etcd (TLS, client-cert auth) ->
kube-apiserver (TLS, token auth, RBAC) -> kube-controller-manager + kube-scheduler (their own
RBAC identities) -> kwok (fakes kubelets: nodes Ready, pods Running) plus kwok Nodes, two of which
advertise nvidia.com/gpu.

Everything lives in one state dir (CONSORT_CLUSTER_DIR, default ~/.cache/consort/cluster):
pki/, logs/, pids/, etcd/, the kubeconfig and state.json (ports, timings). A process belongs to
the cluster when its command line names that dir, which is how stale processes from an earlier
run are found and stopped. Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.0.0.1/16"  # kwok hands out fake pod IPs from here; nothing ever dials them
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STAGES = ("node-initialize", "node-heartbeat-with-lease", "pod-ready", "pod-complete", "pod-delete")


class ClusterError(RuntimeError):
    """A failure with a one-line explanation for the user."""


class NotYet(Exception):
    """Raised by a wait_for check to report what it saw while its condition does not hold yet."""


# --- layout and state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    root: Path
    bin_dir: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def stages_file(self) -> Path:
        return self.bin_dir.parent / "share" / "kwok" / "stages.yaml"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def component_kubeconfig(self, name: str) -> Path:
        return self.root / f"{name}.kubeconfig"


@dataclass
class Ports:
    etcd: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


@dataclass
class State:
    ports: Ports
    started_at: float
    apiserver_ready_s: float = 0.0
    ready_s: float = 0.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: Path) -> State | None:
        try:
            raw = json.loads(path.read_text())
            return State(**{**raw, "ports": Ports(**raw["ports"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None


# --- bounded waiting -----------------------------------------------------------------------------


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Polls `check` until it returns a truthy value; a raised ClusterError aborts at once."""
    deadline = time.monotonic() + timeout
    last: object = "no observation yet"
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except ClusterError:
            raise
        except NotYet as exc:
            last = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is an observation to report
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}: {last}")
        time.sleep(interval)


# --- ports ----------------------------------------------------------------------------------------


def choose_free_ports(count: int) -> list[int]:
    """Ports the kernel says are free on 127.0.0.1, all distinct (sockets held until all chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# --- pki and credentials -------------------------------------------------------------------------


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
)


def kubeconfig_text(server: str, ca_file: Path, token: str, user: str) -> str:
    import base64

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


# --- component command lines (pure) --------------------------------------------------------------


def component_argv(name: str, layout: Layout, ports: Ports) -> list[str]:
    pki = layout.pki
    binary = str(layout.binary(name))
    if name == "etcd":
        client = f"https://127.0.0.1:{ports.etcd}"
        peer = f"https://127.0.0.1:{ports.etcd_peer}"
        return [
            binary, "--name=consort", f"--data-dir={layout.root / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=consort={peer}", "--initial-cluster-state=new",
            f"--cert-file={pki / 'etcd.crt'}", f"--key-file={pki / 'etcd.key'}",
            f"--trusted-ca-file={pki / 'ca.crt'}", "--client-cert-auth",
            f"--peer-cert-file={pki / 'etcd.crt'}", f"--peer-key-file={pki / 'etcd.key'}",
            f"--peer-trusted-ca-file={pki / 'ca.crt'}", "--peer-client-cert-auth",
            # A throwaway test store: durability is not worth an fsync per write on a shared disk.
            "--unsafe-no-fsync", "--log-level=warn",
        ]
    if name == "kube-apiserver":
        return [
            binary,
            f"--etcd-servers=https://127.0.0.1:{ports.etcd}", f"--etcd-cafile={pki / 'ca.crt'}",
            f"--etcd-certfile={pki / 'apiserver-etcd-client.crt'}",
            f"--etcd-keyfile={pki / 'apiserver-etcd-client.key'}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports.apiserver}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--anonymous-auth=false",
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No real endpoints: the `kubernetes` Service must not point at loopback.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", "--shutdown-delay-duration=0s",
        ]
    if name in ("kube-controller-manager", "kube-scheduler"):
        kubeconfig = layout.component_kubeconfig(name)
        port = ports.controller_manager if name == "kube-controller-manager" else ports.scheduler
        argv = [
            binary, f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            # One instance, and a restart must not wait out a stale lease left in etcd.
            "--leader-elect=false",
        ]
        if name == "kube-controller-manager":
            argv += [
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--controllers=*,-cloud-node-lifecycle-controller,-service-lb-controller,-node-route-controller",
                "--cluster-name=consort", "--kube-api-qps=100", "--kube-api-burst=200",
            ]
        return argv
    if name == "kwok":
        return [
            binary, f"--kubeconfig={layout.component_kubeconfig('kwok')}", f"--config={layout.stages_file}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--cidr={POD_CIDR}", "--node-ip=10.0.0.1", f"--node-port={ports.kwok}",
            f"--server-address=127.0.0.1:{ports.kwok}",
            f"--tls-cert-file={pki / 'kwok.crt'}", f"--tls-private-key-file={pki / 'kwok.key'}",
            "--node-lease-duration-seconds=40",
        ]
    raise ValueError(f"unknown component {name}")


# --- nodes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    name: str
    cpu: str
    memory: str
    gpus: int


def default_nodes(gpu_nodes: int, cpu_nodes: int) -> list[NodeSpec]:
    gpu = [NodeSpec(f"kwok-gpu-{i}", "64", "512Gi", 8) for i in range(gpu_nodes)]
    cpu = [NodeSpec(f"kwok-cpu-{i}", "16", "64Gi", 0) for i in range(cpu_nodes)]
    return gpu + cpu


def node_manifest(spec: NodeSpec) -> dict:
    capacity = {"cpu": spec.cpu, "memory": spec.memory, "pods": "110", "ephemeral-storage": "1Ti"}
    labels = {
        "kubernetes.io/hostname": spec.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "type": "kwok", "node.kubernetes.io/instance-type": "kwok-gpu-8" if spec.gpus else "kwok-cpu",
    }
    if spec.gpus:
        capacity["nvidia.com/gpu"] = str(spec.gpus)
        labels["nvidia.com/gpu.present"] = "true"
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels,
                     "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"}},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


# --- processes ------------------------------------------------------------------------------------


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def belongs_to(pid: int, layout: Layout) -> bool:
    """True when pid is a live control-plane process of this state dir (pids get recycled)."""
    argv = cmdline(pid)
    if not argv or Path(argv[0]).name not in COMPONENTS:
        return False
    root = str(layout.root)
    return any(root in arg for arg in argv[1:])


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cluster_pids(layout: Layout) -> dict[str, int]:
    """Live processes of this cluster, from pid files and from a /proc scan (lost pid files)."""
    found: dict[str, int] = {}
    for name in COMPONENTS:
        try:
            pid = int((layout.pids / f"{name}.pid").read_text())
        except (OSError, ValueError):
            continue
        if belongs_to(pid, layout) and not is_zombie(pid):
            found[name] = pid
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in found.values():
            pid = int(entry.name)
            if belongs_to(pid, layout) and not is_zombie(pid):
                found.setdefault(f"{Path(cmdline(pid)[0]).name}#{pid}", pid)
    return found


def stop_processes(layout: Layout, timeout: float = 15.0) -> list[str]:
    """SIGTERM in reverse start order, then SIGKILL what is left after `timeout`."""
    pids = cluster_pids(layout)
    order = sorted(pids, key=lambda n: -COMPONENTS.index(n.split("#")[0]))
    for name in order:
        try:
            os.kill(pids[name], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(belongs_to(p, layout) and not is_zombie(p) for p in pids.values()):
        time.sleep(0.1)
    for name, pid in pids.items():
        if belongs_to(pid, layout) and not is_zombie(pid):
            print(f"cluster: {name} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; killing it", file=sys.stderr)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return order


def start_process(name: str, argv: list[str], layout: Layout) -> subprocess.Popen:
    if not Path(argv[0]).exists():
        raise ClusterError(f"{argv[0]} is missing: run `make controlplane` (hack/controlplane.sh build)")
    with layout.log(name).open("ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=layout.root)
    (layout.pids / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc


def log_tail(layout: Layout, name: str, lines: int = 15) -> str:
    try:
        return "\n".join(layout.log(name).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- probes ---------------------------------------------------------------------------------------


def https_get(url: str, context: ssl.SSLContext, token: str | None = None, timeout: float = 2.0) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=context, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def admin_token(layout: Layout) -> str:
    return json.loads(layout.kubeconfig.read_text())["users"][0]["user"]["token"]


def ca_context(layout: Layout, client_cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    if client_cert:
        context.load_cert_chain(str(layout.pki / f"{client_cert}.crt"), str(layout.pki / f"{client_cert}.key"))
    return context


def self_signed_context() -> ssl.SSLContext:
    # kube-controller-manager and kube-scheduler serve /healthz with an in-memory self-signed cert.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def apiserver_ready(layout: Layout, ports: Ports) -> bool:
    try:
        status, body = https_get(f"https://127.0.0.1:{ports.apiserver}/readyz", ca_context(layout), admin_token(layout))
    except (OSError, ValueError):
        return False
    return status == 200 and body.strip() == "ok"


class Probe:
    """Checks one readiness condition and fails fast when the process it depends on died."""

    def __init__(self, layout: Layout, procs: dict[str, subprocess.Popen]):
        self.layout = layout
        self.procs = procs

    def alive(self, *names: str) -> None:
        for name in names:
            code = self.procs[name].poll()
            if code is not None:
                raise ClusterError(f"{name} exited with code {code} during start-up; last log lines "
                                   f"({self.layout.log(name)}):\n{log_tail(self.layout, name)}")

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.layout.binary("kubectl")), f"--kubeconfig={self.layout.kubeconfig}",
                               "--request-timeout=10s", *args], input=input, capture_output=True, text=True,
                              timeout=30)


# --- commands -------------------------------------------------------------------------------------


def running_state(layout: Layout) -> State | None:
    """The saved state when the whole cluster is up and the apiserver is ready, else None."""
    state = State.load(layout.state_file)
    if state is None or not layout.kubeconfig.exists():
        return None
    pids = cluster_pids(layout)
    if any(name not in pids for name in COMPONENTS):
        return None
    return state if apiserver_ready(layout, state.ports) else None


def up(layout: Layout, gpu_nodes: int, cpu_nodes: int, timeout: float) -> int:
    t0 = time.monotonic()
    state = running_state(layout)
    if state is not None:
        print(f"cluster: already running (apiserver https://127.0.0.1:{state.ports.apiserver})", file=sys.stderr)
        print(layout.kubeconfig)
        return 0
    stale = stop_processes(layout)
    if stale:
        print(f"cluster: stopped stale processes from an earlier run: {', '.join(stale)}", file=sys.stderr)
    if not layout.stages_file.exists():
        raise ClusterError(f"{layout.stages_file} is missing: run `make controlplane` (hack/controlplane.sh build)")
    for attempt in (1, 2):
        try:
            return start_cluster(layout, gpu_nodes, cpu_nodes, timeout, t0)
        except PortTaken as exc:
            stop_processes(layout)
            if attempt == 2:
                raise ClusterError(str(exc)) from None
            print(f"cluster: {exc}; retrying with new ports", file=sys.stderr)
        except (ClusterError, KeyboardInterrupt):
            # Never leave a half-started cluster running; its logs stay for the post-mortem.
            stop_processes(layout)
            raise
    return 1


class PortTaken(ClusterError):
    pass


def start_cluster(layout: Layout, gpu_nodes: int, cpu_nodes: int, timeout: float, t0: float) -> int:
    if layout.root.exists():
        shutil.rmtree(layout.root)
    for d in (layout.root, layout.pki, layout.logs, layout.pids):
        d.mkdir(parents=True, exist_ok=True)
    layout.root.chmod(0o700)
    ports = Ports(*choose_free_ports(6))
    make_pki(layout.pki)
    write_credentials(layout, ports.apiserver)
    state = State(ports=ports, started_at=time.time())
    state.save(layout.state_file)
    procs: dict[str, subprocess.Popen] = {}
    probe = Probe(layout, procs)

    def launch(name: str) -> None:
        procs[name] = start_process(name, component_argv(name, layout, ports), layout)

    def check_alive(*names: str) -> None:
        try:
            probe.alive(*names)
        except ClusterError as exc:
            if "address already in use" in str(exc):
                raise PortTaken(f"a port was taken between choosing and binding it ({exc.args[0].splitlines()[0]})")
            raise

    def etcd_healthy() -> bool:
        check_alive("etcd")
        status, body = https_get(f"https://127.0.0.1:{ports.etcd}/health", ca_context(layout, "apiserver-etcd-client"))
        return status == 200 and json.loads(body).get("health") == "true"

    launch("etcd")
    wait_for(etcd_healthy, timeout, f"etcd to report healthy on https://127.0.0.1:{ports.etcd}/health")
    launch("kube-apiserver")

    def apiserver_up() -> bool:
        check_alive("etcd", "kube-apiserver")
        return apiserver_ready(layout, ports)

    wait_for(apiserver_up, timeout, f"kube-apiserver /readyz on https://127.0.0.1:{ports.apiserver}")
    state.apiserver_ready_s = round(time.monotonic() - t0, 1)
    print(f"cluster: kube-apiserver ready after {state.apiserver_ready_s}s", file=sys.stderr)
    for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
        launch(name)
    nodes = default_nodes(gpu_nodes, cpu_nodes)
    manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": [node_manifest(n) for n in nodes]})
    created = probe.kubectl("create", "-f", "-", input=manifest)
    if created.returncode != 0:
        raise ClusterError(f"creating kwok nodes failed: {created.stderr.strip()}")

    def component_healthy(name: str, port: int) -> Callable[[], bool]:
        def check() -> bool:
            check_alive(name)
            status, body = https_get(f"https://127.0.0.1:{port}/healthz", self_signed_context())
            return status == 200 and body.strip() == "ok"
        return check

    wait_for(component_healthy("kube-controller-manager", ports.controller_manager), timeout,
             f"kube-controller-manager /healthz on https://127.0.0.1:{ports.controller_manager}")
    wait_for(component_healthy("kube-scheduler", ports.scheduler), timeout,
             f"kube-scheduler /healthz on https://127.0.0.1:{ports.scheduler}")

    def nodes_ready() -> bool:
        check_alive(*COMPONENTS)
        out = probe.kubectl("get", "nodes", "-o", "json")
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        ready = {item["metadata"]["name"] for item in json.loads(out.stdout)["items"]
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in item["status"].get("conditions", []))}
        missing = sorted({n.name for n in nodes} - ready)
        if missing:
            raise NotYet(f"not Ready yet: {', '.join(missing)}")
        return True

    wait_for(nodes_ready, timeout, f"{len(nodes)} kwok nodes to be Ready (kwok log: {layout.log('kwok')})")

    def default_service_account() -> bool:
        check_alive("kube-controller-manager")
        out = probe.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name")
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        return True

    wait_for(default_service_account, timeout, "the default ServiceAccount (created by kube-controller-manager)")
    state.ready_s = round(time.monotonic() - t0, 1)
    state.save(layout.state_file)
    print(f"cluster: up in {state.ready_s}s ({len(nodes)} kwok nodes Ready; logs in {layout.logs}); "
          f"kubeconfig:", file=sys.stderr)
    print(layout.kubeconfig)
    return 0


def down(layout: Layout) -> int:
    stopped = stop_processes(layout)
    if layout.root.exists():
        shutil.rmtree(layout.root)
    print(f"cluster: stopped {', '.join(stopped) if stopped else 'nothing (no cluster was running)'}; "
          f"removed {layout.root}", file=sys.stderr)
    return 0


def status(layout: Layout) -> int:
    pids = cluster_pids(layout)
    state = State.load(layout.state_file)
    for name in COMPONENTS:
        print(f"{name:24} {'running, pid ' + str(pids[name]) if name in pids else 'not running'}")
    ready = state is not None and layout.kubeconfig.exists() and apiserver_ready(layout, state.ports)
    print(f"{'apiserver':24} {'ready at https://127.0.0.1:' + str(state.ports.apiserver) if ready else 'not ready'}")
    if ready:
        print(f"{'kubeconfig':24} {layout.kubeconfig}")
    return 0 if ready and len([n for n in COMPONENTS if n in pids]) == len(COMPONENTS) else 1


def env(layout: Layout) -> int:
    print(f"export KUBECONFIG={layout.kubeconfig}")
    print(f"export PATH={layout.bin_dir}:$PATH")
    return 0


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))
    parser = argparse.ArgumentParser(prog="hack/controlplane.sh", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument("--bin-dir", type=Path, default=cache / "bin")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("CONSORT_CLUSTER_DIR", cache / "cluster")),
                        help="state dir (env CONSORT_CLUSTER_DIR)")
    parser.add_argument("--gpu-nodes", type=int, default=2)
    parser.add_argument("--cpu-nodes", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed for each start-up wait")
    args = parser.parse_args(argv)
    layout = Layout(root=args.dir.expanduser().resolve(), bin_dir=args.bin_dir.expanduser().resolve())
    try:
        if args.command == "up":
            return up(layout, args.gpu_nodes, args.cpu_nodes, args.timeout)
        if args.command == "down":
            return down(layout)
        if args.command == "status":
            return status(layout)
        return env(layout)
    except ClusterError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
