"""The operator on the real local control plane: the eight C++ specialists + their router."""
from __future__ import annotations

import json
import time

import pytest
import yaml
from opkit import REPO, get_json, wait_phase
from consort_router.config import RouterConfig
from kube import NotYet, condition, owned_by, wait_for

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "examples" / "cpp-ensemble"
NAMES = ["algo", "template", "memory", "concurrency", "systems", "build", "debug", "stl"]
BLOCK = {"template": 8, "stl": 8}
SPECULATIVE = {"algo", "memory", "systems", "stl", "build"}
MANAGED = "app.kubernetes.io/managed-by=consort-operator"
OWNED_KINDS = "deployments,services,poddisruptionbudgets,networkpolicies,configmaps,serviceaccounts,roles,rolebindings"


def arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def snapshot(cluster, namespace: str) -> dict[str, str]:
    """resourceVersion of every Consort object and everything the operator owns in the namespace."""
    out = {}
    for kinds, selector in (("specialists,ensemblerouters", None), (OWNED_KINDS, MANAGED)):
        args = ["get", kinds, "-n", namespace, "-o", "json"] + (["-l", selector] if selector else [])
        for item in json.loads(cluster.kubectl(*args).stdout)["items"]:
            out[f"{item['kind']}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def test_invalid_manifests_are_rejected_by_kubectl_apply(cluster, crds, namespace):
    base = yaml.safe_load((EXAMPLE / "specialist-algo.yaml").read_text())

    def variant(**changes) -> str:
        doc = json.loads(json.dumps(base))
        for path, value in changes.items():
            node = doc["spec"]
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return yaml.safe_dump(doc)

    cases = {
        "wrong enum": (variant(**{"kv.blockSize": 12}), 'spec.kv.blockSize: Unsupported value: 12: supported values: "8", "16", "32"'),
        "wrong enum (speculative)": (variant(**{"speculative.mode": "eagle"}), "spec.speculative.mode: Unsupported value: \"eagle\""),
        "fallback is itself": (variant(fallback="algo"), "spec.fallback must name another Specialist, not this one"),
        "negative replicas": (variant(replicas=-1), "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0"),
        "minReady above replicas": (variant(replicas=1, minReady=2), "minReady must not exceed replicas"),
        "TP without a GPU per rank": (variant(tensorParallelSize=2, **{"resources.gpus": 1}),
                                      "resources.gpus must equal tensorParallelSize"),
        "unknown field": (variant(gpuCount=2), 'unknown field "spec.gpuCount"'),
        "bad model source": (variant(**{"model.source": "s3://bucket/model"}), "spec.model.source in body should match"),
        "wrong enum (kv.dtype)": (variant(**{"kv.dtype": "int4"}), 'spec.kv.dtype: Unsupported value: "int4"'),
    }
    for what, (manifest, expected) in cases.items():
        proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=False)
        assert proc.returncode != 0, f"{what}: accepted:\n{proc.stdout}"
        assert expected in proc.stderr, f"{what}: unexpected message:\n{proc.stderr}"
    assert get_json(cluster, "specialists", "-n", namespace)["items"] == []
    explain = cluster.kubectl("explain", "specialist.spec.kv.blockSize").stdout
    assert "Tokens per KV block" in explain, explain
    assert "apiKeysSecretRef" in cluster.kubectl("explain", "ensemblerouter.spec.auth").stdout
    # The untouched example is valid.
    cluster.kubectl("apply", "-n", namespace, "--dry-run=server", "-f", str(EXAMPLE / "specialist-algo.yaml"))


@pytest.mark.timeout(600)
def test_cpp_ensemble_reconcile_restart_update_delete(cluster, namespace, operator_factory):
    op = operator_factory(namespace, "--warm-signal", "engine-or-pod-ready", "--pod-address", "none")
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))

    specialists = {n: wait_phase(cluster, namespace, "specialist", n, "Ready", timeout=180, ready="2/2") for n in NAMES}
    for name, sp in specialists.items():
        st = sp["status"]
        assert st["ready"] == "2/2" and st["warmReplicas"] == 2 and st["observedGeneration"] == sp["metadata"]["generation"]
        assert condition(sp, "Ready")["status"] == "True" and condition(sp, "Demoted")["status"] == "False"
        assert {r["source"] for r in st["replicaStatus"]} == {"pod-ready"}    # explicit fallback signal
        assert st["breaker"]["state"] == "Closed"
        uid = sp["metadata"]["uid"]

        dep = get_json(cluster, "deployment", name, "-n", namespace)
        assert owned_by(dep, uid)
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["command"] == ["consort", "engine"]
        assert arg(c["args"], "--block-size") == str(BLOCK.get(name, 16))
        assert arg(c["args"], "--speculative") == ("ngram" if name in SPECULATIVE else "off")
        assert arg(c["args"], "--name") == name and arg(c["args"], "--device") == "cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 900
        assert pod["securityContext"]["runAsNonRoot"] is True
        for kind in ("service", "poddisruptionbudget"):
            obj = get_json(cluster, kind, name, "-n", namespace)
            assert owned_by(obj, uid), kind
        assert get_json(cluster, "pdb", name, "-n", namespace)["spec"]["maxUnavailable"] == 1
        assert owned_by(get_json(cluster, "networkpolicy", f"{name}-engine", "-n", namespace), uid)

    pods = get_json(cluster, "pods", "-n", namespace, "-l", "app.kubernetes.io/component=engine")["items"]
    assert len(pods) == 16
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in pods), [p["spec"].get("nodeName") for p in pods]

    router = wait_phase(cluster, namespace, "ensemblerouter", "cpp", "Ready", timeout=120, ready="2/2")
    assert router["status"]["specialists"] == 8 and router["status"]["readySpecialists"] == 8
    cm = get_json(cluster, "configmap", "cpp-router", "-n", namespace)
    config = RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"]))
    assert sorted(s.name for s in config.specialists) == sorted(NAMES)
    assert all(s.service.service == s.name and s.service.namespace == namespace for s in config.specialists)
    assert config.specialist("template").fallback == "stl" and config.intent_table()["debug"] == "debug"
    role = get_json(cluster, "role", "cpp-router", "-n", namespace)
    assert role["rules"][0] == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    for kind, name in (("deployment", "cpp-router"), ("service", "cpp"), ("serviceaccount", "cpp-router"), ("rolebinding", "cpp-router")):
        assert owned_by(get_json(cluster, kind, name, "-n", namespace), router["metadata"]["uid"]), kind

    table = cluster.kubectl("get", "specialists", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "READY", "ADAPTER", "BREAKER", "AGE"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert sorted(rows) == sorted(NAMES)
    assert all(r[1:3] == ["Ready", "2/2"] and r[3] == "Closed" for r in rows.values()), table
    wide = cluster.kubectl("get", "specialists", "-n", namespace, "-o", "wide").stdout
    assert "BLOCK" in wide and "SPECULATIVE" in wide

    # GitOps: the operator never writes spec, so the manifests still match what is stored.
    diff = cluster.kubectl("diff", "-n", namespace, "-f", str(EXAMPLE), check=False)
    assert diff.returncode == 0, f"kubectl diff is not empty:\n{diff.stdout}\n{diff.stderr}"

    # An operator restart causes no churn: nothing is rewritten, no resourceVersion moves.
    before = snapshot(cluster, namespace)
    op.stop()
    op = operator_factory(namespace, *op.extra)

    def settled() -> dict:
        m = op.metrics()
        ok = {k: m.get(f'consort_operator_reconcile_total{{kind="{k}",result="ok"}}', 0) for k in ("Specialist", "EnsembleRouter")}
        if ok["Specialist"] < len(NAMES) or ok["EnsembleRouter"] < 1:
            raise NotYet(f"reconciles so far {ok}")
        return m

    wait_for(settled, 60, "every object reconciled by the restarted operator", interval=0.5)
    time.sleep(8)    # the wake-ups its first passes cause (index updates, events) have run their course
    m = op.metrics()
    # Settled objects take no further passes: after the first each, a wake-up finds nothing changed.
    passes = m.get('consort_operator_reconcile_total{kind="Specialist",result="ok"}', 0)
    assert passes <= 2 * len(NAMES), m
    assert not any(k.startswith("consort_operator_child_writes_total{") and v for k, v in m.items()), m
    assert not any(k.startswith("consort_operator_status_writes_total{") and v for k, v in m.items()), m
    after = snapshot(cluster, namespace)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}

    # A spec change rolls the Deployment (new pod template -> new ReplicaSet) and is observed.
    dep0 = get_json(cluster, "deployment", "template", "-n", namespace)
    cluster.kubectl("patch", "specialist", "template", "-n", namespace, "--type", "merge",
                    "-p", json.dumps({"spec": {"kv": {"blockSize": 16}}}))

    def rolled() -> dict:
        dep = get_json(cluster, "deployment", "template", "-n", namespace)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        if arg(args, "--block-size") != "16" or dep["metadata"]["generation"] <= dep0["metadata"]["generation"]:
            raise NotYet(f"block size {arg(args, '--block-size')}, generation {dep['metadata']['generation']}")
        if (dep.get("status") or {}).get("updatedReplicas") != 2 or (dep.get("status") or {}).get("readyReplicas") != 2:
            raise NotYet(f"rollout status {dep.get('status')}")
        return dep

    wait_for(rolled, 120, "the template Deployment to roll to block size 16", interval=0.5)
    rss = get_json(cluster, "replicasets", "-n", namespace, "-l", "consort.dev/specialist=template")["items"]
    assert len(rss) >= 2, "a rollout creates a new ReplicaSet"

    def observed() -> dict:
        sp = get_json(cluster, "specialist", "template", "-n", namespace)
        if sp["status"].get("observedGeneration") != sp["metadata"]["generation"] or sp["status"].get("phase") != "Ready":
            raise NotYet(f"status {sp['status'].get('phase')} observed {sp['status'].get('observedGeneration')}")
        return sp

    wait_for(observed, 90, "template observedGeneration to catch up", interval=0.5)
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", "involvedObject.name=template,involvedObject.kind=Specialist")["items"]
    reasons = {e["reason"] for e in events}
    assert {"CreatedChildren", "UpdatedChildren", "Ready"} <= reasons, reasons
    assert any(e["reason"] == "UpdatedChildren" and "Deployment template" in e["message"] for e in events), events

    # Deleting a Specialist garbage-collects what it owned and drops it from the routing table.
    cluster.kubectl("delete", "specialist", "debug", "-n", namespace, "--wait=true", "--timeout=60s")

    def collected() -> bool:
        left = cluster.kubectl("get", "deployment,service,pdb,networkpolicy", "-n", namespace,
                               "-l", "consort.dev/specialist=debug", "-o", "name").stdout.split()
        if left:
            raise NotYet(f"still there: {left}")
        cm = get_json(cluster, "configmap", "cpp-router", "-n", namespace)
        lanes = [s["name"] for s in yaml.safe_load(cm["data"]["router.yaml"])["specialists"]]
        if "debug" in lanes:
            raise NotYet(f"router lanes {lanes}")
        return True

    wait_for(collected, 90, "debug's children to be garbage-collected", interval=0.5)
    er = get_json(cluster, "ensemblerouter", "cpp", "-n", namespace)
    valid = condition(er, "ConfigValid")
    assert valid["status"] == "True" and "detector gdb -> debug" in valid["message"], valid
    assert er["status"]["specialists"] == 7
