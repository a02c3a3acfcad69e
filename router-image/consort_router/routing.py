"""The routing decision, a pure function of (routing table, request, observed lane state).

Order: pin (`model` = a specialist) -> declared intent -> detectors -> classifier -> default.
Then the lane state applies: an open breaker hands primary traffic to the lane's fallback and sends
the lane a shadow copy; a spiking lane (admission level >= 1) lowers its shadow threshold and lets
the second choice serve its low-confidence classifier traffic; fresh and half-open lanes are
shadowed for a share of their traffic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .breaker import CLOSED, HALF_OPEN, OPEN
from .classifier import Classifier
from .config import RouterConfig
from .detectors import CompiledDetector, compile_detector, detect, user_patterns


class RouteError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class LaneView:
    """What routing needs to know about one specialist right now."""

    breaker: str = CLOSED
    fresh: bool = False
    routable: bool = True       # at least one ready replica
    level: int = 0              # admission escalation level
    threshold_delta: float = 0.0


@dataclass(frozen=True)
class RouteInput:
    model: str | None
    intent: str | None
    text: str
    draw: float = 1.0           # uniform [0, 1) draw for fractional shadowing (fresh / half-open lanes)
    user_counts: tuple[int, ...] | None = None   # detectors' own-pattern counts (PatternSandbox); None: here


@dataclass(frozen=True)
class RouteDecision:
    specialist: str             # serves the primary
    routed: str                 # what rules/detectors/classifier chose (before breaker or spike fallback)
    intent: str                 # intent label (metrics, priority floors)
    source: str                 # pinned | intent | detector | classifier | default
    detail: str = ""            # detector name, classifier label, fallback reason
    confidence: float = 1.0     # top-1 probability (1.0 for rules)
    second: str | None = None
    shadow: str | None = None
    shadow_reason: str = ""     # low_confidence | breaker_open | fresh_lane | half_open
    breaker: str = CLOSED       # breaker state of `routed`


@dataclass
class RoutingTable:
    """Compiled from a RouterConfig: intent map, detectors and the trained classifier."""

    config: RouterConfig
    classifier: Classifier | None = None
    intents: dict[str, str] = field(default_factory=dict)
    detectors: list[CompiledDetector] = field(default_factory=list)
    specialist_intent: dict[str, str] = field(default_factory=dict)
    user_patterns: tuple[str | None, ...] | None = None   # per detector; None: no detector has its own

    @classmethod
    def build(cls, config: RouterConfig, classifier: Classifier | None) -> "RoutingTable":
        detectors = [compile_detector(d) for d in config.detectors]
        return cls(
            config=config,
            classifier=classifier,
            intents=config.intent_table(),
            detectors=detectors,
            specialist_intent={s.name: s.intents[0] for s in config.specialists if s.intents},
            user_patterns=user_patterns(detectors),
        )

    def consults_detectors(self, model: str | None, intent: str | None) -> bool:
        """Whether routing reads the detectors: neither pinned to a specialist nor a declared, known intent."""
        return (model is None or model == self.config.ensemble) and not (intent is not None and intent in self.intents)

    def threshold(self, intent: str) -> float:
        return self.config.shadow.thresholds.get(intent, self.config.shadow.default_threshold)


UNSPECIFIED = "unspecified"


def intent_label(table: RoutingTable, declared: str | None, routed: str) -> str:
    if declared is not None and declared in table.intents:
        return declared
    return table.specialist_intent.get(routed, UNSPECIFIED)


def classify(table: RoutingTable, text: str) -> tuple[str, float, str | None]:
    """(top label, its probability, second-best specialist) from the classifier."""
    assert table.classifier is not None
    dist = table.classifier.predict(text)
    ranked = sorted(dist.items(), key=lambda kv: (-kv[1], kv[0]))
    top, p = ranked[0]
    reject = table.config.classifier.reject_label
    second = next((lab for lab, _ in ranked[1:] if lab != reject), None)
    if top != reject and p < table.config.classifier.min_confidence:
        top = reject
    return top, p, second


def fallback_chain(cfg: RouterConfig, lanes: dict[str, LaneView], name: str) -> list[str]:
    """The routable lanes along `name`'s fallback links, in order (cycles cut)."""
    chain, seen = [], {name}
    spec = cfg.specialist(name)
    while spec is not None and spec.fallback is not None and spec.fallback not in seen:
        seen.add(spec.fallback)
        if lanes.get(spec.fallback, LaneView()).routable:
            chain.append(spec.fallback)
        spec = cfg.specialist(spec.fallback)
    return chain


def route(table: RoutingTable, req: RouteInput, lanes: dict[str, LaneView]) -> RouteDecision:
    cfg = table.config
    lane = lambda name: lanes.get(name, LaneView())  # noqa: E731

    # 1. pin: the caller insists on a specialist; no fallback, no shadow.
    if req.model is not None and req.model != cfg.ensemble:  # (consults_detectors mirrors steps 1-2)
        if cfg.specialist(req.model) is None:
            raise RouteError(404, "model_not_found",
                             f"model {req.model!r} is neither the ensemble {cfg.ensemble!r} nor one of its specialists")
        return RouteDecision(req.model, req.model, intent_label(table, req.intent, req.model), "pinned",
                             breaker=lane(req.model).breaker)

    # 2-5. rules, detectors, classifier, default
    confidence, second, detail = 1.0, None, ""
    if req.intent is not None and req.intent in table.intents:
        routed, source, detail = table.intents[req.intent], "intent", req.intent
    elif (d := detect(table.detectors, req.text, req.user_counts)) is not None:
        routed, source, detail = d.specialist, "detector", d.name
    elif table.classifier is not None:
        top, confidence, second = classify(table, req.text)
        if top == cfg.classifier.reject_label:
            if cfg.classifier.on_reject == "unroutable" or cfg.default_specialist is None:
                raise RouteError(422, "unroutable", "the classifier rejected this request; declare an intent "
                                 "(x-consort-intent) or pin a specialist (model)")
            routed, source, detail = cfg.default_specialist, "default", "reject"
        else:
            routed, source, detail = top, "classifier", top
    elif cfg.default_specialist is not None:
        routed, source = cfg.default_specialist, "default"
    else:
        raise RouteError(422, "unroutable", "no rule, detector or classifier routes this request and no "
                         "default_specialist is configured")

    intent = intent_label(table, req.intent, routed)
    r = lane(routed)
    spec = cfg.specialist(routed)
    assert spec is not None
    fallback = spec.fallback

    # An open breaker or no ready replica: the first routable lane of the fallback chain serves.
    # An open-breaker lane that can still serve gets the shadow copy (its correctness window goes
    # on); a lane without a ready replica gets nothing.
    if r.breaker == OPEN or not r.routable:
        reason = "breaker_open" if r.breaker == OPEN else "no_ready_replica"
        chain = fallback_chain(cfg, lanes, routed)
        if chain:
            shadow = routed if cfg.shadow.enabled and r.breaker == OPEN and r.routable else None
            return RouteDecision(chain[0], routed, intent, source, f"{detail}; {reason}", confidence, second,
                                 shadow=shadow, shadow_reason="breaker_open" if shadow else "", breaker=r.breaker)

    base = table.threshold(intent)
    low_confidence = source == "classifier" and confidence < base and second is not None and second != routed
    # spiking lane: its second choice catches its low-confidence traffic
    if r.level > 0 and low_confidence:
        s = lane(second)  # type: ignore[arg-type]
        if s.routable and s.level == 0 and s.breaker != OPEN:
            return RouteDecision(second, routed, intent_label(table, req.intent, second), source,  # type: ignore[arg-type]
                                 f"{detail}; spike_diverted", confidence, second, breaker=r.breaker)

    shadow, reason = None, ""
    if cfg.shadow.enabled:
        effective = max(0.0, base - r.threshold_delta)
        if source == "classifier" and confidence < effective and second is not None and second != routed:
            shadow, reason = second, "low_confidence"
        elif (r.fresh or r.breaker == HALF_OPEN) and req.draw < cfg.breaker.fresh_shadow_fraction:
            target = fallback if fallback is not None else (second if second != routed else None)
            if target is not None:
                shadow, reason = target, ("half_open" if r.breaker == HALF_OPEN else "fresh_lane")
        if shadow is not None and not lane(shadow).routable:
            shadow, reason = None, ""   # no shadow to a lane that cannot take it
    return RouteDecision(routed, routed, intent, source, detail, confidence, second, shadow, reason, r.breaker)
