"""Command lines of the control-plane components and the kwok Nodes (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout, Ports

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.0.0.1/16"  # kwok hands out fake pod IPs from here; nothing ever dials them
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


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
            "--authorization-mode=Node,RBAC", "--anonymous-auth=false",
            # Kubelets (the real node's; kwok's are never dialled): logs, exec, port-forward.
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
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
                # When the node controller's cache has held no lease renewal for this long, it marks
                # the (healthy) node's pods NotReady until the kubelet renews, which takes their
                # endpoints out of every Service for seconds. After an apiserver outage the cache
                # fills again only on the informers' next retry (backed off to 30 s plus up to 30 s
                # of jitter), so a 60 s outage (what the e2e suite rehearses; one apiserver has no
                # failover) leaves it without renewals for up to ~130 s: 120 s failed once.
                # A dead kubelet is still seen within four minutes.
                "--node-monitor-grace-period=240s",
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
