"""Adapter rollout: Loading -> Probation -> Active | RolledBack; removed from spec -> Retired.

Pure: (spec adapters + rollout policy, per-adapter observations, previous adapter statuses, now)
-> (adapter statuses, active adapter, events).

  Loading     listed in spec, not yet loaded on every warm replica (engine /v1/status `adapters`)
  Probation   loaded everywhere; the router shadows `shadowFraction` of its traffic and collects
              correctness samples (compile-pass) for it
  Active      probationSamples collected with rate >= promotionFloor (or the probation window ended
              with samples whose rate clears the floor)
  RolledBack  the rate fell below promotionFloor after probationSamples (or at the window's end);
              the engines stop loading it (excluded from the pod template) until its source changes
  Retired     no longer listed in spec (kept in status as history, the last few only)
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..api.specialist import RolloutPolicy, SpecialistSpec
from .common import Event, parse_time, rfc3339, set_condition

RETIRED_KEPT = 5
LOADED_STATES = frozenset({"loaded", "active", "ready"})


@dataclass(frozen=True)
class AdapterObs:
    loaded_replicas: int = 0     # warm replicas whose engine reports the adapter loaded
    samples: int = 0             # correctness samples in the probation window (router)
    passes: int = 0
    replicas: tuple[dict[str, str], ...] = ()   # per warm replica: {pod, state[, message]} (AdapterReplicaStatus)

    @property
    def failures(self) -> list[str]:
        return [f"{r['pod']}: {r.get('message') or 'failed'}" for r in self.replicas if r["state"] == "failed"]


def _status(name: str, state: str, now: datetime, source: str, obs: AdapterObs, message: str) -> dict[str, Any]:
    out = {"name": name, "state": state, "since": rfc3339(now), "source": source,
           "loadedReplicas": obs.loaded_replicas, "samples": obs.samples, "passes": obs.passes, "message": message}
    if obs.samples:
        out["rate"] = round(obs.passes / obs.samples, 4)
    if obs.replicas and state != "RolledBack":     # a rolled-back adapter is unloaded on purpose
        out["replicas"] = [dict(r) for r in obs.replicas]
    return out


def _decide(policy: RolloutPolicy, obs: AdapterObs, since: datetime, now: datetime) -> tuple[str | None, str]:
    rate = obs.passes / obs.samples if obs.samples else None
    window_over = (now - since).total_seconds() >= policy.probation_window_seconds
    if obs.samples >= policy.probation_samples or (window_over and obs.samples > 0):
        assert rate is not None
        why = f"rate {rate:.3f} over {obs.samples} samples (floor {policy.promotion_floor})"
        return ("Active", f"promoted: {why}") if rate >= policy.promotion_floor else ("RolledBack", f"rolled back: {why}")
    if window_over:
        return None, "probation window ended without correctness samples; still in probation"
    return None, f"{obs.samples}/{policy.probation_samples} samples"


def evaluate(spec: SpecialistSpec, warm_replicas: int, observations: dict[str, AdapterObs],
             prev: list[dict[str, Any]] | None, now: datetime) -> tuple[list[dict[str, Any]], str | None, list[Event]]:
    events: list[Event] = []
    before = {a["name"]: a for a in prev or []}
    out: list[dict[str, Any]] = []
    listed = {a.name: a.source for a in spec.adapters or []}
    for name, source in listed.items():
        obs = observations.get(name, AdapterObs())
        old = before.get(name)
        if old is None or old.get("source") != source or old.get("state") == "Retired":
            st = _status(name, "Loading", now, source, obs, "waiting for every warm replica to load it")
            events.append(Event("Normal", "AdapterLoading", f"adapter {name}: loading ({source})"))
            old = st
        state = old["state"]
        since = parse_time(old.get("since")) or now
        message = old.get("message", "")
        new_state = state
        if state == "Loading":
            if warm_replicas > 0 and obs.loaded_replicas >= warm_replicas:
                new_state, message = "Probation", f"loaded on {obs.loaded_replicas} warm replica(s); collecting samples"
            else:
                message = f"loaded on {obs.loaded_replicas}/{warm_replicas} warm replica(s)"
                if obs.failures:   # stays Loading: a new source (or removing it) is the way out
                    message += "; hot-load failed on " + "; ".join(obs.failures)
        elif state == "Probation":
            decided, message = _decide(spec.rollout, obs, since, now)
            if decided:
                new_state = decided
        if new_state != state:
            since = now
            etype = "Warning" if new_state == "RolledBack" else "Normal"
            reason = {"Probation": "AdapterProbation", "Active": "AdapterPromoted", "RolledBack": "AdapterRolledBack"}[new_state]
            events.append(Event(etype, reason, f"adapter {name}: {message}"))
        st = _status(name, new_state, since, source, obs, message)
        if new_state in ("Active", "RolledBack") and new_state == state:
            st.update({k: old[k] for k in ("samples", "passes", "rate") if k in old})
        out.append(st)
    retired = []
    for name, old in before.items():
        if name in listed:
            continue
        if old.get("state") != "Retired":
            events.append(Event("Normal", "AdapterRetired", f"adapter {name}: removed from spec"))
            old = {**old, "state": "Retired", "since": rfc3339(now), "message": "removed from spec", "loadedReplicas": 0}
        retired.append(old)
    retired.sort(key=lambda a: a.get("since", ""), reverse=True)
    out.extend(retired[:RETIRED_KEPT])
    actives = [a for a in out if a["state"] == "Active"]
    active = max(actives, key=lambda a: (a["since"], a["name"]))["name"] if actives else None
    return out, active, events


def lane_adapter(adapter_names: list[str], adapters: list[dict[str, Any]] | None) -> str | None:
    """The adapter the router uses when a request names none: the newest rotation (last in spec
    order) that is in Probation or Active. A Probation adapter takes the lane under the router's
    fresh-lane shadowing, so its own correctness samples decide it; a rollback hands the lane back to
    the previous Active adapter. `adapter_names`: spec.adapters' names in spec order (the Specialist
    index passes them from the raw spec)."""
    state = {a.get("name"): a.get("state") for a in adapters or []}
    for name in reversed(adapter_names):
        if state.get(name) in ("Probation", "Active"):
            return name
    return None


def samples_from_router(entry: dict[str, Any] | None, revision: str) -> tuple[int, int] | None:
    """(samples, passes) the router collected for the lane since `revision` (its breaker entry:
    `total` samples since the revision, `samples` the rolling window of values in [0, 1])."""
    if not entry or entry.get("revision") != revision:
        return None
    total = int(entry.get("total") or 0)
    window = [float(x) for x in entry.get("samples") or []]
    if total <= 0 or not window:
        return None
    rate = sum(window) / len(window)
    return total, int(round(rate * total))


def rolled_back(adapters: list[dict[str, Any]] | None) -> frozenset[str]:
    """Adapters the engines must not load (durable in status)."""
    return frozenset(a["name"] for a in adapters or [] if a.get("state") == "RolledBack")


def rollout_condition(conditions: list[dict[str, Any]] | None, adapters: list[dict[str, Any]],
                      now: datetime, generation: int | None) -> list[dict[str, Any]]:
    loading = [a["name"] for a in adapters if a["state"] == "Loading"]
    probation = [a["name"] for a in adapters if a["state"] == "Probation"]
    rolled = [a["name"] for a in adapters if a["state"] == "RolledBack"]
    if loading or probation:
        parts = ([f"loading: {', '.join(loading)}"] if loading else []) + ([f"probation: {', '.join(probation)}"] if probation else [])
        return set_condition(conditions, "AdapterRollout", True, "Loading" if loading else "Probation",
                             "; ".join(parts), now, generation)
    if rolled:
        return set_condition(conditions, "AdapterRollout", False, "RolledBack",
                             f"rolled back: {', '.join(rolled)}", now, generation)
    return set_condition(conditions, "AdapterRollout", False, "Stable",
                         "no adapter rollout in progress", now, generation)


def observations_from_replicas(adapter_names: list[str], replicas: list[tuple[str, str, Any]],
                               samples: dict[str, tuple[int, int]] | None = None) -> dict[str, AdapterObs]:
    """Fold the warm replicas' signals (+ router samples, when known) into observations.

    `replicas` holds (pod, warm signal source, ProbeResult | None) per WARM replica. An engine that
    answered reports each adapter's hot-load (the engines follow the adapters ConfigMap), whatever
    signal made the replica warm. One that could not be asked (no pod address) counts as loaded
    ("unknown" in the per-replica status): its readinessProbe covers the adapters listed when it
    started, not a later hot-load.
    """
    out = {}
    for name in adapter_names:
        loaded = 0
        rows: list[dict[str, str]] = []
        for pod, source, probe in replicas:
            if probe is not None and probe.reachable:
                state = probe.adapters.get(name, "pending")
                state = state if state in ("loaded", "pending", "failed") else "loaded" if state in LOADED_STATES else "pending"
                row = {"pod": pod, "state": state}
                if state == "failed" and probe.adapter_errors.get(name):
                    row["message"] = probe.adapter_errors[name]
            else:
                state, row = "unknown", {"pod": pod, "state": "unknown"}
            loaded += state in ("loaded", "unknown")
            rows.append(row)
        s, ok = (samples or {}).get(name, (0, 0))
        out[name] = AdapterObs(loaded_replicas=loaded, samples=s, passes=ok, replicas=tuple(sorted(rows, key=lambda r: r["pod"])))
    return out
