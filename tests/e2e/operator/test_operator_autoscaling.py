"""Autoscaling and scraping as users install them, checked by a real kube-apiserver against the real
third-party CRDs (KEDA, prometheus-operator; hack/thirdparty-crds.sh): examples/autoscaling's HPA and
ScaledObject, the chart's ServiceMonitors and PodMonitor; and `kubectl scale specialist` through the
/scale subresource with the operator resizing the engines."""
from __future__ import annotations

import pytest
import yaml
from kube import NotYet, condition, wait_for
from opkit import REPO, get_json, wait_phase

pytestmark = pytest.mark.e2e

CHART = REPO / "charts" / "consort"
EXAMPLES = REPO / "examples" / "autoscaling"


def dry_run(cluster, namespace: str, docs: list[dict], check: bool = True):
    return cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                           input=yaml.safe_dump_all(docs), check=check)


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def test_examples_are_accepted_and_a_broken_scaledobject_is_not(cluster, crds, thirdparty_crds, namespace):
    hpa, so = example("hpa.yaml"), example("keda-scaledobject.yaml")
    out = dry_run(cluster, namespace, [hpa, so])
    assert "horizontalpodautoscaler.autoscaling/algo created (server dry run)" in out.stdout, out.stdout
    assert "scaledobject.keda.sh/algo created (server dry run)" in out.stdout, out.stdout
    adapter = example("prometheus-adapter-config.yaml")
    adapter["metadata"]["namespace"] = namespace
    assert "created (server dry run)" in dry_run(cluster, namespace, [adapter]).stdout

    broken = yaml.safe_load(yaml.safe_dump(so))
    del broken["spec"]["scaleTargetRef"]["name"]
    broken["spec"]["triggers"][0]["type"] = ""
    bad = dry_run(cluster, namespace, [broken], check=False)
    assert bad.returncode != 0 and "spec.scaleTargetRef.name: Required value" in bad.stderr, bad.stderr
    assert "spec.triggers[0].type" in bad.stderr, bad.stderr
    bad_hpa = yaml.safe_load(yaml.safe_dump(hpa))
    bad_hpa["spec"]["minReplicas"] = bad_hpa["spec"]["maxReplicas"] + 1
    bad = dry_run(cluster, namespace, [bad_hpa], check=False)
    assert bad.returncode != 0 and "spec.maxReplicas" in bad.stderr, bad.stderr


def render(cluster, namespace: str, *values: str) -> list[dict]:
    out = cluster.helm("template", "consort", str(CHART), "-n", namespace,
                       "--set", f"watchNamespaces={{{namespace}}}", *values)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


MONITORS = ("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
            "--set", "metrics.serviceMonitor.labels.release=prom")


def test_chart_monitors_are_off_by_default_and_accepted_when_on(cluster, thirdparty_crds, namespace):
    assert not [d for d in render(cluster, namespace) if d["apiVersion"].startswith("monitoring.coreos.com")]
    monitors = [d for d in render(cluster, namespace, *MONITORS) if d["apiVersion"].startswith("monitoring.coreos.com")]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in monitors) == [
        ("PodMonitor", "consort-engines"), ("ServiceMonitor", "consort-operator"), ("ServiceMonitor", "consort-routers")]
    assert all(d["metadata"]["labels"]["release"] == "prom" for d in monitors if d["kind"] == "ServiceMonitor")
    assert all(d["spec"]["namespaceSelector"] == {"matchNames": [namespace]} for d in monitors if "routers" in
               d["metadata"]["name"] or d["kind"] == "PodMonitor")
    out = dry_run(cluster, namespace, monitors)
    assert out.stdout.count("created (server dry run)") == 3, out.stdout

    # The CRD's own schema still judges what the chart renders (a scrape interval must be a duration).
    pod_monitor = next(d for d in monitors if d["kind"] == "PodMonitor")
    pod_monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "often"
    bad = dry_run(cluster, namespace, [pod_monitor], check=False)
    assert bad.returncode != 0 and "interval" in bad.stderr, bad.stderr
    # And the chart's values schema stops a bad value before that.
    bad = cluster.helm("template", "x", str(CHART), "--set", "metrics.podMonitor.interval=often", check=False)
    assert bad.returncode != 0 and "interval" in bad.stderr, bad.stderr


ROUTER = {"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter", "metadata": {"name": "front"},
          "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "scale"}}, "replicas": 1}}
SPECIALIST = {"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
              "metadata": {"name": "algo", "labels": {"consort.dev/ensemble": "scale"}},
              "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "replicas": 1, "minReady": 1,
                       "intents": ["codegen"]}}


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.timeout(300)
def test_kubectl_scale_specialist_resizes_the_engines_the_monitors_select(cluster, operator_factory, thirdparty_crds,
                                                                         namespace):
    # kwok's pods are Ready at once and have no engine behind them: count them warm on pod readiness.
    operator_factory(namespace, "--warm-signal", "pod-ready")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all([SPECIALIST, ROUTER]))
    wait_phase(cluster, namespace, "specialist", "algo", "Ready", ready="1/1", timeout=120)

    cluster.kubectl("scale", "specialist", "algo", "-n", namespace, "--replicas=3")
    scale = get_json(cluster, "specialist", "algo", "-n", namespace, "--subresource=scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3

    def deployment_at(n: int) -> dict:
        dep = get_json(cluster, "deployment", "algo", "-n", namespace)
        if (dep["spec"]["replicas"], (dep.get("status") or {}).get("readyReplicas")) != (n, n):
            raise NotYet(f"replicas {dep['spec']['replicas']} ready {(dep.get('status') or {}).get('readyReplicas')}")
        return dep

    dep = wait_for(lambda: deployment_at(3), 90, "the operator to resize the engine Deployment to 3")
    wait_phase(cluster, namespace, "specialist", "algo", "Ready", ready="3/3", timeout=120)
    scale = get_json(cluster, "specialist", "algo", "-n", namespace, "--subresource=scale")
    assert scale["status"]["replicas"] == 3, scale
    # What an HPA lists pods by: the selector the Specialist publishes matches exactly its engines.
    pods = get_json(cluster, "pods", "-n", namespace, "-l", scale["status"]["selector"])["items"]
    assert len(pods) == 3, [p["metadata"]["name"] for p in pods]

    # The chart's PodMonitor selects these engine pods on their port; the routers' ServiceMonitor
    # selects the router Service the operator made, on its port.
    monitors = {d["metadata"]["name"]: d for d in render(cluster, namespace, *MONITORS)
                if d["apiVersion"].startswith("monitoring.coreos.com")}
    pm = monitors["consort-engines"]["spec"]
    assert all(matches(pm["selector"], p["metadata"]["labels"]) for p in pods)
    ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports") or []}
    assert pm["podMetricsEndpoints"][0]["port"] in ports
    svc = wait_for(lambda: get_json(cluster, "service", "-n", namespace, "-l", "app.kubernetes.io/component=router")
                   ["items"], 60, "the router Service")[0]
    sm = monitors["consort-routers"]["spec"]
    assert matches(sm["selector"], svc["metadata"]["labels"])
    assert sm["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}

    # Scale down through the same subresource: the operator follows.
    cluster.kubectl("scale", "specialist", "algo", "-n", namespace, "--replicas=1")
    wait_for(lambda: deployment_at(1), 90, "the operator to resize the engine Deployment to 1")
    # The cluster's HPA controller reads the Specialist through /scale (no metrics API here, so it
    # goes no further than that: ScalingActive stays False and it leaves the replicas alone).
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "hpa.yaml"))

    def hpa_reads_scale() -> dict:
        hpa = get_json(cluster, "hpa", "algo", "-n", namespace)
        able = condition(hpa, "AbleToScale") or {}
        if able.get("status") != "True":
            raise NotYet(f"AbleToScale {able}")
        return hpa
    hpa = wait_for(hpa_reads_scale, 90, "the HPA controller to read the Specialist's scale subresource")
    assert condition(hpa, "AbleToScale")["reason"] == "SucceededGetScale" and hpa["status"]["currentReplicas"] == 1
    cluster.kubectl("delete", "hpa", "algo", "-n", namespace)

    # The CRD's bounds hold through the subresource too (spec.replicas <= 1000).
    too_many = cluster.kubectl("scale", "specialist", "algo", "-n", namespace, "--replicas=1001", check=False)
    assert too_many.returncode != 0 and "spec.replicas" in too_many.stderr, too_many.stderr
