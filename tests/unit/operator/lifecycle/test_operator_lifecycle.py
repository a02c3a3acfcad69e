"""Pure lifecycle state machines: warmup gating, adapter rollout, breaker mirroring, SLO attainment."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from consort_operator.api.specialist import SpecialistSpec
from consort_operator.lifecycle import breaker, rollout, slo, warmup
from consort_operator.lifecycle.common import get_condition
from consort_operator.lifecycle.warmup import PodObs, ProbeResult

T0 = datetime(2026, 11, 22, 12, 0, 0, tzinfo=timezone.utc)


def spec(**kw) -> SpecialistSpec:
    return SpecialistSpec.model_validate({"model": {"source": "pvc://m/x"}, **kw})


def running(name, ready=False, started=T0, **kw):
    return PodObs(name=name, phase="Running", ready=ready, scheduled=True, started_at=started, **kw)


def warm(b=True):
    return ProbeResult(reachable=True, warm=b)


UNREACHABLE = ProbeResult(reachable=False)


def test_warming_until_min_ready_replicas_report_warm_then_ready():
    s = spec(replicas=3, minReady=2)
    pods = [running("p0"), running("p1"), running("p2")]
    st1, ev1 = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm(False), "p2": warm(False)}, "engine", None, T0)
    assert st1["phase"] == "Warming" and st1["warmReplicas"] == 1 and st1["ready"] == "1/3"
    assert get_condition(st1["conditions"], "Ready")["status"] == "False"
    assert [e.reason for e in ev1] == ["ReplicaWarm", "Warming"]
    st2, ev2 = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm(), "p2": warm(False)}, "engine", st1, T0 + timedelta(seconds=5))
    assert st2["phase"] == "Ready" and st2["warmReplicas"] == 2
    assert get_condition(st2["conditions"], "Ready")["status"] == "True"
    assert get_condition(st2["conditions"], "Warm")["status"] == "False"   # 2/3: not all warm yet
    assert [e.reason for e in ev2] == ["ReplicaWarm", "Ready"]
    st3, ev3 = warmup.evaluate(s, 1, None, pods, {p.name: warm() for p in pods}, "engine", st2, T0 + timedelta(seconds=9))
    assert get_condition(st3["conditions"], "Warm")["status"] == "True"
    assert {e.reason for e in ev3} == {"ReplicaWarm", "AllReplicasWarm"}
    # The Ready condition did not flip, so its transition time stays.
    assert get_condition(st3["conditions"], "Ready")["lastTransitionTime"] == get_condition(st2["conditions"], "Ready")["lastTransitionTime"]


def test_kwok_readiness_does_not_count_under_the_engine_policy():
    s = spec(replicas=1, minReady=1)
    pods = [running("p0", ready=True)]
    st_engine, _ = warmup.evaluate(s, 1, None, pods, {"p0": UNREACHABLE}, "engine", None, T0)
    assert st_engine["phase"] == "Warming" and st_engine["replicaStatus"] == [{"pod": "p0", "warm": False, "source": "none"}]
    st_fb, _ = warmup.evaluate(s, 1, None, pods, {"p0": UNREACHABLE}, "engine-or-pod-ready", None, T0)
    assert st_fb["phase"] == "Ready" and st_fb["replicaStatus"][0]["source"] == "pod-ready"
    # A reachable engine overrides the pod condition under the fallback policy.
    st_cold, _ = warmup.evaluate(s, 1, None, pods, {"p0": warm(False)}, "engine-or-pod-ready", None, T0)
    assert st_cold["phase"] == "Warming"
    st_pod, _ = warmup.evaluate(s, 1, None, pods, {}, "pod-ready", None, T0)
    assert st_pod["phase"] == "Ready"


def test_pending_failed_and_degraded():
    s = spec(replicas=2, minReady=2, warmupTimeoutSeconds=60)
    pending, _ = warmup.evaluate(s, 1, None, [PodObs("p0"), PodObs("p1")], {}, "engine", None, T0)
    assert pending["phase"] == "Pending" and get_condition(pending["conditions"], "Ready")["reason"] == "Unschedulable"
    none_yet, _ = warmup.evaluate(s, 1, None, [], {}, "engine", None, T0)
    assert none_yet["phase"] == "Pending" and get_condition(none_yet["conditions"], "Ready")["reason"] == "NoReplicas"
    pods = [running("p0"), running("p1")]
    late, ev = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm(False)}, "engine", None, T0 + timedelta(seconds=61))
    assert late["phase"] == "Failed" and get_condition(late["conditions"], "Ready")["reason"] == "WarmupTimeout"
    assert any(e.type == "Warning" and e.reason == "Failed" for e in ev)
    crash, _ = warmup.evaluate(s, 1, None, [running("p0", waiting_reason="CrashLoopBackOff"), running("p1")],
                               {"p1": warm()}, "engine", None, T0)
    assert crash["phase"] == "Failed" and get_condition(crash["conditions"], "Ready")["reason"] == "CrashLoopBackOff"
    ready, _ = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm()}, "engine", None, T0)
    degraded, ev = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm(False)}, "engine", ready, T0 + timedelta(seconds=5))
    assert degraded["phase"] == "Degraded" and [e.reason for e in ev] == ["ReplicaCold", "Degraded"]
    back, ev = warmup.evaluate(s, 1, None, pods, {"p0": warm(), "p1": warm()}, "engine", degraded, T0 + timedelta(seconds=9))
    assert back["phase"] == "Ready"


def engine_pod(state: dict, last: dict | None = None, restarts: int = 0) -> dict:
    """A Pod object as the apiserver sends it, one engine container."""
    cs = {"name": "engine", "restartCount": restarts, "state": state}
    if last:
        cs["lastState"] = last
    return {"metadata": {"name": "p0", "labels": {"pod-template-hash": "h1"}},
            "status": {"phase": "Running", "startTime": "2026-11-22T11:00:00Z", "podIP": "10.0.0.5",
                       "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
                       "containerStatuses": [cs]}}


def test_the_warmup_clock_runs_from_the_containers_restart_not_the_pods_start():
    up = warmup.pod_fields(engine_pod({"running": {"startedAt": "2026-11-22T12:00:00Z"}}))
    assert up["started_at"] == "2026-11-22T12:00:00Z" and up["restarts"] == 0
    crashed = warmup.pod_fields(engine_pod({"waiting": {"reason": "CrashLoopBackOff"}},
                                           {"terminated": {"finishedAt": "2026-11-22T12:05:00Z", "exitCode": 137}}, 1))
    assert crashed["started_at"] == "2026-11-22T12:05:00Z", "not the pod's 11:00 start"
    assert crashed["waiting_reason"] == "CrashLoopBackOff" and crashed["restarts"] == 1
    # the kubelet's first report after a kill: the container terminated, not restarted yet (no lastState)
    killed = warmup.pod_fields(engine_pod({"terminated": {"finishedAt": "2026-11-22T12:07:00Z", "exitCode": 137}}))
    assert killed["started_at"] == "2026-11-22T12:07:00Z", "not the pod's 11:00 start"


def test_a_restarting_replica_degrades_a_ready_specialist_and_it_recovers():
    """The engine process is killed: its container restarts (CrashLoopBackOff between tries) and
    warms again. Degraded meanwhile, not Failed (a warmup timeout measured from the pod's start, or
    the back-off read as fatal), then Ready; only a replica that keeps crashing is Failed."""
    s = spec(replicas=1, minReady=1, warmupTimeoutSeconds=120)
    ready, _ = warmup.evaluate(s, 1, None, [running("p0", ready=True)], {"p0": warm()}, "engine", None, T0)
    assert ready["phase"] == "Ready"
    crash_at = T0 + timedelta(minutes=30)
    waiting = PodObs(name="p0", phase="Running", scheduled=True, started_at=crash_at, restarts=1,
                     waiting_reason="CrashLoopBackOff")
    down, ev = warmup.evaluate(s, 1, None, [waiting], {"p0": UNREACHABLE}, "engine", ready, crash_at + timedelta(seconds=5))
    assert (down["phase"], get_condition(down["conditions"], "Ready")["reason"]) == ("Degraded", "ReplicaRestarting")
    assert "Degraded" in [e.reason for e in ev]
    restarted = running("p0", started=crash_at + timedelta(seconds=10), restarts=1)
    warming, _ = warmup.evaluate(s, 1, None, [restarted], {"p0": warm(False)}, "engine", down, crash_at + timedelta(seconds=20))
    assert warming["phase"] == "Degraded"
    back, ev = warmup.evaluate(s, 1, None, [restarted], {"p0": warm()}, "engine", warming, crash_at + timedelta(seconds=30))
    assert back["phase"] == "Ready" and "Ready" in [e.reason for e in ev]
    looping = PodObs(name="p0", phase="Running", scheduled=True, started_at=crash_at, restarts=3,
                     waiting_reason="CrashLoopBackOff")
    failed, _ = warmup.evaluate(s, 1, None, [looping], {"p0": UNREACHABLE}, "engine", down, crash_at + timedelta(seconds=60))
    assert failed["phase"] == "Failed"
    # a Specialist that never served: a crashing replica is Failed at once, as before
    first, _ = warmup.evaluate(s, 1, None, [waiting], {"p0": UNREACHABLE}, "engine", None, crash_at)
    assert first["phase"] == "Failed"


def test_terminating_pods_are_not_replicas():
    s = spec(replicas=1, minReady=1)
    st_, _ = warmup.evaluate(s, 1, None, [running("old", deleting=True), running("new")],
                             {"old": warm(), "new": warm(False)}, "engine", None, T0)
    assert st_["replicas"] == 1 and st_["warmReplicas"] == 0 and st_["phase"] == "Warming"


pod_strategy = st.builds(
    lambda i, ready, phase, deleting, age: PodObs(f"p{i}", phase=phase, ready=ready, scheduled=phase != "Pending",
                                                  deleting=deleting, started_at=T0 - timedelta(seconds=age)),
    st.integers(0, 5), st.booleans(), st.sampled_from(["Pending", "Running"]), st.booleans(), st.integers(0, 2000))


@settings(max_examples=200, deadline=None)
@given(pods=st.lists(pod_strategy, max_size=6, unique_by=lambda p: p.name),
       replicas=st.integers(0, 6), warm_names=st.sets(st.sampled_from([f"p{i}" for i in range(6)])),
       policy=st.sampled_from(warmup.WARM_SIGNALS))
def test_evaluate_is_a_fixed_point(pods, replicas, warm_names, policy):
    """Re-evaluating unchanged observations changes nothing and emits nothing: no status churn."""
    s = spec(replicas=replicas, minReady=min(replicas, 2))
    probes = {p.name: warm(p.name in warm_names) for p in pods}
    first, _ = warmup.evaluate(s, 3, None, pods, probes, policy, None, T0)
    again, events = warmup.evaluate(s, 3, None, pods, probes, policy, first, T0)
    assert again == first and events == []
    assert first["warmReplicas"] <= first["replicas"] == sum(not p.deleting for p in pods)
    assert (first["phase"] == "Ready") == (first["warmReplicas"] >= s.min_ready)


ADAPTERS = [{"name": "v1", "source": "pvc://m/v1"}, {"name": "v2", "source": "pvc://m/v2"}]


def test_adapter_rollout_loading_probation_active_and_rolled_back():
    s = spec(adapters=ADAPTERS, rollout={"probationSamples": 10, "promotionFloor": 0.8, "probationWindow": "1h"})
    obs0 = {"v1": rollout.AdapterObs(loaded_replicas=1), "v2": rollout.AdapterObs(loaded_replicas=0)}
    a1, active, ev = rollout.evaluate(s, 2, obs0, None, T0)
    assert [a["state"] for a in a1] == ["Loading", "Loading"] and active is None
    assert [e.reason for e in ev] == ["AdapterLoading", "AdapterLoading"]
    obs1 = {"v1": rollout.AdapterObs(loaded_replicas=2), "v2": rollout.AdapterObs(loaded_replicas=2)}
    a2, _, ev = rollout.evaluate(s, 2, obs1, a1, T0 + timedelta(seconds=10))
    assert [a["state"] for a in a2] == ["Probation", "Probation"]
    obs2 = {"v1": rollout.AdapterObs(2, samples=10, passes=9), "v2": rollout.AdapterObs(2, samples=10, passes=5)}
    a3, active, ev = rollout.evaluate(s, 2, obs2, a2, T0 + timedelta(seconds=20))
    assert {a["name"]: a["state"] for a in a3} == {"v1": "Active", "v2": "RolledBack"}
    assert active == "v1" and {e.reason for e in ev} == {"AdapterPromoted", "AdapterRolledBack"}
    assert rollout.rolled_back(a3) == {"v2"}
    cond = get_condition(rollout.rollout_condition(None, a3, T0, 1), "AdapterRollout")
    assert cond["status"] == "False" and cond["reason"] == "RolledBack"
    # Steady: nothing moves, no events.
    a4, _, ev = rollout.evaluate(s, 2, obs2, a3, T0 + timedelta(seconds=30))
    assert a4 == a3 and ev == []
    # Removed from spec -> Retired; a new source restarts the rollout.
    s2 = spec(adapters=[{"name": "v2", "source": "pvc://m/v2-fixed"}])
    a5, active, ev = rollout.evaluate(s2, 2, {}, a4, T0 + timedelta(seconds=40))
    assert {a["name"]: a["state"] for a in a5} == {"v2": "Loading", "v1": "Retired"} and active is None
    assert {e.reason for e in ev} == {"AdapterLoading", "AdapterRetired"}


def test_probation_window_end_decides_on_the_samples_it_has():
    s = spec(adapters=ADAPTERS[:1], rollout={"probationSamples": 1000, "promotionFloor": 0.5, "probationWindow": "10m"})
    prev = [{"name": "v1", "state": "Probation", "since": "2026-11-22T12:00:00Z", "source": "pvc://m/v1"}]
    still, _, _ = rollout.evaluate(s, 1, {"v1": rollout.AdapterObs(1, 5, 4)}, prev, T0 + timedelta(minutes=5))
    assert still[0]["state"] == "Probation"
    done, active, _ = rollout.evaluate(s, 1, {"v1": rollout.AdapterObs(1, 5, 4)}, prev, T0 + timedelta(minutes=11))
    assert done[0]["state"] == "Active" and active == "v1"
    empty, _, _ = rollout.evaluate(s, 1, {"v1": rollout.AdapterObs(1, 0, 0)}, prev, T0 + timedelta(minutes=11))
    assert empty[0]["state"] == "Probation" and "without correctness samples" in empty[0]["message"]


def test_adapter_hot_load_progress_per_replica_from_engine_or_readiness():
    a = ProbeResult(reachable=True, warm=True, adapters={"v1": "loaded", "v2": "pending"})
    b = ProbeResult(reachable=True, warm=True, adapters={"v1": "loaded", "v2": "failed"},
                    adapter_errors={"v2": "no adapter_config.json in /x"})
    obs = rollout.observations_from_replicas(["v1", "v2"], [("e-a", "engine", a), ("e-c", "pod-ready", None),
                                                            ("e-b", "engine", b)])
    assert obs["v1"].loaded_replicas == 3 and obs["v2"].loaded_replicas == 1
    # Warm by pod readiness, yet probed: the engine's answer counts (a hot-load is not in readiness).
    ready_only = rollout.observations_from_replicas(["v2"], [("e-a", "pod-ready", a)])
    assert ready_only["v2"].loaded_replicas == 0 and ready_only["v2"].replicas[0]["state"] == "pending"
    assert obs["v2"].replicas == ({"pod": "e-a", "state": "pending"},
                                  {"pod": "e-b", "state": "failed", "message": "no adapter_config.json in /x"},
                                  {"pod": "e-c", "state": "unknown"})
    s = spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}, {"name": "v2", "source": "pvc://m/v2"}])
    st, _, _ = rollout.evaluate(s, 3, obs, None, T0)
    v1, v2 = st
    assert v1["state"] == "Probation" and [r["state"] for r in v1["replicas"]] == ["loaded", "loaded", "unknown"]
    assert v2["state"] == "Loading" and "hot-load failed on e-b: no adapter_config.json in /x" in v2["message"]
    # Through the typed status (what the CRD keeps): per-replica rows survive.
    from consort_operator.api.specialist import AdapterStatus
    assert AdapterStatus.model_validate(v2).wire()["replicas"][1]["message"].startswith("no adapter_config")


def router_state(state, samples, since=1_790_000_000.0):
    return {"version": 1, "breakers": {"algo": {"state": state, "samples": samples, "since": since}}}


def test_breaker_mirror_demotes_and_restores_with_events():
    b1, conds, ev = breaker.evaluate("algo", "stl", [router_state("open", [0.0, 1.0, 0.0, 0.0])], None, None, T0, 2)
    assert b1["state"] == "Open" and b1["rate"] == 0.25 and b1["samples"] == 4 and b1["fallback"] == "stl"
    assert get_condition(conds, "Demoted")["status"] == "True" and get_condition(conds, "Demoted")["reason"] == "BreakerOpen"
    assert [(e.type, e.reason) for e in ev] == [("Warning", "Demoted")]
    b2, conds2, ev = breaker.evaluate("algo", "stl", [router_state("open", [0.0, 1.0, 0.0, 0.0])], b1, conds, T0, 2)
    assert b2 == b1 and ev == [] and conds2 == conds
    b3, conds3, ev = breaker.evaluate("algo", "stl", [router_state("half_open", [1.0] * 4)], b2, conds2, T0, 2)
    assert b3["state"] == "HalfOpen" and [e.reason for e in ev] == ["Recovering"]
    b4, conds4, ev = breaker.evaluate("algo", "stl", [router_state("closed", [1.0] * 4)], b3, conds3, T0, 2)
    assert b4["state"] == "Closed" and get_condition(conds4, "Demoted")["status"] == "False"
    assert [e.reason for e in ev] == ["Restored"]


def test_breaker_most_severe_router_wins_and_absent_means_closed():
    b, _, _ = breaker.evaluate("algo", None, [router_state("closed", [1.0]), router_state("open", [0.0])], None, None, T0, 1)
    assert b["state"] == "Open"
    b, conds, ev = breaker.evaluate("algo", None, [], None, None, T0, 1)
    assert b == {"state": "Closed", "samples": 0} and ev == []


def test_lane_adapter_is_the_newest_rotation_in_probation_or_active():
    s = spec(adapters=ADAPTERS)
    assert rollout.lane_adapter(s.adapter_names(), None) is None
    st = lambda **kw: [{"name": n, "state": v} for n, v in kw.items()]  # noqa: E731
    assert rollout.lane_adapter(s.adapter_names(), st(v1="Active", v2="Loading")) == "v1"
    assert rollout.lane_adapter(s.adapter_names(), st(v1="Active", v2="Probation")) == "v2"
    assert rollout.lane_adapter(s.adapter_names(), st(v1="Active", v2="RolledBack")) == "v1"


def test_router_samples_count_only_for_the_current_lane_revision():
    entry = {"revision": "r1", "total": 120, "samples": [1.0] * 45 + [0.0] * 5}
    assert rollout.samples_from_router(entry, "r1") == (120, 108)
    assert rollout.samples_from_router(entry, "r0") is None
    assert rollout.samples_from_router({"revision": "r1", "total": 0, "samples": []}, "r1") is None


def slo_report(ttft: tuple[int, float] | None, itl: tuple[int, float] | None, ttft_ms=1000, itl_ms=100) -> dict:
    """An engine's /v1/status "slo" report: (requests, attainment) per objective."""
    out = {"quantile": 0.95, "window": 1000}
    if ttft:
        out["ttft"] = {"target_ms": ttft_ms, "requests": ttft[0], "attainment": ttft[1]}
    if itl:
        out["itl"] = {"target_ms": itl_ms, "requests": itl[0], "attainment": itl[1]}
    return out


def test_slo_pools_replicas_weighted_by_requests_and_ignores_stale_targets():
    s = spec(slo={"ttftMs": 1000, "itlMs": 100})
    reports = [slo_report((30, 1.0), (30, 0.9)), slo_report((10, 0.5), (10, 0.5)),
               slo_report((500, 0.0), (500, 0.0), ttft_ms=5000, itl_ms=50)]   # a replica on the old targets
    pooled = slo.pool(s, reports)
    assert pooled["ttft"] == {"targetMs": 1000, "requests": 40, "attainment": 0.875}
    assert pooled["itl"] == {"targetMs": 100, "requests": 40, "attainment": 0.8}


def test_slo_condition_unknown_then_missed_then_met_with_events():
    s = spec()
    st0, conds, ev = slo.evaluate(s, [slo_report((5, 0.0), (5, 0.0))], None, T0, 1)
    assert get_condition(conds, "SLOMet")["status"] == "Unknown" and ev == []
    assert get_condition(conds, "SLOMet")["reason"] == "NotEnoughRequests"
    st1, conds, ev = slo.evaluate(s, [slo_report((40, 0.99), (40, 0.5))], conds, T0, 1)
    c = get_condition(conds, "SLOMet")
    assert c["status"] == "False" and c["reason"] == "ITLMissed" and "50.0%" in c["message"]
    assert [(e.type, e.reason) for e in ev] == [("Warning", "SLOMissed")]
    _, conds, ev = slo.evaluate(s, [slo_report((40, 0.99), (40, 0.5))], conds, T0, 1)
    assert ev == []                                      # no event while nothing changes
    _, conds, ev = slo.evaluate(s, [slo_report((40, 0.5), (40, 0.5))], conds, T0, 1)
    assert get_condition(conds, "SLOMet")["reason"] == "TTFTITLMissed" and ev == []
    _, conds, ev = slo.evaluate(s, [slo_report((40, 0.96), (40, 1.0))], conds, T0, 1)
    assert get_condition(conds, "SLOMet")["status"] == "True" and [e.reason for e in ev] == ["SLOMet"]
    _, conds, _ = slo.evaluate(s, [], conds, T0, 1)      # no warm replica reports: no evidence
    assert get_condition(conds, "SLOMet")["status"] == "Unknown"
