"""The plan for one generation request: a pure function of (config, routing table, the parsed
request, observed lane state) that says who serves it, in failover order, whether a shadow runs,
and what the response headers claim. `server.handle_generation` executes a Plan and touches the
lane state only to record what happened.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .api import ApiError, ParsedRequest
from .config import RouterConfig
from .routing import LaneView, RouteDecision, RouteError, RouteInput, RoutingTable, fallback_chain, route


@dataclass(frozen=True)
class PlanInput:
    """What the plan needs besides the request: observed state and this request's random draws."""

    lanes: dict[str, LaneView]
    floors: dict[str, int]             # intent -> priority floor (admission escalation)
    shadow_room: bool                  # fewer shadows in flight than shadow.max_inflight
    verifier_available: bool
    route_draw: float = 1.0            # fractional shadowing of fresh / half-open lanes
    verify_draw: float = 1.0           # verifier sampling
    user_counts: tuple[int, ...] | None = None   # detectors' own-pattern counts, searched in PatternSandbox


@dataclass(frozen=True)
class Plan:
    decision: RouteDecision
    targets: tuple[str, ...]           # who may serve, in order: the routed lane, then its fallback chain
    shadow: str | None                 # lane that gets a shadow copy (None: none runs)
    verify: bool                       # sample the primary answer into the verifier
    admission: str                     # x-consort-admission once served: admitted | floor:N
    adapters: dict[str, str | None] = field(default_factory=dict)   # target -> adapter it serves with
    rejection: ApiError | None = None  # answer this instead of going upstream (priority floor)

    @property
    def capture(self) -> bool:
        """The primary's text is needed (shadow comparison or verification)."""
        return self.shadow is not None or self.verify

    def headers(self, served_by: str, admission: str | None = None, adapter: str | None = None) -> dict[str, str]:
        """The x-consort-* stamp for an answer from `served_by` (or for a rejection)."""
        return {
            "x-consort-specialist": served_by,
            "x-consort-breaker": self.decision.breaker,
            "x-consort-admission": admission or self.admission,
            "x-consort-adapter": adapter or self.adapters.get(served_by) or "none",
            "x-consort-shadow": self.shadow or "none",
        }


def plan_request(cfg: RouterConfig, table: RoutingTable, req: ParsedRequest, obs: PlanInput) -> Plan:
    """Raises ApiError for requests that cannot be routed (unknown model, unroutable); a request
    below its intent's priority floor gets a Plan whose `rejection` is set. Failover order: a pinned request has one target (the caller insisted); any
    other request may fall through its lane's fallback chain before the first byte."""
    try:
        d = route(table, RouteInput(req.model, req.intent, req.text, obs.route_draw, obs.user_counts), obs.lanes)
    except RouteError as e:
        raise ApiError(e.status, e.code, e.message, param="model" if e.status == 404 else None)
    admission, rejection = "admitted", None
    floor = obs.floors.get(d.intent)
    if floor is not None:
        admission = f"floor:{floor}"
        if req.priority < floor:
            admission = "rejected:priority_floor"
            rejection = ApiError(429, "priority_floor", f"intent {d.intent!r} is throttled: priority "
                                 f"{req.priority} is below the floor {floor}", retry_after_ms=cfg.admission.retry_after_ms)
    targets = (d.specialist,) if d.source == "pinned" else \
        (d.specialist, *[t for t in fallback_chain(table, obs.lanes, d.specialist) if t != d.routed])
    shadow = d.shadow if d.shadow is not None and obs.shadow_room else None
    verify = shadow is None and obs.verifier_available and obs.verify_draw < cfg.verifier.sample_rate
    requested = req.body.get("adapter")
    adapters = {t: requested or table.specialists[t].adapter for t in targets}
    if rejection is not None:
        shadow, verify = None, False
    return Plan(d, targets, shadow, verify, admission, adapters, rejection)
