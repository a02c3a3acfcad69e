"""The decisions around a reconcile pass, pure: which children to read and write (drift, resync),
when to probe and when to look again, selectors both ways, the status keys and merge patch."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from consort_operator.lifecycle import children, pacing, selection, status
from consort_operator.lifecycle import specialist as specialist_lc
from consort_operator.lifecycle.ownership import Conflict
from consort_operator.lifecycle.warmup import DeploymentObs, PodObs, ProbeResult
from consort_operator.resources.common import ANNOTATION_HASH, FIELD_MANAGER, MANAGED_BY, BuildContext, owner_reference
from consort_operator.runtime import ObjectState

T0 = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
UID = "uid-web"


def child(kind: str = "Deployment", want: str = "h1") -> dict:
    return {"kind": kind, "metadata": {"name": "web", "namespace": "ns", "annotations": {ANNOTATION_HASH: want}}}


def live(want: str = "h1", generation: int = 1, owner_uid: str = UID) -> dict:
    return {"metadata": {"name": "web", "generation": generation, "annotations": {ANNOTATION_HASH: want},
                         "ownerReferences": [owner_reference("Specialist", "web", owner_uid)]}}


# ---- children: what to read, what to write ----------------------------------------------------------

def test_a_deployment_the_index_shows_current_is_neither_read_nor_written():
    owned = children.Owned()
    assert children.known_current(child(), owned, {"hash": "h1", "generation": 3}, resync=True)
    assert not children.known_current(child(want="h2"), owned, {"hash": "h1", "generation": 3}, resync=False)
    assert not children.known_current(child(), owned, None, resync=False)    # not in the index: read it


def test_a_deployment_someone_edited_is_drift_and_is_written_back():
    owned = children.Owned()
    owned.record(("Deployment", "web"), "h1", 3)
    assert children.known_current(child(), owned, {"hash": "h1", "generation": 3}, resync=False)
    assert not children.known_current(child(), owned, {"hash": "h1", "generation": 4}, resync=False)
    assert children.action(child(), live(generation=4), owned, UID) == "update"
    assert children.action(child(), live(generation=3), owned, UID) == "keep"   # the index lagged behind


def test_other_children_are_read_until_written_and_again_at_each_resync():
    owned = children.Owned()
    svc = child("Service")
    assert not children.known_current(svc, owned, None, resync=False)
    owned.record(("Service", "web"), "h1")
    assert children.known_current(svc, owned, None, resync=False)
    assert not children.known_current(svc, owned, None, resync=True)
    assert not children.known_current(child("Service", "h2"), owned, None, resync=False)


def test_children_of_a_new_parent_are_created_before_any_read():
    owned = children.Owned()
    assert children.create_first(child("Service"), owned, {})
    assert not children.create_first(child("Service"), owned, {"phase": "Ready"})   # after a restart: read first
    owned.record(("Service", "web"), "h1")
    assert not children.create_first(child("Service", "h2"), owned, {})   # known to exist: read, then update


def test_create_update_keep_or_refuse_from_the_live_object():
    owned = children.Owned()
    assert children.action(child("Service"), None, owned, UID) == "create"
    assert children.action(child("Service"), live("h0"), owned, UID) == "update"
    assert children.action(child("Service"), live("h1"), owned, UID) == "keep"
    refused = children.action(child("Service"), live("h1", owner_uid="someone-else"), owned, UID)
    assert isinstance(refused, Conflict) and "controlled by Specialist web" in refused.reason
    orphan = {"metadata": {"labels": {"app.kubernetes.io/managed-by": MANAGED_BY},
                           "managedFields": [{"manager": FIELD_MANAGER}]}}
    assert children.action(child("Service"), orphan, owned, UID) == "update"   # ours, orphaned: adopted
    events = children.written_events([(child(), "update"), (child("Service"), "create"), (child("ConfigMap"), "create")])
    assert [(e.reason, e.message) for e in events] == [("CreatedChildren", "created Service web, ConfigMap web"),
                                                       ("UpdatedChildren", "updated Deployment web")]
    assert children.written_events([]) == []    # nothing written: no Event


def test_resync_is_due_at_first_and_then_every_period():
    owned = children.Owned()
    assert children.resync_due(owned, 100.0, 600.0) and children.resync_in(owned, 100.0, 600.0) == 0.0
    owned.last_resync = 100.0
    assert not children.resync_due(owned, 699.0, 600.0) and children.resync_in(owned, 400.0, 600.0) == 300.0
    assert children.resync_due(owned, 700.0, 600.0)


# ---- pacing: probes and the next self-wake ----------------------------------------------------------

def test_engines_are_probed_unless_pod_readiness_alone_decides():
    assert pacing.probes_wanted("engine", False) and pacing.probes_wanted("engine-or-pod-ready", False)
    assert not pacing.probes_wanted("pod-ready", False)
    assert pacing.probes_wanted("pod-ready", True)      # a hot-load does not show in pod readiness
    pods = [{"name": "a", "deleting": False}, {"name": "b", "deleting": True}]
    assert pacing.probe_targets(pods) == ["a"]


def test_nothing_to_probe_and_no_deadline_means_no_timer():
    p = pacing.Pacing("engine-or-pod-ready", 2.0, 30.0)
    assert pacing.requeue_seconds(p, {}, settled=False, deadlines=[]) is None
    assert pacing.requeue_seconds(p, {}, settled=True, deadlines=[-5.0]) is None   # already past: no timer
    assert pacing.requeue_seconds(p, {}, settled=True, deadlines=[42.0]) == 42.0
    probes = {"a": ProbeResult(reachable=True, warm=False)}
    assert pacing.requeue_seconds(p, probes, settled=False, deadlines=[42.0]) == 2.0
    assert pacing.requeue_seconds(p, probes, settled=True, deadlines=[]) == 10.0


def test_a_refused_child_is_looked_at_again_every_idle_period():
    assert pacing.next_pass(None, False, 30.0) is None
    assert pacing.next_pass(None, True, 30.0) == 30.0
    assert pacing.next_pass(2.0, True, 30.0) == 2.0 and pacing.next_pass(50.0, False, 30.0) == 50.0


def test_deadlines_are_the_warmup_timeouts_of_cold_replicas_and_probation_ends():
    pods = [PodObs("cold", "Running", started_at=T0), PodObs("warm", "Running", ready=True, started_at=T0),
            PodObs("unstarted")]
    adapters = [{"name": "v2", "state": "Probation", "since": "2026-11-25T12:00:00Z"},
                {"name": "v1", "state": "Active", "since": "2026-11-25T11:00:00Z"}]
    out = pacing.deadlines(pods, {"warm"}, 900, adapters, 3600, T0 + timedelta(seconds=100))
    assert out == [800.5, 3500.5]


def test_retry_delay_backs_off_to_a_cap_and_a_conflict_retries_at_once():
    assert [pacing.retry_delay(r, False) for r in (0, 1, 2)] == [0.5, 1.0, 2.0]
    assert pacing.retry_delay(50, False) == pacing.RETRY_CAP_SECONDS
    assert pacing.retry_delay(3, True) == pacing.CONFLICT_RETRY_SECONDS


def test_decide_sets_no_timer_when_pod_readiness_is_the_signal_and_nothing_is_pending():
    spec = {"model": {"source": "pvc://m/algo"}, "replicas": 1, "minReady": 1}
    pods = (PodObs("algo-0", "Running", ready=True, scheduled=True, started_at=T0),)
    dep = DeploymentObs(generation=1, observed_generation=1, replicas=1, updated_replicas=1, ready_replicas=1,
                        available_replicas=1)
    obs = specialist_lc.SpecialistObserved("algo", "ns", "uid", 1, dep, pods)
    d = specialist_lc.decide(spec, obs, {}, T0, BuildContext(), pacing.Pacing("engine-or-pod-ready"))
    assert d.phase == "Ready" and d.requeue_seconds is None
    cold = specialist_lc.SpecialistObserved("algo", "ns", "uid", 1, dep, (PodObs("algo-0", "Running", started_at=T0),))
    d = specialist_lc.decide(spec, cold, {}, T0, BuildContext(), pacing.Pacing("engine-or-pod-ready"))
    assert d.phase == "Warming" and d.requeue_seconds == 900.5        # its warmup timeout, nothing sooner
    wanting = specialist_lc.SpecialistObserved("algo", "ns", "uid", 1, dep, cold.pods, unaddressed=("algo-0",))
    d = specialist_lc.decide(spec, wanting, {}, T0, BuildContext(), pacing.Pacing("engine", 2.0))
    assert d.requeue_seconds == 2.0                                    # only its engine can warm it: find it


def test_deployment_rollout_counters_other_than_updated_replicas_are_no_new_input():
    def obs(**kw) -> specialist_lc.SpecialistObserved:
        d = {"generation": 1, "observed_generation": 1, "replicas": 1, "updated_replicas": 1, "ready_replicas": 0,
             "available_replicas": 0, **kw}
        return specialist_lc.SpecialistObserved("a", "ns", "uid", 1, DeploymentObs(**d))
    base = specialist_lc.pass_inputs(obs(), "h1")
    assert specialist_lc.pass_inputs(obs(ready_replicas=1, available_replicas=1, observed_generation=2), "h1") == base
    assert specialist_lc.pass_inputs(obs(updated_replicas=0), "h1") != base
    assert specialist_lc.pass_inputs(obs(generation=2), "h1") != base
    assert specialist_lc.pass_inputs(obs(), "h2") != base


def test_the_echo_of_its_own_deployment_write_is_no_new_input():
    absent = specialist_lc.SpecialistObserved("a", "ns", "uid", 1)
    created = specialist_lc.SpecialistObserved("a", "ns", "uid", 1, DeploymentObs(generation=1, replicas=1))
    saved = specialist_lc.echo_inputs(specialist_lc.pass_inputs(absent, None), ("h1", 1))
    assert specialist_lc.pass_inputs(created, "h1") == saved          # the index catching up wakes no pass
    assert specialist_lc.pass_inputs(created, "h0") != saved          # someone else's content: a pass
    assert specialist_lc.pass_inputs(absent, None) != saved           # deleted since: a pass (recreates it)
    assert specialist_lc.echo_inputs(specialist_lc.pass_inputs(absent, None), None) == specialist_lc.pass_inputs(absent, None)
    owned = children.Owned()
    owned.record(("Deployment", "a"), "h1")
    assert owned.written(("Deployment", "a")) is None                 # generation unknown (after a restart)
    owned.record(("Deployment", "a"), "h1", 2)
    assert owned.written(("Deployment", "a")) == ("h1", 2)


# ---- selectors --------------------------------------------------------------------------------------

def test_selectors_pick_the_same_way_in_both_directions():
    routers = [{"name": "r1", "selector": {"matchLabels": {"team": "a"}}, "breakerState": {"v": 1}},
               {"name": "r2", "selector": {"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]},
                "breakerState": {"v": 2}}]
    assert [r["breakerState"] for r in selection.selecting_routers(routers, {"team": "a"})] == [{"v": 1}]
    assert [r["breakerState"] for r in selection.selecting_routers(routers, {"team": "b"})] == [{"v": 2}]
    entry = {"spec": {}, "phase": "Ready", "warmReplicas": 1, "breaker": "Closed", "laneAdapter": None}
    specialists = [{**entry, "name": "z", "labels": {"team": "a"}}, {**entry, "name": "b", "labels": {"team": "a"}},
                   {**entry, "name": "c", "labels": {"team": "c"}}]
    assert [s.name for s in selection.selected_specialists(specialists, {"matchLabels": {"team": "a"}})] == ["b", "z"]
    assert [s.name for s in selection.selected_specialists(specialists, None)] == ["b", "c", "z"]   # empty: all


# ---- status keys and the merge patch ----------------------------------------------------------------

def test_status_patch_holds_only_changed_owned_keys_and_nothing_when_unchanged():
    keys = status.SPECIALIST_STATUS_KEYS
    old = {"phase": "Warming", "warmReplicas": 0, "slo": {"x": 1}}
    new = {"phase": "Ready", "warmReplicas": 0, "notOurs": 1}
    patch = status.merge_patch(old, new, keys)
    assert patch == {"phase": "Ready", "slo": None}
    assert status.patched(old, patch) == {"phase": "Ready", "warmReplicas": 0}
    assert status.merge_patch(status.patched(old, patch), {"phase": "Ready", "warmReplicas": 0}, keys) == {}


def test_the_router_never_patches_the_breaker_state_its_pods_write():
    assert "breakerState" not in status.ROUTER_STATUS_KEYS and "configHash" in status.ROUTER_STATUS_KEYS
    assert {"phase", "conditions", "warmReplicas", "breaker"} <= status.SPECIALIST_STATUS_KEYS
    assert status.merge_patch({"breakerState": {"a": 1}}, {"breakerState": {"a": 2}}, status.ROUTER_STATUS_KEYS) == {}


def test_a_pass_before_the_watch_delivers_its_own_patch_compares_with_what_it_wrote():
    state = ObjectState()
    body = {"metadata": {"resourceVersion": "5"}, "status": {"phase": "Pending"}}
    assert state.prev_status(body) == {"phase": "Pending"}
    state.written = ("5", {"phase": "Ready"})
    assert state.prev_status(body) == {"phase": "Ready"}            # the watch has not caught up
    body = {"metadata": {"resourceVersion": "6"}, "status": {"phase": "Ready", "warmReplicas": 1}}
    assert state.prev_status(body) == {"phase": "Ready", "warmReplicas": 1}


def test_the_pass_that_rolls_an_adapter_back_stops_the_engines_loading_it():
    import json

    from consort_operator.api.specialist import SpecialistSpec
    from consort_operator.resources import router as router_res
    spec = {"model": {"source": "pvc://m/algo"}, "replicas": 1, "minReady": 1,
            "adapters": [{"name": "v2", "source": "pvc://m/v2"}],
            "rollout": {"probationSamples": 10, "promotionFloor": 0.9, "probationWindow": "1h"}}
    revision = router_res.Lane("algo", "ns", SpecialistSpec.model_validate(spec), "v2").revision
    breaker = {"version": 1, "breakers": {"algo": {"state": "closed", "revision": revision, "total": 20,
                                                    "samples": [1.0] * 5 + [0.0] * 5}}}
    prev = {"adapters": [{"name": "v2", "state": "Probation", "since": "2026-11-25T12:00:00Z", "source": "pvc://m/v2"}]}
    pods = (PodObs("algo-0", "Running", ready=True, scheduled=True, started_at=T0),)
    obs = specialist_lc.SpecialistObserved("algo", "ns", "uid", 1, None, pods, router_states=(breaker,))
    d = specialist_lc.decide(spec, obs, prev, T0, BuildContext(), pacing.Pacing("pod-ready"))
    assert [a["state"] for a in d.status["adapters"]] == ["RolledBack"]
    cm = next(c for c in d.children if c["kind"] == "ConfigMap")
    assert json.loads(cm["data"]["adapters.json"])["adapters"] == []
