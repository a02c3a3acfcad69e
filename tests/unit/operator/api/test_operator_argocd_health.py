"""Argo CD health checks (examples/argocd/consort.dev/<Kind>/health.lua) run by a real Lua interpreter.

The testdata objects are built here from the operator's own pydantic status models (extra fields are
errors there), so a renamed or removed status field fails this test instead of silently making the
Lua read nil. `python tests/unit/operator/api/test_operator_argocd_health.py` rewrites testdata/ and
health_test.yaml; the test fails when the committed files differ from what the models produce.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lupa.lua51
import lupa.lua54
import pytest
import yaml

from consort_operator.api.base import API_VERSION
from consort_operator.api.router import EnsembleRouterSpec, EnsembleRouterStatus
from consort_operator.api.specialist import SpecialistSpec, SpecialistStatus

ARGOCD = Path(__file__).resolve().parents[4] / "examples" / "argocd" / "consort.dev"
T = "2026-11-25T01:00:00Z"
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


@dataclass(frozen=True)
class Case:
    name: str                        # testdata/<name>.yaml
    spec: dict[str, Any]
    status: dict[str, Any] | None    # camelCase, validated by the status model
    health: str
    message: str
    generation: int = 1


def cond(type_: str, status: bool, reason: str, message: str, generation: int = 1) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": T, "observedGeneration": generation}


def replicas(warm: int, total: int) -> list[dict[str, Any]]:
    return [{"pod": f"stl-7d9f-{i}", "warm": i < warm, "source": "engine"} for i in range(total)]


def specialist_status(phase: str, warm: int, desired: int, ready: dict, *extra_conds: dict, **fields: Any) -> dict:
    return {"observedGeneration": 1, "phase": phase, "replicas": desired, "desiredReplicas": desired,
            "readyReplicas": warm, "warmReplicas": warm, "updatedReplicas": desired, "ready": f"{warm}/{desired}",
            "selector": "consort.dev/specialist=stl", "replicaStatus": replicas(warm, desired),
            "conditions": [ready, cond("Warm", warm >= desired, "AllReplicasWarm" if warm >= desired else "Warming",
                                       f"{warm}/{desired} replicas warm"), *extra_conds], **fields}


SPEC = {"model": {"source": "demo://tiny"}, "replicas": 2, "minReady": 1, "resources": {"gpus": 0},
        "adapters": [{"name": "stl-v2", "source": "demo://lora?seed=2"}]}
READY = cond("Ready", True, "MinReadyWarm", "2/2 replicas warm (minReady 1)")
CLOSED = cond("Demoted", False, "BreakerClosed", "breaker Closed")
BREAKER_CLOSED = {"state": "Closed", "rate": 0.94, "samples": 50}


def adapter(state: str, message: str, samples: int = 0, passes: int = 0) -> dict[str, Any]:
    out = {"name": "stl-v2", "state": state, "since": T, "source": "demo://lora?seed=2", "loadedReplicas": 2,
           "samples": samples, "passes": passes, "message": message}
    return out | ({"rate": round(passes / samples, 4)} if samples else {})


SPECIALIST_CASES = [
    Case("no-status", SPEC, None, "Progressing", "Waiting for the operator to report status"),
    Case("stale-generation", SPEC, specialist_status("Ready", 2, 2, READY, CLOSED), "Progressing",
         "Waiting for the operator to observe generation 2", generation=2),
    Case("pending", SPEC, specialist_status("Pending", 0, 2, cond("Ready", False, "Unschedulable", "2 replica(s) not scheduled yet")),
         "Progressing", "Pending: 2 replica(s) not scheduled yet"),
    Case("warming", SPEC, specialist_status("Warming", 0, 2, cond("Ready", False, "Warming", "0/2 replicas warm, waiting for minReady 1")),
         "Progressing", "Warming: 0/2 replicas warm, waiting for minReady 1"),
    Case("failed-warmup-timeout", SPEC, specialist_status(
        "Failed", 0, 2, cond("Ready", False, "WarmupTimeout", "replica stl-7d9f-0 not warm 900 s after start (warmupTimeoutSeconds); 0/2 warm (minReady 1)")),
        "Degraded", "Failed: replica stl-7d9f-0 not warm 900 s after start (warmupTimeoutSeconds); 0/2 warm (minReady 1)"),
    Case("failed-crashloop", SPEC, specialist_status(
        "Failed", 0, 2, cond("Ready", False, "CrashLoopBackOff", "replica stl-7d9f-0: CrashLoopBackOff; 0/2 warm (minReady 1)")),
        "Degraded", "Failed: replica stl-7d9f-0: CrashLoopBackOff; 0/2 warm (minReady 1)"),
    Case("degraded-below-min-ready", {**SPEC, "minReady": 2}, specialist_status(
        "Degraded", 1, 2, cond("Ready", False, "BelowMinReady", "only 1/2 replicas warm, fewer than minReady 2"), CLOSED),
        "Degraded", "Degraded: only 1/2 replicas warm, fewer than minReady 2"),
    Case("scaled-to-zero", {**SPEC, "replicas": 0, "minReady": 0}, specialist_status(
        "Ready", 0, 0, cond("Ready", True, "MinReadyWarm", "0/0 replicas warm (minReady 0)")),
        "Suspended", "Scaled to zero replicas"),
    Case("idle", {**SPEC, "replicas": 0, "scaleToZero": {"idleAfter": "15m"}}, specialist_status(
        "Idle", 0, 0, cond("Ready", True, "ScaledToZero", "scaled to zero after 15m without requests; the next request starts a replica"),
        cond("Demoted", False, "BreakerClosed", "breaker Closed")),
        "Healthy", "Idle: scaled to zero after 15m without requests; the next request starts a replica"),
    Case("breaker-open", SPEC, specialist_status(
        "Ready", 2, 2, READY, cond("Demoted", True, "BreakerOpen", "breaker Open, fallback stl-general"),
        breaker={"state": "Open", "rate": 0.41, "samples": 50, "since": T, "fallback": "stl-general"}),
        "Degraded", "Breaker open: breaker Open, fallback stl-general"),
    Case("adapter-rolled-back", SPEC, specialist_status(
        "Ready", 2, 2, READY, CLOSED, cond("AdapterRollout", False, "RolledBack", "rolled back: stl-v2"),
        adapters=[adapter("RolledBack", "rolled back: rate 0.500 over 200 samples (floor 0.9)", 200, 100)]),
        "Degraded", "Adapter stl-v2 rolled back: rolled back: rate 0.500 over 200 samples (floor 0.9)"),
    Case("scaling-up", {**SPEC, "replicas": 3}, specialist_status(
        "Ready", 2, 3, cond("Ready", True, "MinReadyWarm", "2/3 replicas warm (minReady 1)"), CLOSED),
        "Progressing", "Warming: 2/3 replicas warm"),
    Case("adapter-probation", SPEC, specialist_status(
        "Ready", 2, 2, READY, CLOSED, cond("AdapterRollout", True, "Probation", "probation: stl-v2"),
        adapters=[adapter("Probation", "37/200 samples", 37, 35)], activeAdapter=None),
        "Progressing", "Adapter stl-v2 in Probation: 37/200 samples"),
    Case("healthy", SPEC, specialist_status(
        "Ready", 2, 2, READY, CLOSED, cond("AdapterRollout", False, "Stable", "no adapter rollout in progress"),
        adapters=[adapter("Active", "promoted: rate 0.960 over 200 samples (floor 0.9)", 200, 192)],
        activeAdapter="stl-v2", breaker=BREAKER_CLOSED,
        slo={"ttft": {"targetMs": 1000, "requests": 812, "attainment": 0.99},
             "itl": {"targetMs": 100, "requests": 790, "attainment": 0.97}}),
        "Healthy", "2/2 replicas warm (minReady 1)"),
]

RSPEC = {"replicas": 2, "specialistSelector": {"matchLabels": {"consort.dev/ensemble": "cpp"}}}
VALID = cond("ConfigValid", True, "Rendered", "3 lane(s)")


def lanes(ready: int) -> list[dict[str, Any]]:
    return [{"name": n, "phase": "Ready" if i < ready else "Warming", "warmReplicas": 1 if i < ready else 0,
             "breaker": "Closed"} for i, n in enumerate(("stl", "templates", "build"))]


def router_status(phase: str, ready_replicas: int, desired: int, ready_specialists: int, *conds: dict) -> dict:
    return {"observedGeneration": 1, "phase": phase, "replicas": desired, "readyReplicas": ready_replicas,
            "ready": f"{ready_replicas}/{desired}", "specialists": 3, "readySpecialists": ready_specialists,
            "lanes": lanes(ready_specialists), "configHash": "5f0c2a9e", "conditions": list(conds),
            "breakerState": {"version": 1, "breakers": {}}}


ROUTER_CASES = [
    Case("no-status", RSPEC, None, "Progressing", "Waiting for the operator to report status"),
    Case("stale-generation", RSPEC, router_status("Ready", 2, 2, 3, VALID, cond("Ready", True, "Serving", "2/2 router replicas, 3 Specialists Ready")),
         "Progressing", "Waiting for the operator to observe generation 4", generation=4),
    Case("invalid", RSPEC, {"observedGeneration": 1, "phase": "Invalid", "specialists": 3, "lanes": lanes(3), "conditions": [
        cond("ConfigValid", False, "InvalidConfig", "rules[0]: specialist 'missing' is not selected"),
        cond("Ready", False, "InvalidConfig", "rules[0]: specialist 'missing' is not selected")]},
        "Degraded", "Invalid: rules[0]: specialist 'missing' is not selected"),
    Case("pending", RSPEC, router_status("Pending", 0, 2, 3, VALID, cond("Ready", False, "RouterNotReady", "0/2 router replicas ready")),
         "Progressing", "Pending: 0/2 router replicas ready"),
    Case("degraded-specialists", RSPEC, router_status("Degraded", 2, 2, 1, VALID, cond("Ready", False, "SpecialistsNotReady", "1/3 Specialists Ready")),
         "Degraded", "Degraded: 1/3 Specialists Ready"),
    Case("scaled-to-zero", {**RSPEC, "replicas": 0}, router_status("Pending", 0, 0, 3, VALID, cond("Ready", False, "RouterNotReady", "0/0 router replicas ready")),
         "Suspended", "Scaled to zero replicas"),
    Case("scaling", RSPEC, router_status("Ready", 1, 2, 3, VALID, cond("Ready", True, "Serving", "1/2 router replicas, 3 Specialists Ready")),
         "Progressing", "Scaling: 1/2 router replicas ready"),
    Case("healthy", RSPEC, router_status("Ready", 2, 2, 3, VALID, cond("Ready", True, "Serving", "2/2 router replicas, 3 Specialists Ready")),
         "Healthy", "2/2 router replicas, 3 Specialists Ready"),
]

KINDS = {"Specialist": (SpecialistSpec, SpecialistStatus, SPECIALIST_CASES),
         "EnsembleRouter": (EnsembleRouterSpec, EnsembleRouterStatus, ROUTER_CASES)}


def manifest(kind: str, case: Case) -> dict[str, Any]:
    """The object Argo CD hands the Lua: spec and status through the operator's models (a field they
    lack fails validation); only the fields a case sets, so a new defaulted field changes no file."""
    spec_model, status_model, _ = KINDS[kind]
    obj = {"apiVersion": API_VERSION, "kind": kind,
           "metadata": {"name": "stl" if kind == "Specialist" else "cpp", "namespace": "default",
                        "generation": case.generation, "uid": "0b7c9f5e-2f47-4c1e-9a51-6f1b3a3c2d10"},
           "spec": spec_model.model_validate(case.spec).wire(exclude_unset=True)}
    if case.status is not None:
        obj["status"] = status_model.model_validate(case.status).wire(exclude_unset=True)
    return obj


def rendered(kind: str) -> dict[Path, str]:
    """Every file under examples/argocd/consort.dev/<kind>/ this module owns: testdata + health_test.yaml."""
    cases = KINDS[kind][2]
    out = {ARGOCD / kind / "testdata" / f"{c.name}.yaml": yaml.safe_dump(manifest(kind, c), sort_keys=False)
           for c in cases}
    tests = {"tests": [{"healthStatus": {"status": c.health, "message": c.message},
                        "inputPath": f"testdata/{c.name}.yaml"} for c in cases]}
    out[ARGOCD / kind / "health_test.yaml"] = yaml.safe_dump(tests, sort_keys=False, width=200)
    out[ARGOCD.parent / "argocd-cm-patch.yaml"] = argocd_cm_patch()
    return out


class LiteralDumper(yaml.SafeDumper):
    """Multi-line strings as `|` blocks, so the patch reads like the Lua it carries."""


LiteralDumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def argocd_cm_patch() -> str:
    """examples/argocd/argocd-cm-patch.yaml: both health.lua files under the keys Argo CD reads
    (resource.customizations.health.<group>_<Kind>), for `kubectl patch --patch-file`."""
    data = {f"resource.customizations.health.{ARGOCD.name}_{kind}": (ARGOCD / kind / "health.lua").read_text()
            for kind in sorted(KINDS)}
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "argocd-cm", "namespace": "argocd"}, "data": data}
    return ("# Generated from consort.dev/*/health.lua by tests/unit/operator/api/test_operator_argocd_health.py; do not edit.\n"
            "# kubectl -n argocd patch configmap argocd-cm --patch-file examples/argocd/argocd-cm-patch.yaml\n"
            + yaml.dump(cm, Dumper=LiteralDumper, sort_keys=False, width=200))


# Argo CD runs gopher-lua, a Lua 5.1; the scripts must also hold on a current Lua.
LUAS = {"lua5.1": lupa.lua51, "lua5.4": lupa.lua54}


def run_lua(script: str, obj: dict[str, Any], dialect: str = "lua5.1") -> dict[str, Any]:
    """Argo CD's calling convention: the object is the global `obj`, the chunk returns {status, message}."""
    lua = LUAS[dialect].LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(script)
    return {"status": hs["status"], "message": hs["message"]}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_testdata_is_generated_from_the_status_models(kind: str) -> None:
    for path, text in rendered(kind).items():
        assert path.is_file(), f"{path} missing: run python {Path(__file__).relative_to(ARGOCD.parents[2])}"
        assert path.read_text() == text, f"{path} drifted from the status models: regenerate it"
    listed = {p.name for p in (ARGOCD / kind / "testdata").iterdir()}
    assert listed == {f"{c.name}.yaml" for c in KINDS[kind][2]}, "stray testdata files"


@pytest.mark.parametrize("dialect", sorted(LUAS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_health_lua_matches_health_test_yaml(kind: str, dialect: str) -> None:
    script = (ARGOCD / kind / "health.lua").read_text()
    tests = yaml.safe_load((ARGOCD / kind / "health_test.yaml").read_text())["tests"]
    assert len(tests) >= 8
    seen = set()
    for t in tests:
        obj = yaml.safe_load((ARGOCD / kind / t["inputPath"]).read_text())
        got = run_lua(script, obj, dialect)
        assert got == t["healthStatus"], f"{kind} {t['inputPath']}: {got} != {t['healthStatus']}"
        assert got["status"] in ARGO_STATUSES
        seen.add(got["status"])
    assert seen == {"Healthy", "Progressing", "Degraded", "Suspended"}, seen


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_lua_reads_only_status_fields_the_model_has(kind: str) -> None:
    """A status field renamed in the model must not leave the Lua reading nil."""
    spec_model, status_model, _ = KINDS[kind]
    script = (ARGOCD / kind / "health.lua").read_text()
    fields = {f.alias or n for n, f in status_model.model_fields.items()}
    read = set(re.findall(r"\bstatus\.([A-Za-z]+)", script))
    assert read and read <= fields, sorted(read - fields)
    spec_fields = {f.alias or n for n, f in spec_model.model_fields.items()}
    assert set(re.findall(r"\bobj\.spec\.([A-Za-z]+)", script)) <= spec_fields


def test_argocd_cm_patch_carries_the_tested_lua() -> None:
    cm = yaml.safe_load((ARGOCD.parent / "argocd-cm-patch.yaml").read_text())
    for kind in KINDS:
        assert cm["data"][f"resource.customizations.health.consort.dev_{kind}"] == (ARGOCD / kind / "health.lua").read_text()


def test_health_lua_tolerates_missing_optional_fields() -> None:
    """Argo CD also evaluates objects straight from `kubectl apply` (no status) or with a bare status."""
    for kind in KINDS:
        script = (ARGOCD / kind / "health.lua").read_text()
        bare = {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": "x"}, "spec": {},
                "status": {"phase": "Ready"}}
        assert run_lua(script, bare)["status"] in ("Healthy", "Progressing")
        assert run_lua(script, {**bare, "status": {}})["status"] == "Progressing"


if __name__ == "__main__":
    for kind in KINDS:
        (ARGOCD / kind / "testdata").mkdir(parents=True, exist_ok=True)
        for path, text in rendered(kind).items():
            path.write_text(text)
            print("wrote", path.relative_to(ARGOCD.parents[2]), file=sys.stderr)
