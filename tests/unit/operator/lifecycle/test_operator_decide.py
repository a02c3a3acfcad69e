"""The operator's decisions as pure functions: lifecycle.specialist.decide and lifecycle.router.decide
over typed observations, their status checked against the CRD schema the apiserver prunes with."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from consort_operator.api import crds
from consort_operator.api.specialist import SpecialistSpec
from consort_operator.lifecycle import router as router_lc
from consort_operator.lifecycle import specialist as specialist_lc
from consort_operator.lifecycle.common import get_condition
from consort_operator.lifecycle.warmup import DeploymentObs, PodObs, ProbeResult
from consort_operator.resources import router as router_res
from consort_operator.resources.common import BuildContext

T0 = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
CTX = BuildContext(engine_image="engine:test", router_image="router:test", operator_namespace="consort-system")
PACING = specialist_lc.Pacing("engine", 2.0, 30.0)
SPEC = {"model": {"source": "pvc://m/algo"}, "replicas": 2, "minReady": 2,
        "adapters": [{"name": "v2", "source": "pvc://m/v2"}],
        "rollout": {"probationSamples": 10, "promotionFloor": 0.8, "probationWindow": "1h"}}


def pods(n: int, ready: bool = True) -> tuple[PodObs, ...]:
    return tuple(PodObs(f"algo-{i}", "Running", ready, True, started_at=T0) for i in range(n))


def observed(probes: dict[str, ProbeResult], router_states=(), n: int = 2) -> specialist_lc.SpecialistObserved:
    dep = DeploymentObs(generation=1, observed_generation=1, replicas=n, updated_replicas=n, ready_replicas=n,
                        available_replicas=n)
    return specialist_lc.SpecialistObserved("algo", "ns", "uid-1", 1, dep, pods(n), probes, tuple(router_states))


def warm(adapters: dict[str, str] | None = None) -> ProbeResult:
    return ProbeResult(reachable=True, warm=True, adapters=adapters or {})


def status_schema(kind: str) -> dict:
    crd = next(c for c in crds.all_crds() if c["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def pruned_paths(value, schema, path="status") -> list[str]:
    """Paths in `value` that a structural schema would prune (what the apiserver drops silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties")
            return [p for k, v in value.items() for p in pruned_paths(v, extra, f"{path}.{k}")] if isinstance(extra, dict) else []
        out = []
        for k, v in value.items():
            if k not in props:
                out.append(f"{path}.{k}")
            else:
                out += pruned_paths(v, props[k], f"{path}.{k}")
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in pruned_paths(v, schema.get("items") or {}, f"{path}[{i}]")]
    return []


def test_warming_then_ready_with_children_status_and_requeue():
    d = specialist_lc.decide(SPEC, observed({"algo-0": warm(), "algo-1": ProbeResult(reachable=True, warm=False)}),
                             {}, T0, CTX, PACING)
    assert {c["kind"] for c in d.children} >= {"Deployment", "Service", "PodDisruptionBudget"}
    assert d.phase == d.status["phase"] == "Warming" and d.status["warmReplicas"] == 1
    assert d.requeue_seconds == PACING.poll_seconds            # a cold replica: poll
    d2 = specialist_lc.decide(SPEC, observed({"algo-0": warm(), "algo-1": warm()}), d.status, T0 + timedelta(seconds=5),
                              CTX, PACING)
    assert d2.phase == "Ready" and {"ReplicaWarm", "AllReplicasWarm"} <= {e.reason for e in d2.events}
    assert get_condition(d2.status["conditions"], "Ready")["status"] == "True"
    assert d2.requeue_seconds > PACING.poll_seconds            # settled
    assert pruned_paths(d2.status, status_schema("Specialist")) == []


def test_adapter_rotation_resumes_from_status_after_an_operator_restart():
    """A restarted operator has only the object's status: deciding from it continues the rollout
    (Probation keeps its `since`, samples collected by the router since the lane revision promote)."""
    both = {"algo-0": warm({"v2": "loaded"}), "algo-1": warm({"v2": "loaded"})}
    d1 = specialist_lc.decide(SPEC, observed(both), {}, T0, CTX, PACING)
    d2 = specialist_lc.decide(SPEC, observed(both), d1.status, T0 + timedelta(seconds=10), CTX, PACING)
    [v2] = d2.status["adapters"]
    assert v2["state"] == "Probation"
    persisted = d2.status                                       # what the apiserver holds
    revision = router_res.Lane("algo", "ns", SpecialistSpec.model_validate(SPEC), "v2").revision
    router_state = {"breakers": {"algo": {"revision": revision, "total": 12, "samples": [1.0] * 12}}}
    # ... restart: no memory but the status; the router has since collected 12 passing samples.
    d3 = specialist_lc.decide(SPEC, observed(both, [router_state]), persisted, T0 + timedelta(minutes=5), CTX, PACING)
    [v2] = d3.status["adapters"]
    assert v2["state"] == "Active" and d3.status["activeAdapter"] == "v2"
    assert "AdapterPromoted" in {e.reason for e in d3.events}
    assert pruned_paths(d3.status, status_schema("Specialist")) == []
    # Deciding again from the new status is a fixed point: no events, same status.
    d4 = specialist_lc.decide(SPEC, observed(both, [router_state]), d3.status, T0 + timedelta(minutes=6), CTX, PACING)
    assert d4.events == [] and d4.status == d3.status


def test_invalid_spec_fails_without_children():
    d = specialist_lc.decide({"model": {"source": "s3://nope"}}, observed({}), {"phase": "Ready"}, T0, CTX, PACING)
    assert d.children == [] and d.phase == "Failed"
    ready = get_condition(d.status["conditions"], "Ready")
    assert ready["reason"] == "InvalidSpec"
    # The manifest's path and the accepted forms, not pydantic's location tuple and regex.
    assert ready["message"].startswith("spec.model.source: 's3://nope' is not one of pvc://CLAIM/PATH")
    assert "^(" not in ready["message"]


def test_invalid_spec_names_the_field_it_meant():
    d = specialist_lc.decide({"model": {"source": "demo://tiny"}, "replica": 2, "kv": {"blocksize": 16}},
                             observed({}), {}, T0, CTX, PACING)
    message = get_condition(d.status["conditions"], "Ready")["message"]
    assert message == ("spec.kv.blocksize: unknown field (did you mean blockSize?); "
                       "spec.replica: unknown field (did you mean replicas?)")


def test_status_with_an_unknown_field_is_refused_before_the_apiserver_could_prune_it():
    with pytest.raises(ValueError, match="warmReplicaz"):
        specialist_lc.typed_status({"phase": "Ready", "warmReplicaz": 2})
    with pytest.raises(ValueError, match="lanez"):
        router_lc.typed_status({"phase": "Ready", "lanez": []})


def test_router_decide_renders_config_and_phase():
    sel = router_lc.SelectedSpecialist("algo", SPEC, "Ready", 2, "Closed", None)
    spec = {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "cpp"}}, "replicas": 1}
    obs = router_lc.RouterObserved("cpp", "ns", "uid-r", 3, (sel,), (True,))
    d = router_lc.decide(spec, obs, {}, T0, CTX)
    assert d.phase == "Ready" and d.status["configHash"] and d.status["ready"] == "1/1"
    assert {c["kind"] for c in d.children} >= {"ConfigMap", "Deployment", "Service"}
    assert pruned_paths(d.status, status_schema("EnsembleRouter")) == []
    empty = router_lc.decide(spec, router_lc.RouterObserved("cpp", "ns", "uid-r", 3), d.status, T0, CTX)
    assert empty.phase == "Invalid" and empty.children == []
    assert [e.reason for e in empty.events] == ["NoSpecialists"]
    # The router's own breakerState is carried, never dropped from the decided status.
    kept = router_lc.decide(spec, obs, {"breakerState": {"version": 1, "breakers": {}}}, T0, CTX)
    assert kept.status["breakerState"] == {"version": 1, "breakers": {}}
