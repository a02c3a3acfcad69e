"""The Helm chart: lint-clean, installs into the local control plane, and its ClusterRole is enough
for the operator (run as the chart's ServiceAccount), with two replicas electing a leader on a Lease."""
from __future__ import annotations

import pytest
import yaml
from kube import NotYet, wait_for
from opkit import REPO, Operator, get_json, reconciles, wait_counted, wait_phase

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "consort"


def specialist(name: str, replicas: int = 1) -> str:
    return yaml.safe_dump({
        "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
        "metadata": {"name": name, "labels": {"consort.dev/ensemble": "chart"}},
        "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "replicas": replicas, "minReady": 1,
                 "intents": ["codegen"]}})


ROUTER = yaml.safe_dump({
    "apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "front"},
    "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "chart"}}, "replicas": 1}})


def test_helm_lint_is_clean(cluster):
    out = cluster.helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_template_rejects_values_outside_the_schema(cluster):
    bad = cluster.helm("template", "x", str(CHART), "--set", "warmSignal=sometimes", check=False)
    assert bad.returncode != 0 and "warmSignal" in bad.stderr, bad.stderr
    off = cluster.helm("template", "x", str(CHART), "--set", "networkPolicy.enabled=false")
    docs = [d for d in yaml.safe_load_all(off.stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--no-network-policy" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert not any("networkpolicies" in r["resources"] for r in role["rules"])


WRITE_VERBS = {"create", "patch", "update", "delete", "deletecollection"}


def test_watch_namespaces_grant_writes_per_namespace_only(cluster):
    """With watchNamespaces the operator can write nothing outside them: one Role + RoleBinding per
    watched namespace, and a ClusterRole that only reads what Kopf scans cluster-wide."""
    out = cluster.helm("template", "x", str(CHART), "-n", "consort-system", "--set", "watchNamespaces={team-a,team-b}")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert not {v for r in cluster_role["rules"] for v in r["verbs"]} & WRITE_VERBS, cluster_role["rules"]
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {"customresourcedefinitions", "namespaces"}
    leader = [d for d in docs if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"].endswith("-leader")]
    assert {d["metadata"]["namespace"] for d in leader} == {"consort-system"}    # the leader Lease only
    lease_role = next(d for d in leader if d["kind"] == "Role")
    assert {res for r in lease_role["rules"] for res in r["resources"]} == {"leases", "events"}
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role" and d not in leader}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding" and d not in leader}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns, role in roles.items():
        granted = {(res, v) for r in role["rules"] for res in r["resources"] for v in r["verbs"]}
        assert {("deployments", "get"), ("deployments", "patch")} <= granted
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": role["metadata"]["name"]}
        assert bindings[ns]["subjects"][0]["namespace"] == "consort-system"
    everywhere = [d for d in yaml.safe_load_all(cluster.helm("template", "x", str(CHART)).stdout) if d]
    assert not [d for d in everywhere if d["kind"] in ("Role", "RoleBinding") and not d["metadata"]["name"].endswith("-leader")]
    verbs = {v for d in everywhere if d["kind"] == "ClusterRole" for r in d["rules"] for v in r["verbs"]}
    assert "patch" in verbs   # watching the whole cluster needs the cluster-wide role


def test_allowed_images_and_torch_flag_reach_the_operator(cluster):
    out = cluster.helm("template", "x", str(CHART), "--set", "allowedImages={registry.internal/ml/}",
                       "--set", "allowTorchClassifier=true")
    dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--allowed-image=registry.internal/ml/" in args and "--allow-torch-classifier" in args
    plain = next(d for d in yaml.safe_load_all(cluster.helm("template", "x", str(CHART)).stdout) if d and d["kind"] == "Deployment")
    assert not [a for a in plain["spec"]["template"]["spec"]["containers"][0]["args"] if "allow" in a]


def test_model_cache_value_reaches_the_operator(cluster):
    def operator_args(*sets: str) -> list[str]:
        out = cluster.helm("template", "x", str(CHART), *(a for s in sets for a in ("--set", s)))
        dep = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not [a for a in operator_args() if a.startswith("--model-cache")]      # off by default
    args = operator_args("modelCache.hostPath=/var/lib/consort/model-cache", "modelCache.size=20Gi")
    assert "--model-cache-dir=/var/lib/consort/model-cache" in args and "--model-cache-size=20Gi" in args
    refused = cluster.helm("template", "x", str(CHART), "--set", "modelCache.hostPath=relative/dir", check=False)
    assert refused.returncode != 0 and "modelCache" in refused.stderr


@pytest.mark.timeout(600)
def test_chart_installs_and_its_rbac_runs_two_operators_electing_a_leader(cluster, crds, namespace, tmp_path):
    release = f"c{namespace[-6:]}"
    cluster.helm("install", release, str(CHART), "-n", namespace, "--wait=false",
                 "--set", f"watchNamespaces={{{namespace}}}", "--set", "replicaCount=2")
    operators: list[Operator] = []
    try:
        dep = get_json(cluster, "deployment", "-n", namespace, "-l", "app.kubernetes.io/name=consort-operator")["items"][0]
        pod = dep["spec"]["template"]["spec"]
        assert dep["spec"]["replicas"] == 2 and pod["securityContext"]["runAsNonRoot"] is True
        args = pod["containers"][0]["args"]
        lease = dep["metadata"]["name"]
        assert f"--namespace={namespace}" in args and "--leader-election" in args
        assert f"--lease-name={lease}" in args and f"--lease-namespace={namespace}" in args
        assert not any(a.startswith("--peering") for a in args)
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        leader_role = get_json(cluster, "role", f"{lease}-leader", "-n", namespace)
        assert {tuple(r["verbs"]): r.get("resourceNames") for r in leader_role["rules"]} == {
            ("create",): None, ("get", "update"): [lease]}
        role = get_json(cluster, "clusterrole", "-l", f"app.kubernetes.io/instance={release}")["items"][0]
        verbs = {v for r in role["rules"] for v in r["verbs"]}
        assert verbs <= {"get", "list", "watch", "patch", "create"}, verbs
        assert not any(r["resources"] == ["*"] or r["verbs"] == ["*"] for r in role["rules"])

        def pods_running() -> bool:
            pods = get_json(cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/name=consort-operator")["items"]
            if len([p for p in pods if p["status"].get("phase") == "Running"]) != 2:
                raise NotYet(f"{[p['status'].get('phase') for p in pods]}")
            return True

        wait_for(pods_running, 60, "two (kwok) operator pods Running")

        # The operator as the chart's ServiceAccount: its Role (watchNamespaces) must be enough for everything.
        sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
        token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
        kc = yaml.safe_load(cluster.kubeconfig.read_text())
        kc["users"] = [{"name": "operator", "user": {"token": token}}]
        kc["contexts"][0]["context"]["user"] = "operator"
        sa_kubeconfig = tmp_path / "sa.kubeconfig"
        sa_kubeconfig.write_text(yaml.safe_dump(kc))

        class SACluster:
            kubeconfig = sa_kubeconfig
            env = cluster.env

        args = ("--leader-election", "--lease-namespace", namespace, "--lease-name", lease,
                "--warm-signal", "pod-ready", "--pod-address", "none")
        for i in range(2):
            op = Operator(SACluster, namespace, tmp_path / f"op{i}", *args)
            (tmp_path / f"op{i}").mkdir()
            operators.append(op.start())

        def held() -> str:
            holder = (get_json(cluster, "lease", lease, "-n", namespace).get("spec") or {}).get("holderIdentity")
            if not holder:
                raise NotYet("no holder")
            return holder

        holder = wait_for(held, 30, "one operator holding the Lease")
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha") + "---\n" + ROUTER)
        wait_phase(cluster, namespace, "specialist", "alpha", "Ready", timeout=90)
        wait_phase(cluster, namespace, "ensemblerouter", "front", "Ready", timeout=90)
        for kind, name in (("deployment", "alpha"), ("service", "alpha"), ("pdb", "alpha"), ("networkpolicy", "alpha-engine"),
                           ("role", "front-router"), ("rolebinding", "front-router"), ("configmap", "front-router")):
            get_json(cluster, kind, name, "-n", namespace)

        counts = [reconciles(op) for op in operators]
        assert sorted(c > 0 for c in counts) == [False, True], f"exactly one replica acts: {counts}"
        active, standby = (operators[0], operators[1]) if counts[0] else (operators[1], operators[0])
        assert f'consort_operator_leader{{identity="{holder}"}}' in active.metrics(), "the Lease holder is the one acting"

        # The active replica goes away (SIGTERM: it hands the Lease back); the standby takes over at
        # once and reconciles a change.
        active.stop()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=specialist("alpha", replicas=2))

        def scaled() -> bool:
            d = get_json(cluster, "deployment", "alpha", "-n", namespace)
            if d["spec"]["replicas"] != 2:
                raise NotYet(f"replicas {d['spec']['replicas']}")
            return True

        wait_for(scaled, 90, "the standby operator to take over and scale alpha")
        assert wait_counted(standby) > 0
    finally:
        # Release Kopf's finalizers while an operator still runs, then stop them.
        if any(op.proc is not None and op.proc.poll() is None for op in operators):
            cluster.kubectl("delete", "specialists,ensemblerouters", "--all", "-n", namespace, "--wait=true",
                            "--timeout=60s", check=False, timeout=90)
        for op in operators:
            op.stop()
        cluster.helm("uninstall", release, "-n", namespace, check=False)
    assert get_json(cluster, "clusterrole", "-l", f"app.kubernetes.io/instance={release}")["items"] == []
