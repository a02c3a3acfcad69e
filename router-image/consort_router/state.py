"""Router state: the swappable runtime (compiled from a config) and the long-lived lane state.

`Runtime` is immutable per config version; a reload builds a new one and swaps it in atomically, so
in-flight requests keep the one they started with. `Lanes` outlives reloads: breakers, admission
knobs and windows, the feedback ids issued for /v1/feedback (id -> tenant and specialists), and the
replica states (kept per (specialist, url) so a reload does not forget what the poller learned).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from . import admission as adm
from .breaker import BreakerState, BreakerStore, apply_revision, dump_states, is_fresh, load_states, observe
from .classifier import build_classifier
from .config import RouterConfig
from .replicas import ReplicaState
from .routing import LaneView, RoutingTable

log = logging.getLogger("consort.router.state")


@dataclass(frozen=True)
class Runtime:
    config: RouterConfig
    table: RoutingTable
    base_dir: Path
    replicas: dict[str, list[ReplicaState]]  # specialist -> its replicas (static or discovered)


def build_runtime(config: RouterConfig, base_dir: Path, lanes: "Lanes", previous: Runtime | None = None) -> Runtime:
    """Compile a config. The classifier is retrained unless its config is unchanged from `previous`."""
    if previous is not None and previous.config.classifier == config.classifier and \
            {s.name for s in previous.config.specialists} == {s.name for s in config.specialists}:
        classifier = previous.table.classifier
    else:
        classifier = build_classifier(config.classifier, {s.name for s in config.specialists}, base_dir)
    table = RoutingTable.build(config, classifier)
    replicas: dict[str, list[ReplicaState]] = {}
    for s in config.specialists:
        urls = s.replicas if s.service is None else lanes.discovered.get(s.name, [])
        replicas[s.name] = [lanes.replica(s.name, u) for u in urls]
    lanes.adopt(config)
    return Runtime(config, table, base_dir, replicas)


@dataclass(frozen=True)
class FeedbackGrant:
    """Who may give feedback on one answered request, and about whom (its primary, its shadow)."""

    tenant: str
    primary: str
    shadow: str | None


@dataclass
class Lanes:
    config: RouterConfig
    store: BreakerStore | None = None
    breakers: dict[str, BreakerState] = field(default_factory=dict)
    knobs: dict[str, adm.Knobs] = field(default_factory=dict)
    windows: dict[str, adm.RateWindow] = field(default_factory=dict)
    floors: dict[str, int] = field(default_factory=dict)
    feedback: OrderedDict = field(default_factory=OrderedDict)  # feedback id -> FeedbackGrant
    replica_states: dict[tuple[str, str], ReplicaState] = field(default_factory=dict)
    discovered: dict[str, list[str]] = field(default_factory=dict)  # cluster mode: specialist -> urls
    dirty: bool = False
    transitions: list[tuple[str, str, str]] = field(default_factory=list)  # (specialist, from, to), drained

    def replica(self, specialist: str, url: str) -> ReplicaState:
        key = (specialist, url)
        if key not in self.replica_states:
            self.replica_states[key] = ReplicaState(url=url, specialist=specialist)
        return self.replica_states[key]

    def restore(self) -> None:
        if self.store is None:
            return
        try:
            self.breakers.update(load_states(self.store.load()))
        except Exception:  # noqa: BLE001 - a broken store must not stop the router
            log.exception("could not load breaker state; starting closed")

    def adopt(self, config: RouterConfig, now: float | None = None) -> None:
        """Take a (new) config: create missing lanes, apply revision changes, drop removed lanes' knobs."""
        now = time.time() if now is None else now
        self.config = config
        for s in config.specialists:
            b = self.breakers.get(s.name)
            if b is None:
                self.breakers[s.name] = BreakerState(revision=s.revision, since=now)
                self.dirty = True
            elif b.revision != s.revision:
                self.breakers[s.name] = apply_revision(b, s.revision, now)
                if self.breakers[s.name].state != b.state:
                    self.transitions.append((s.name, b.state, self.breakers[s.name].state))
                self.dirty = True
            self.knobs.setdefault(s.name, adm.Knobs())
            self.windows.setdefault(s.name, adm.RateWindow())
        names = {s.name for s in config.specialists}
        for gone in set(self.knobs) - names:
            self.knobs.pop(gone, None)
            self.windows.pop(gone, None)
        self.floors = adm.priority_floors(config.admission, self.knobs)

    # ---- correctness
    def observe(self, specialist: str, value: float, now: float | None = None) -> BreakerState | None:
        b = self.breakers.get(specialist)
        if b is None:
            return None
        nb = observe(b, self.config.breaker, value, time.time() if now is None else now)
        if nb.state != b.state:
            self.transitions.append((specialist, b.state, nb.state))
            log.warning("breaker %s: %s -> %s (rate %.3f over %d samples)", specialist, b.state, nb.state,
                        nb.rate or 0.0, len(nb.samples))
        self.breakers[specialist] = nb
        self.dirty = True
        return nb

    def remember(self, feedback_id: str, tenant: str, specialist: str, shadow: str | None = None) -> None:
        """An id the router issued for one answered request (x-consort-feedback-id): who may report on
        it and about which specialists. The oldest are forgotten past limits.feedback_map_size."""
        fb = self.feedback
        fb[feedback_id] = FeedbackGrant(tenant, specialist, shadow)
        fb.move_to_end(feedback_id)
        while len(fb) > self.config.limits.feedback_map_size:
            fb.popitem(last=False)

    def claim(self, feedback_id: str, tenant: str) -> "FeedbackGrant | None":
        """The grant for `feedback_id` if `tenant` holds it, used up (each id counts once). Another
        tenant's id is left for its holder and answered like an unknown one."""
        g = self.feedback.get(feedback_id)
        if g is None or g.tenant != tenant:
            return None
        del self.feedback[feedback_id]
        return g

    def snapshot(self) -> dict | None:
        """The payload to save if anything changed since the last snapshot (taken on the event loop)."""
        if self.store is None or not self.dirty:
            return None
        self.dirty = False
        return dump_states(self.breakers)

    def write(self, payload: dict) -> None:
        """Save a snapshot (may run in a worker thread: touches only `payload` and the store)."""
        assert self.store is not None
        try:
            self.store.save(payload)
        except Exception:  # noqa: BLE001 - a broken store must not stop the router
            self.dirty = True
            log.exception("could not save breaker state")

    def save(self) -> None:
        """Snapshot and write now, on the calling thread (shutdown, tests)."""
        snap = self.snapshot()
        if snap is not None:
            self.write(snap)

    # ---- admission
    def record_response(self, specialist: str, rejected: bool, intent: str, now: float) -> None:
        w = self.windows.get(specialist)
        if w is not None:
            w.record(now, rejected, intent)

    def tick(self, now: float) -> None:
        cfg = self.config.admission
        for name, k in list(self.knobs.items()):
            stats = self.windows[name].stats(now, cfg.spike_window_s)
            nk = adm.step(cfg, k, stats, now)
            if nk.level != k.level:
                log.warning("admission %s: level %d -> %d (429s %d of %d in window)", name, k.level, nk.level,
                            stats.rejected, stats.total)
            self.knobs[name] = nk
        self.floors = adm.priority_floors(cfg, self.knobs)

    # ---- views
    def lane_views(self, runtime: Runtime) -> dict[str, LaneView]:
        cfg = self.config
        out = {}
        for s in runtime.config.specialists:
            b = self.breakers.get(s.name) or BreakerState()
            k = self.knobs.get(s.name) or adm.Knobs()
            out[s.name] = LaneView(
                breaker=b.state, fresh=is_fresh(b, cfg.breaker),
                routable=any(r.ready for r in runtime.replicas.get(s.name, ())),
                level=k.level, threshold_delta=adm.threshold_delta(cfg.admission, k),
            )
        return out
