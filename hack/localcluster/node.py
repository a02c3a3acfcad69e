"""One real node beside the kwok ones: containerd + runc, kubelet, kube-proxy, a CNI bridge.

Everything the node needs lives on this machine and stays there:
- a bridge `consort0` (created here, before any pod) carries NODE_IP, the node's InternalIP: the
  kubelet serves on it (the apiserver reaches it there for logs/exec/port-forward) and pod IPs come
  from POD_SUBNET on the same bridge. No NAT to the outside (`ipMasq: false`).
- the apiserver binds 127.0.0.1 only; pods reach it through the `kubernetes` Service, whose
  EndpointSlice (written here, the apiserver's own reconciler is off) points at NODE_IP, where a
  socat forwarder relays to 127.0.0.1.
- an egress guard (iptables chain CONSORT-EGRESS) rejects and counts every new connection from a
  pod to an address outside the node, and every connection from this machine to kwok's fake pod
  range: tests assert its counters stay at zero.
- no cluster DNS: components reach Services by the environment variables kubelet injects or by
  explicit addresses (the chart and the operator never need a DNS name), so kubelet runs without
  --cluster-dns (it logs MissingClusterDNS once per pod; pods fall back to the host's resolv.conf).

containerd keeps its content store (imported images) in CACHE/node/containerd across clusters,
so an image is imported once per digest; containers and pod sandboxes are removed on down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .layout import ClusterError, Layout

NODE_NAME = "consort-node-0"
BRIDGE = "consort0"
NODE_IP = "10.244.0.1"
POD_SUBNET = "10.244.0.0/24"
KWOK_POD_CIDR = "10.0.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
GUARD_CHAIN = "CONSORT-EGRESS"
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "apiserver-proxy")
# containerd 1.6's default sandbox image; hack/images.sh builds it locally (no registry here).
SANDBOX_IMAGE = "registry.k8s.io/pause:3.6"


@dataclass(frozen=True)
class NodeLayout:
    """Paths of the real node: per-cluster state under the cluster dir, the image store in the cache."""

    cluster: Layout

    @property
    def root(self) -> Path:
        return self.cluster.root / "node"

    @property
    def containerd_root(self) -> Path:  # content store + snapshots: survives `down`
        return self.cluster.bin_dir.parent / "node" / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd-state"

    @property
    def containerd_sock(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni"

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    def path(self, name: str) -> Path:
        return self.root / name


def run(*argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return proc


# --- preflight -------------------------------------------------------------------------------

def preflight() -> None:
    """The kernel and host features the node needs, each with a one-line diagnosis."""
    if os.geteuid() != 0:
        raise ClusterError("the real node needs root (containerd, runc, bridges and iptables)")
    for tool in ("containerd", "runc", "ctr", "iptables", "ip", "socat"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} is missing: run hack/node-deps.sh (Debian packages containerd, runc, "
                               "containernetworking-plugins, iptables, socat, iproute2)")
    if not Path("/usr/lib/cni/bridge").exists():
        raise ClusterError("CNI plugins are missing (/usr/lib/cni/bridge): apt-get install containernetworking-plugins")
    if "overlay" not in Path("/proc/filesystems").read_text():
        run("modprobe", "overlay", check=False)
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise ClusterError("the kernel has no overlayfs (containerd's overlayfs snapshotter needs it)")
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        run("modprobe", "br_netfilter", check=False)
        if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
            raise ClusterError("br_netfilter is not loaded (Service traffic between pods on one bridge needs it)")
    for controller in ("memory", "pids", "cpu", "cpuset"):
        if not (Path("/sys/fs/cgroup") / controller).exists() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            raise ClusterError(f"cgroup controller {controller} is not mounted under /sys/fs/cgroup")


# --- network ---------------------------------------------------------------------------------

def sysctl(key: str, value: str) -> None:
    Path("/proc/sys", *key.split(".")).write_text(value)


def setup_network() -> None:
    if run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
    addrs = run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE).stdout
    if f" {NODE_IP}/" not in addrs:
        run("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    sysctl("net.ipv4.ip_forward", "1")  # pod -> Service VIP -> pod on the same bridge
    sysctl("net.bridge.bridge-nf-call-iptables", "1")
    install_guard()


def guard_rules() -> list[list[str]]:
    """Where the guard chain hooks in: new connections from pods leaving the node, and anything
    this machine sends toward kwok's fake pod IPs."""
    return [
        ["FORWARD", "-i", BRIDGE, "!", "-o", BRIDGE, "-m", "conntrack", "--ctstate", "NEW", "-j", GUARD_CHAIN],
        ["OUTPUT", "-d", KWOK_POD_CIDR, "-j", GUARD_CHAIN],
    ]


def install_guard() -> None:
    if run("iptables", "-w", "-n", "-L", GUARD_CHAIN, check=False).returncode != 0:
        run("iptables", "-w", "-N", GUARD_CHAIN)
    run("iptables", "-w", "-F", GUARD_CHAIN)
    run("iptables", "-w", "-A", GUARD_CHAIN, "-j", "REJECT")
    for rule in guard_rules():
        if run("iptables", "-w", "-C", *rule, check=False).returncode != 0:
            run("iptables", "-w", "-I", *rule)


def guard_count() -> int:
    """Packets the egress guard rejected since the node started (0 means nothing tried to leave)."""
    out = run("iptables", "-w", "-n", "-v", "-x", "-L", GUARD_CHAIN, check=False).stdout
    return sum(int(line.split()[0]) for line in out.splitlines()[2:] if line.split() and line.split()[0].isdigit())


def teardown_network() -> None:
    for rule in guard_rules():
        while run("iptables", "-w", "-D", *rule, check=False).returncode == 0:
            pass
    run("iptables", "-w", "-F", GUARD_CHAIN, check=False)
    run("iptables", "-w", "-X", GUARD_CHAIN, check=False)
    run("ip", "link", "del", BRIDGE, check=False)


# --- configuration files ---------------------------------------------------------------------

def containerd_config(node: NodeLayout) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{node.containerd_root}"
state = "{node.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{node.containerd_sock}"

[ttrpc]
  address = "{node.containerd_sock}.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{node.root / 'opt'}"

[{cri}]
  sandbox_image = "{SANDBOX_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below its own, and every
  # sandbox would die with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{node.cni_conf_dir}"
"""


def cni_config(node: NodeLayout) -> dict:
    return {
        "cniVersion": "0.4.0", "name": "consort",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(node.path("cni-ipam")),
                      "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(node: NodeLayout, healthz_port: int) -> dict:
    pki = node.cluster.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this kernel mounts cgroup v1; 1.35 refuses it unless told
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{node.containerd_sock}",
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "tlsCertFile": str(pki / "kubelet.crt"), "tlsPrivateKeyFile": str(pki / "kubelet.key"),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "failSwapOn": False,
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        # A shared build machine's disk is often 70-90% full: evict on real exhaustion only, and
        # never garbage-collect the imported images (there is no registry to pull them back from).
        "evictionHard": {"memory.available": "256Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "enforceNodeAllocatable": ["pods"],
        "systemReserved": {"cpu": "0m", "memory": "512Mi"},
        "shutdownGracePeriod": "0s",
        "registerNode": True,
        "staticPodPath": "",
    }


def kube_proxy_config(node: NodeLayout, kubeconfig: Path, healthz_port: int, metrics_port: int) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "hostnameOverride": NODE_NAME, "bindAddress": "127.0.0.1",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "clusterCIDR": POD_SUBNET,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}", "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # NodePorts only on the node's own bridge address, never on the machine's interfaces.
        "nodePortAddresses": [f"{NODE_IP}/32"],
        # conntrack sysctls are the host's: leave them alone.
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def write_configs(node: NodeLayout, ports: dict[str, int]) -> None:
    for d in (node.root, node.containerd_root, node.containerd_state, node.cni_conf_dir, node.kubelet_dir):
        d.mkdir(parents=True, exist_ok=True)
    node.path("containerd.toml").write_text(containerd_config(node))
    (node.cni_conf_dir / "10-consort.conflist").write_text(json.dumps(cni_config(node), indent=2) + "\n")
    node.path("kubelet.json").write_text(json.dumps(kubelet_config(node, ports["kubelet_healthz"]), indent=2))
    proxy = kube_proxy_config(node, node.cluster.component_kubeconfig("kube-proxy"),
                              ports["proxy_healthz"], ports["proxy_metrics"])
    node.path("kube-proxy.json").write_text(json.dumps(proxy, indent=2))


def node_argv(name: str, node: NodeLayout, apiserver_port: int) -> list[str]:
    bin_dir = node.cluster.bin_dir
    if name == "containerd":
        return [shutil.which("containerd") or "containerd", "--config", str(node.path("containerd.toml"))]
    if name == "kubelet":
        return [str(bin_dir / "kubelet"), f"--config={node.path('kubelet.json')}",
                f"--kubeconfig={node.cluster.component_kubeconfig('kubelet')}",
                f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
                f"--root-dir={node.kubelet_dir}", f"--cert-dir={node.path('kubelet-pki')}",
                "--node-labels=consort.dev/node=real,node.kubernetes.io/instance-type=consort-cpu", "--v=1"]
    if name == "kube-proxy":
        return [str(bin_dir / "kube-proxy"), f"--config={node.path('kube-proxy.json')}", "--v=1"]
    if name == "apiserver-proxy":
        # Pods -> kubernetes Service -> NODE_IP:port -> here -> the apiserver on 127.0.0.1. The lock
        # file names the cluster dir, which is how `down` recognises this process as ours.
        return [shutil.which("socat") or "socat", f"-L{node.path('apiserver-proxy.lock')}",
                f"TCP-LISTEN:{apiserver_port},bind={NODE_IP},fork,reuseaddr", f"TCP:127.0.0.1:{apiserver_port}"]
    raise ValueError(f"unknown node component {name}")


def kubernetes_endpoints(apiserver_port: int) -> dict:
    """The default `kubernetes` Service's endpoints: the apiserver as pods can reach it."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes",
                                "endpointslice.kubernetes.io/managed-by": "consort-localcluster"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": apiserver_port, "protocol": "TCP"}],
    }


# --- containerd housekeeping -----------------------------------------------------------------

def ctr(node: NodeLayout, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    return run("ctr", f"--address={node.containerd_sock}", "--namespace=k8s.io", *args, check=check, timeout=timeout)


def import_archive(node: NodeLayout, archive: Path, attempts: int = 3) -> None:
    """`ctr images import`, tried again when it loses a race with containerd's garbage collector.

    Importing an image under a name that already exists unreferences the old image's snapshots;
    the unpacker can find a shared parent snapshot, then see the collector delete it before it
    prepares the child ("parent snapshot ... does not exist"). The next try finds the chain gone and
    unpacks it afresh, so the cached image store heals itself."""
    for attempt in range(1, attempts + 1):
        result = ctr(node, "images", "import", "--no-unpack=false", str(archive), check=False, timeout=1800)
        if result.returncode == 0:
            return
        error = (result.stderr or result.stdout).strip()
        if attempt == attempts:
            raise ClusterError(f"importing {archive.name} into containerd failed {attempts} times: {error}")
        print(f"node: importing {archive.name} failed ({error}); trying again", file=sys.stderr)
        time.sleep(2 * attempt)


def import_images(node: NodeLayout, archives: list[Path]) -> list[str]:
    """Import oci-archives into the node's image store, skipping those whose digest is there."""
    known = ctr(node, "images", "ls").stdout
    done = []
    for archive in archives:
        digest_file = archive.with_suffix(archive.suffix + ".digest")
        digest = digest_file.read_text().strip() if digest_file.exists() else ""
        if digest and digest in known:
            continue
        t0 = time.monotonic()
        print(f"node: importing {archive.name} into containerd", file=sys.stderr)
        import_archive(node, archive)
        print(f"node: imported {archive.name} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        done.append(archive.name)
    return done


def remove_containers(node: NodeLayout) -> None:
    """Kill and delete every container and pod sandbox (the image store stays)."""
    if not node.containerd_sock.exists():
        return
    tasks = ctr(node, "tasks", "ls", "-q", check=False).stdout.split()
    for task in tasks:
        ctr(node, "tasks", "kill", "-s", "SIGKILL", task, check=False)
    deadline = time.monotonic() + 15
    for task in tasks:
        while ctr(node, "tasks", "delete", task, check=False).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.3)
    for container in ctr(node, "containers", "ls", "-q", check=False).stdout.split():
        ctr(node, "containers", "delete", container, check=False)


def unmount_under(root: Path) -> None:
    """Lazy-unmount everything mounted below root (kubelet volumes, rootfs, netns), deepest first."""
    prefix = str(root) + "/"
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        run("umount", "-l", target, check=False)


def remove_pod_netns() -> None:
    """CNI netns that containerd created for our pods (their sandboxes are gone by now)."""
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith("cni-"):
            run("ip", "netns", "delete", name, check=False)
