"""Scale to zero, pure: the idle decision (lifecycle/scaling.py) and how decide() applies it."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from consort_operator.api.specialist import ScaleToZero, SpecialistSpec
from consort_operator.lifecycle import scaling, specialist as specialist_lc
from consort_operator.lifecycle.common import get_condition
from consort_operator.lifecycle.warmup import PodObs, ProbeResult
from consort_operator.resources.common import BuildContext

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone.utc)
POLICY = ScaleToZero(idle_after="5m")


def test_no_policy_never_scales():
    assert scaling.decide(None, 2, 2, 2, 10_000.0) == scaling.KEEP


def test_idle_for_the_whole_window_scales_to_zero():
    d = scaling.decide(POLICY, 2, 2, 2, 300.0)
    assert d.replicas == 0 and not d.idle and "scaling to zero" in d.message


def test_inside_the_window_keeps_replicas_and_rechecks_when_it_ends():
    d = scaling.decide(POLICY, 2, 2, 2, 120.0)
    assert d.replicas is None and d.recheck_seconds == pytest.approx(180.0)


@pytest.mark.parametrize("live,warm,idle", [(1, 1, 900.0), (2, 1, 900.0), (2, 2, None)])
def test_unsettled_or_unknown_keeps_replicas(live, warm, idle):
    # a replica still starting, one still warming, or one that gave no idle figure: nobody knows
    assert scaling.decide(POLICY, 2, live, warm, idle) == scaling.KEEP


def test_zero_replicas_is_idle_and_writes_nothing():
    d = scaling.decide(POLICY, 0, 0, 0, None)
    assert d.idle and d.replicas is None


def test_least_idle_is_the_busiest_replica_and_unknown_wins():
    assert scaling.least_idle_seconds([400.0, 12.5, 90.0]) == 12.5
    assert scaling.least_idle_seconds([400.0, None]) is None
    assert scaling.least_idle_seconds([]) is None


def test_spec_rules():
    base = {"model": {"source": "demo://tiny"}}
    # replicas 0 with the default minReady 1 is allowed only with scaleToZero
    with pytest.raises(ValidationError, match="minReady must not exceed replicas"):
        SpecialistSpec.model_validate({**base, "replicas": 0})
    SpecialistSpec.model_validate({**base, "replicas": 0, "scaleToZero": {}})
    with pytest.raises(ValidationError, match="at least 5s"):
        SpecialistSpec.model_validate({**base, "scaleToZero": {"idleAfter": "4s"}})
    with pytest.raises(ValidationError, match="needs spec.fallback"):
        SpecialistSpec.model_validate({**base, "scaleToZero": {"whileCold": "fallback"}})
    s = SpecialistSpec.model_validate({**base, "fallback": "other", "scaleToZero": {"whileCold": "fallback", "idleAfter": "90s"}})
    assert s.scale_to_zero.idle_after_seconds == 90 and s.scale_to_zero.max_held == 64


def _decide(spec: dict, pods: list[PodObs], probes: dict[str, ProbeResult], prev: dict) -> specialist_lc.Decision:
    obs = specialist_lc.SpecialistObserved("algo", "default", "uid-1", 1, None, tuple(pods), probes)
    return specialist_lc.decide(spec, obs, prev, T0, BuildContext(),
                                specialist_lc.Pacing(warm_signal="engine"))


SPEC = {"model": {"source": "demo://tiny"}, "resources": {"gpus": 0}, "replicas": 1, "scaleToZero": {"idleAfter": "30s"}}


def test_decide_writes_zero_after_the_window_and_reads_idle_at_zero():
    pod = PodObs("algo-0", phase="Running", ready=True, scheduled=True, started_at=T0)
    busy = _decide(SPEC, [pod], {"algo-0": ProbeResult(reachable=True, warm=True, idle_s=10.0)}, {})
    assert busy.scale_to is None and busy.phase == "Ready" and busy.requeue_seconds <= 20.0
    quiet = _decide(SPEC, [pod], {"algo-0": ProbeResult(reachable=True, warm=True, idle_s=31.0)}, busy.status)
    assert quiet.scale_to == 0 and "ScaledToZero" in [e.reason for e in quiet.events]
    # The next pass sees spec.replicas 0 (the pod still terminating or gone): Idle, Ready, no warning.
    idle = _decide({**SPEC, "replicas": 0}, [], {}, quiet.status)
    assert idle.phase == "Idle" and idle.scale_to is None
    assert get_condition(idle.status["conditions"], "Ready")["status"] == "True"
    assert get_condition(idle.status["conditions"], "Ready")["reason"] == "ScaledToZero"
    assert [e.type for e in idle.events] == ["Normal"] and [e.reason for e in idle.events] == ["Idle"]
    again = _decide({**SPEC, "replicas": 0}, [], {}, idle.status)
    assert again.phase == "Idle" and again.events == []


def test_router_config_and_role_for_a_lane_that_scales_to_zero():
    from consort_operator.api.router import EnsembleRouterSpec
    from consort_operator.resources import router as router_res

    algo = SpecialistSpec.model_validate({**SPEC, "fallback": "general", "scaleToZero": {"whileCold": "fallback", "maxHeld": 5}})
    general = SpecialistSpec.model_validate({"model": {"source": "demo://tiny"}, "resources": {"gpus": 0}})
    cfg = router_res.router_config("cpp", EnsembleRouterSpec(), [router_res.Lane("algo", "ns", algo),
                                                                 router_res.Lane("general", "ns", general)])
    z = cfg.specialist("algo").scale_from_zero
    assert z is not None and z.while_cold == "fallback" and z.max_held == 5 and z.hold_timeout_s == 60
    assert cfg.specialist("general").scale_from_zero is None
    # Without its fallback in the ensemble the lane holds.
    alone = router_res.router_config("cpp", EnsembleRouterSpec(), [router_res.Lane("algo", "ns", algo)])
    assert alone.specialist("algo").scale_from_zero.while_cold == "hold"
    role = next(o for o in router_res.router_children("cpp", "ns", "uid", EnsembleRouterSpec(), cfg, BuildContext())
                if o["kind"] == "Role")
    scale_rules = [r for r in role["rules"] if any(res.endswith("/scale") for res in r["resources"])]
    assert scale_rules == [{"apiGroups": ["consort.dev"], "resources": ["specialists/scale"],
                            "resourceNames": ["algo"], "verbs": ["patch"]}]
