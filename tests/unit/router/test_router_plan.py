"""plan_request: who serves (failover order), whether a shadow runs, what the headers claim.
Pure: (config, table, parsed request, observed lane state) -> Plan."""
from __future__ import annotations

import pytest

from consort_router.api import ApiError, parse_request
from consort_router.breaker import OPEN
from consort_router.config import RouterConfig
from consort_router.plan import PlanInput, plan_request
from consort_router.routing import LaneView, RoutingTable

CFG = RouterConfig.model_validate({
    "ensemble": "cpp",
    "specialists": [
        {"name": "Algo", "intents": ["codegen"], "fallback": "STL", "replicas": ["http://127.0.0.1:1"]},
        {"name": "STL", "intents": ["review"], "fallback": "Template", "replicas": ["http://127.0.0.1:2"],
         "adapter": "stl-v2"},
        {"name": "Template", "intents": ["templates"], "fallback": "Algo", "replicas": ["http://127.0.0.1:3"]},
    ],
    "default_specialist": "Algo",
})
TABLE = RoutingTable.build(CFG, None)


def obs(**lanes: LaneView) -> PlanInput:
    return PlanInput(lanes={n: lanes.get(n, LaneView()) for n in ("Algo", "STL", "Template")}, floors={},
                     shadow_room=True, verifier_available=False)


def req(intent: str | None = None, model: str = "cpp", **body):
    return parse_request({"model": model, "prompt": "x", **body}, "completion", intent)


def test_targets_are_the_lane_then_its_fallback_chain_and_a_pin_has_one():
    plan = plan_request(CFG, TABLE, req("codegen"), obs())
    assert plan.targets == ("Algo", "STL", "Template") and plan.shadow is None
    assert plan.headers("Algo")["x-consort-admission"] == "admitted"
    assert plan_request(CFG, TABLE, req(model="Algo"), obs()).targets == ("Algo",)


def test_no_ready_replica_routes_to_the_first_routable_fallback_without_a_shadow():
    plan = plan_request(CFG, TABLE, req("codegen"), obs(Algo=LaneView(routable=False), STL=LaneView(routable=False)))
    assert plan.decision.specialist == "Template" and plan.decision.routed == "Algo"
    assert plan.targets == ("Template",)     # the unroutable lanes are not tried again
    assert plan.shadow is None and "no_ready_replica" in plan.decision.detail
    h = plan.headers("Template")
    assert h["x-consort-specialist"] == "Template" and h["x-consort-shadow"] == "none"


def test_open_breaker_shadows_the_lane_only_when_it_can_take_it():
    served = plan_request(CFG, TABLE, req("codegen"), obs(Algo=LaneView(breaker=OPEN)))
    assert served.decision.specialist == "STL" and served.shadow == "Algo" and served.targets == ("STL", "Template")
    down = plan_request(CFG, TABLE, req("codegen"), obs(Algo=LaneView(breaker=OPEN, routable=False)))
    assert down.decision.specialist == "STL" and down.shadow is None


def test_no_room_for_shadows_drops_it_but_keeps_the_route():
    o = obs(Algo=LaneView(breaker=OPEN))
    full = PlanInput(o.lanes, {}, shadow_room=False, verifier_available=False)
    plan = plan_request(CFG, TABLE, req("codegen"), full)
    assert plan.decision.shadow == "Algo" and plan.shadow is None and not plan.capture


def test_priority_floor_rejects_with_headers_that_say_so():
    o = obs()
    plan = plan_request(CFG, TABLE, req("codegen", priority=0), PlanInput(o.lanes, {"codegen": 5}, True, False))
    assert isinstance(plan.rejection, ApiError) and plan.rejection.status == 429
    assert plan.headers("Algo")["x-consort-admission"] == "rejected:priority_floor"
    ok = plan_request(CFG, TABLE, req("codegen", priority=7), PlanInput(o.lanes, {"codegen": 5}, True, False))
    assert ok.rejection is None and ok.headers("Algo")["x-consort-admission"] == "floor:5"


def test_adapter_per_target_and_unknown_models_are_typed():
    plan = plan_request(CFG, TABLE, req("codegen"), obs())
    assert plan.adapters == {"Algo": None, "STL": "stl-v2", "Template": None}
    assert plan.headers("STL")["x-consort-adapter"] == "stl-v2"
    with pytest.raises(ApiError) as e:
        plan_request(CFG, TABLE, req(model="gpt-9"), obs())
    assert e.value.status == 404 and e.value.code == "model_not_found"
