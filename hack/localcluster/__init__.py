"""Runs the local Kubernetes control plane as background processes on 127.0.0.1.

Run as `python3 -m localcluster` from hack/ (hack/controlplane.sh up|down|status|env does that)
after the binaries are built. Standard library
only, so it also runs under a bare python3. The cluster is: etcd (TLS, client-cert auth) ->
kube-apiserver (TLS, token auth, RBAC) -> kube-controller-manager + kube-scheduler (their own
RBAC identities) -> kwok (fakes kubelets: nodes Ready, pods Running) plus kwok Nodes, two of which
advertise nvidia.com/gpu.

Everything lives in one state dir (CONSORT_CLUSTER_DIR, default ~/.cache/consort/cluster):
pki/, logs/, pids/, etcd/, the kubeconfig and state.json (ports, timings). A process belongs to
the cluster when its command line names that dir, which is how stale processes from an earlier
run are found and stopped. Every wait is bounded and names what it waited for.
"""
