"""The operator cannot be turned against its namespace (issue 25): it never adopts an object it does
not own, runs only allowed images, bounds scratch space, refuses `..` in pvc:// paths and loads
TorchScript classifiers only when told to."""
from __future__ import annotations

import asyncio
import re
from datetime import datetime, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from consort_operator import apply
from consort_operator.lifecycle.children import Owned
from consort_operator.runtime import Runtime
from consort_operator.api import crds
from consort_operator.api.base import quantity_value
from consort_operator.api.router import EnsembleRouterSpec
from consort_operator.api.specialist import SpecialistSpec
from consort_operator.lifecycle import admission, ownership
from consort_operator.lifecycle import router as router_lc
from consort_operator.lifecycle import specialist as specialist_lc
from consort_operator.lifecycle.common import get_condition
from consort_operator.resources import router as router_res
from consort_operator.resources import specialist as specialist_res
from consort_operator.resources.common import (ANNOTATION_HASH, FIELD_MANAGER, MANAGED_BY, BuildContext,
                                               owner_reference)

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone.utc)
UID = "uid-parent"


def child(kind: str = "Deployment", name: str = "web") -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "annotations": {ANNOTATION_HASH: "h1"},
                         "labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
                         "ownerReferences": [owner_reference("Specialist", name, UID)]},
            "spec": {"replicas": 1}}


def victim(**meta: Any) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": "web", "namespace": "ns", **meta}, "spec": {"replicas": 3}}


# ---- the pure decision ----------------------------------------------------------------------------

def test_absent_or_owned_children_are_applied():
    assert ownership.conflict(child(), None, UID) is None
    mine = victim(ownerReferences=[owner_reference("Specialist", "web", UID)])
    assert ownership.conflict(child(), mine, UID) is None


def test_an_orphan_the_operator_wrote_is_adopted_back():
    orphan = victim(labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                    managedFields=[{"manager": FIELD_MANAGER, "operation": "Apply"}])
    assert ownership.conflict(child(), orphan, UID) is None


def test_an_unowned_object_is_refused():
    got = ownership.conflict(child(), victim(), UID)
    assert got is not None and got.kind == "Deployment" and got.name == "web"
    assert "not managed by consort-operator" in got.reason


def test_the_label_alone_does_not_make_an_object_ours():
    forged = victim(labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                    managedFields=[{"manager": "kubectl-client-side-apply", "operation": "Update"}])
    assert ownership.conflict(child(), forged, UID) is not None


def test_an_object_controlled_by_another_parent_is_refused():
    other = victim(labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                   managedFields=[{"manager": FIELD_MANAGER}],
                   ownerReferences=[owner_reference("EnsembleRouter", "front", "uid-other")])
    got = ownership.conflict(child(), other, UID)
    assert got is not None and "EnsembleRouter front" in got.reason


def test_condition_names_the_object_and_warns_once():
    c = ownership.Conflict("Deployment", "web", "exists and is not managed by consort-operator; left untouched")
    conds, events = ownership.ownership_condition([], [c], "Specialist", T0, 3)
    cond = get_condition(conds, ownership.CONDITION)
    assert cond["status"] == "False" and cond["reason"] == "ChildConflict" and "Deployment web" in cond["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "ChildConflict")]
    again, events = ownership.ownership_condition(conds, [c], "Specialist", T0, 3)
    assert again == conds and events == []
    cleared, events = ownership.ownership_condition(conds, [], "Specialist", T0, 3)
    assert get_condition(cleared, ownership.CONDITION)["status"] == "True" and events == []
    assert ownership.ownership_condition([], [], "Specialist", T0, 3) == ([], [])


# ---- the handler applies only what the decision allows --------------------------------------------

class FakeKube:
    def __init__(self, objects: dict[tuple[str, str], dict[str, Any]]):
        self.objects = objects
        self.applied: list[dict[str, Any]] = []
        self.created_first: list[str] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(obj)
        return {"metadata": {"generation": 1}}

    async def apply_new(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self.created_first.append(obj["kind"])
        return None if (obj["kind"], obj["metadata"]["name"]) in self.objects else await self.apply(obj)


def run_ensure(objects: dict, children: list[dict], parent_status: dict | None = None) -> tuple[FakeKube, list, list]:
    kube = FakeKube(objects)
    rt = Runtime(kube=kube)   # type: ignore[arg-type]
    body = {"metadata": {"name": "web", "namespace": "ns", "uid": UID, "generation": 1}}
    status = {"phase": "Ready"} if parent_status is None else parent_status
    events, conflicts = asyncio.run(apply.ensure_children(rt, body, children, Owned(), {}, status))
    return kube, events, conflicts


def test_ensure_children_leaves_an_unowned_deployment_and_service_untouched():
    svc = child("Service")
    kube, events, conflicts = run_ensure({("Deployment", "web"): victim(),
                                          ("Service", "web"): {"metadata": {"name": "web"}}}, [child(), svc])
    assert kube.applied == []
    assert [(c.kind, c.name) for c in conflicts] == [("Deployment", "web"), ("Service", "web")]
    assert events == []


def test_ensure_children_still_creates_and_updates_its_own():
    mine = victim(ownerReferences=[owner_reference("Specialist", "web", UID)])
    kube, events, conflicts = run_ensure({("Deployment", "web"): mine}, [child(), child("Service")])
    assert [o["kind"] for o in kube.applied] == ["Deployment", "Service"]
    assert conflicts == [] and [(e.reason, e.message) for e in events] == [
        ("CreatedChildren", "created Service web"), ("UpdatedChildren", "updated Deployment web")]


def test_a_new_parent_creates_without_reading_and_still_refuses_what_exists():
    kube, events, conflicts = run_ensure({("Service", "web"): {"metadata": {"name": "web"}}},
                                         [child(), child("Service")], parent_status={})
    assert kube.created_first == ["Deployment", "Service"]   # one create-only apply each, no read first
    assert [o["kind"] for o in kube.applied] == ["Deployment"]
    assert [(c.kind, c.name) for c in conflicts] == [("Service", "web")] and [e.message for e in events] == ["created Deployment web"]


# ---- images and TorchScript classifiers ------------------------------------------------------------


CTX = BuildContext(engine_image="ghcr.io/consort-dev/consort-engine:0.1.0",
                   router_image="ghcr.io/consort-dev/consort-router:0.1.0")
PACING = specialist_lc.Pacing("engine", 2.0, 30.0)
SPECIALIST = {"model": {"source": "pvc://m/algo"}, "replicas": 1, "minReady": 1}
ROUTER = {"auth": {"apiKeysSecretRef": {"name": "keys", "key": "keys"}}}
LANE = router_lc.SelectedSpecialist("algo", SPECIALIST, "Ready", 1, "Closed", None)


def test_image_prefixes_match_at_a_boundary_only():
    allowed = ("ghcr.io/consort-dev/consort-engine", "registry.example.com", "quay.io/team/")
    assert admission.image_allowed("ghcr.io/consort-dev/consort-engine:0.2.0", allowed)
    assert admission.image_allowed("ghcr.io/consort-dev/consort-engine@sha256:abc", allowed)
    assert admission.image_allowed("registry.example.com/any/thing:1", allowed)
    assert admission.image_allowed("quay.io/team/engine:1", allowed)
    assert not admission.image_allowed("ghcr.io/consort-dev/consort-engine-evil:1", allowed)
    assert not admission.image_allowed("registry.example.com.evil.io/x:1", allowed)
    assert not admission.image_allowed("docker.io/attacker/keys:latest", allowed)
    assert admission.image_allowed("docker.io/attacker/keys:latest", ("*",))
    assert admission.image_repository("localhost:5000/org/engine:1.2") == "localhost:5000/org/engine"


def test_default_allowlist_is_the_operators_own_images():
    assert admission.allowed_prefixes(CTX) == ("ghcr.io/consort-dev/consort-engine", "ghcr.io/consort-dev/consort-router")


def specialist_decision(spec: dict, ctx: BuildContext = CTX) -> specialist_lc.Decision:
    o = specialist_lc.SpecialistObserved("algo", "ns", "uid-1", 2)
    return specialist_lc.decide(spec, o, {}, T0, ctx, PACING)


def test_specialist_with_a_foreign_image_gets_no_children_and_says_why():
    d = specialist_decision({**SPECIALIST, "image": "docker.io/attacker/engine:1"})
    assert d.children == [] and d.phase == "Failed"
    ready = get_condition(d.status["conditions"], "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ImageNotAllowed" and "docker.io/attacker" in ready["message"]
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "ImageNotAllowed")]
    again = specialist_lc.decide({**SPECIALIST, "image": "docker.io/attacker/engine:1"},
                                 specialist_lc.SpecialistObserved("algo", "ns", "uid-1", 2), d.status, T0, CTX, PACING)
    assert again.events == []   # one Warning per refusal, not one per pass


def test_specialist_with_an_allowed_image_runs_it():
    d = specialist_decision({**SPECIALIST, "image": "ghcr.io/consort-dev/consort-engine:0.2.0"})
    dep = next(c for c in d.children if c["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/consort-dev/consort-engine:0.2.0"
    extra = BuildContext(engine_image=CTX.engine_image, router_image=CTX.router_image,
                         allowed_images=("registry.internal/ml/",))
    assert specialist_decision({**SPECIALIST, "image": "registry.internal/ml/engine:1"}, extra).children


def router_decision(spec: dict, ctx: BuildContext = CTX) -> specialist_lc.Decision:
    o = router_lc.RouterObserved("front", "ns", "uid-r", 1, (LANE,), (True,))
    return router_lc.decide(spec, o, {}, T0, ctx)


def test_router_with_a_foreign_image_never_gets_the_keys_mounted():
    d = router_decision({**ROUTER, "image": "docker.io/attacker/router:1"})
    assert d.children == [] and d.phase == "Invalid"
    assert get_condition(d.status["conditions"], "Ready")["reason"] == "ImageNotAllowed"
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "ImageNotAllowed")]
    assert router_decision(ROUTER).children   # the default image runs


def test_torch_classifier_needs_the_operator_flag():
    torch = {**ROUTER, "classifier": {"kind": "torch", "modelConfigMapRef": {"name": "clf", "key": "model.pt"},
                                      "labels": ["algo"]}}
    d = router_decision(torch)
    assert d.children == [] and get_condition(d.status["conditions"], "ConfigValid")["reason"] == "TorchClassifierNotAllowed"
    allowed = BuildContext(engine_image=CTX.engine_image, router_image=CTX.router_image, allow_torch_classifier=True)
    assert router_decision(torch, allowed).children


def test_operator_flags_reach_the_build_context():
    from consort_operator.main import parse_args
    args = parse_args(["--allowed-image", "registry.internal/ml/", "--allow-torch-classifier"])
    assert args.allowed_image == ["registry.internal/ml/"] and args.allow_torch_classifier
    assert parse_args([]).allow_torch_classifier is False


# ---- bounded scratch space ------------------------------------------------------------------------


def pod_disk(pod: dict) -> tuple[list[dict], list[dict]]:
    """Disk emptyDirs and every container (init ones too) of a pod spec."""
    disk = [v for v in pod["volumes"] if "emptyDir" in v]
    return disk, pod.get("initContainers", []) + pod["containers"]


def assert_bounded(pod: dict) -> None:
    disk, containers = pod_disk(pod)
    assert disk and all("sizeLimit" in v["emptyDir"] for v in disk), disk
    for c in containers:
        assert "ephemeral-storage" in c["resources"].get("limits", {}), c["name"]
    # the main container's limit covers every disk emptyDir (the kubelet counts them against it)
    main = pod["containers"][0]["resources"]["limits"]["ephemeral-storage"]
    on_disk = sum(quantity_value(v["emptyDir"]["sizeLimit"]) for v in disk if v["emptyDir"].get("medium") != "Memory")
    assert quantity_value(main) > on_disk


def test_every_engine_emptydir_and_container_is_bounded():
    spec = SpecialistSpec.model_validate({
        "model": {"source": "hf://org/model", "tokenizer": "demo://tiny"},
        "adapters": [{"name": "a", "source": "demo://lora"}]})
    pod = specialist_res.engine_deployment("algo", "ns", "u", spec, CTX)["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"] if "emptyDir" in v} >= {"hf-cache", "tmp", "demo", "assembled", "dshm"}
    assert_bounded(pod)
    # a limit alone would default the request to it: a 100Gi download budget would not schedule
    for c in [pod["containers"][0], *pod["initContainers"]]:
        assert quantity_value(c["resources"]["requests"].get("ephemeral-storage", "256Mi")) <= quantity_value("1Gi"), c


def test_the_download_is_sized_by_ephemeral_storage_when_set():
    spec = SpecialistSpec.model_validate({"model": {"source": "hf://org/model"},
                                          "resources": {"ephemeralStorage": "300Gi"}})
    pod = specialist_res.engine_deployment("algo", "ns", "u", spec, CTX)["spec"]["template"]["spec"]
    hf = next(v for v in pod["volumes"] if v["name"] == "hf-cache")
    assert hf["emptyDir"]["sizeLimit"] == "300Gi"
    res = pod["containers"][0]["resources"]
    assert res["requests"]["ephemeral-storage"] == "300Gi"
    assert quantity_value(res["limits"]["ephemeral-storage"]) > quantity_value("300Gi")
    assert_bounded(pod)


def test_every_router_emptydir_and_container_is_bounded():
    pod = router_res.router_deployment("front", "ns", "u", EnsembleRouterSpec.model_validate(ROUTER), CTX)
    assert_bounded(pod["spec"]["template"]["spec"])
    res = pod["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert quantity_value(res["requests"]["ephemeral-storage"]) <= quantity_value("1Gi")   # explicit, small


# ---- `..` in pvc:// paths -------------------------------------------------------------------------


ESCAPES = ["pvc://models/../secrets", "pvc://models/a/../../b", "pvc://models/..", "pvc://models/a/.."]


@pytest.mark.parametrize("url", ESCAPES)
def test_pydantic_refuses_dotdot_in_pvc_paths(url):
    for spec in ({"model": {"source": url}}, {"model": {"source": "pvc://m/x", "tokenizer": url}},
                 {"model": {"source": "pvc://m/x"}, "adapters": [{"name": "a", "source": url}]}):
        with pytest.raises(ValidationError, match=r"must not contain '\.\.'"):
            SpecialistSpec.model_validate(spec)


def test_names_with_dots_are_still_paths():
    SpecialistSpec.model_validate({"model": {"source": "pvc://m/v1..2/x", "tokenizer": "pvc://m/.hidden"}})


def _cel_regexes() -> list[tuple[str, str]]:
    """(rule, the regex inside its matches('...')) of every dotdot rule in the generated CRD."""
    spec = crds.specialist_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    rules = spec["model"]["x-kubernetes-validations"] + spec["adapters"]["items"]["x-kubernetes-validations"]
    return [(r["rule"], re.search(r"matches\('([^']*)'\)", r["rule"]).group(1))
            for r in rules if "'..'" in r["message"]]


def test_the_crd_refuses_dotdot_by_cel():
    """No CEL evaluator here (no kube-apiserver binary in this checkout's cache): the rule text is
    checked, and its regex (RE2 and Python agree on this one: no escapes, no look-arounds) run."""
    rules = _cel_regexes()
    assert {r.split(".matches")[0].split("self.")[-1] for r, _ in rules} == {"source", "tokenizer"}
    assert len(rules) == 3   # model.source, model.tokenizer, adapters[].source
    for rule, regex in rules:
        assert rule.startswith("!") and "\\" not in regex
        assert all(re.search(regex, u) for u in ESCAPES)
        assert not any(re.search(regex, u) for u in ("pvc://m/v1..2/x", "pvc://m/x", "hf://org/m", "file:///a/../b"))


# ---- apiKeysSecretRef: only the EnsembleRouter's own namespace -------------------------------------

def test_api_keys_come_from_the_routers_own_namespace_and_its_role_reads_no_secrets():
    """Already so before issue 25 (kept by this test): the reference has no namespace, a Secret volume
    resolves in the pod's namespace, and the router's own Role grants nothing on Secrets."""
    children = {c["kind"]: c for c in router_decision(ROUTER).children}
    dep = children["Deployment"]
    assert dep["metadata"]["namespace"] == "ns"
    secrets = [v["secret"] for v in dep["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secrets == [{"secretName": "keys", "items": [{"key": "keys", "path": "keys"}]},
                       {"secretName": "front-engine-credential", "items": [{"key": "current", "path": "current"}]}]
    assert not [r for r in children["Role"]["rules"] if "secrets" in r["resources"]]
    with pytest.raises(ValidationError):
        EnsembleRouterSpec.model_validate(
            {"auth": {"apiKeysSecretRef": {"name": "keys", "key": "k", "namespace": "kube-system"}}})


# ---- an exposed router needs keys ------------------------------------------------------------------

def test_a_nodeport_or_loadbalancer_router_without_keys_is_refused():
    import pydantic

    for kind in ("NodePort", "LoadBalancer"):
        with pytest.raises(pydantic.ValidationError, match="needs auth.enabled"):
            EnsembleRouterSpec.model_validate({"service": {"type": kind}, "auth": {"enabled": False}})
        EnsembleRouterSpec.model_validate({"service": {"type": kind}})       # generated keys
        EnsembleRouterSpec.model_validate({"service": {"type": kind},
                                           "auth": {"apiKeysSecretRef": {"name": "keys", "key": "k"}}})
    EnsembleRouterSpec.model_validate({"service": {"type": "ClusterIP"}, "auth": {"enabled": False}})  # in-cluster only
    with pytest.raises(pydantic.ValidationError, match="needs auth.enabled"):
        EnsembleRouterSpec.model_validate({"auth": {"enabled": False, "apiKeysSecretRef": {"name": "keys", "key": "k"}}})
    spec = crds.ensemble_router_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert any("self.auth.enabled" in v["rule"] for v in spec["x-kubernetes-validations"])
