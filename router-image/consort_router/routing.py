"""The routing decision, a pure function of (routing table, request, observed lane state).

Order: pin (`model` = a specialist) -> declared intent -> detectors -> classifier -> default.
A structural detector sends prompts that trip it to its specialist regardless of the classifier: it
counts regex occurrences in the prompt's first DETECTOR_SCAN_CHARS, its built-in pattern set searched
here plus the EnsembleRouter's own patterns, counted in a child process with a deadline
(detectors.PatternSandbox); `min_matches` or more trips it. Detectors are checked in configuration
order; the first that trips wins.
Then the lane state applies: an open breaker hands primary traffic to the lane's fallback and sends
the lane a shadow copy; a spiking lane (admission level >= 1) lowers its shadow threshold and lets
the second choice serve its low-confidence classifier traffic; fresh and half-open lanes are
shadowed for a share of their traffic.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from .api import DETECTOR_SCAN_CHARS
from .breaker import CLOSED, HALF_OPEN, OPEN
from .classifier import Classifier
from .config import Detector, RouterConfig, SpecialistRoute


# Each occurrence of any pattern counts once. Case-sensitive, multiline. Every pattern runs in time
# linear in the prompt: a match attempt scans a bounded stretch (to the next line, or the next
# "template" / "Thread" keyword), never to the end of the text from every start. The old
# `template\s*<[^;{}]*\btypename\s*=` scanned to the next ; { } from every "template": 64 KB of
# "template<" took 2.7 s of the event loop (test_router_detectors.py keeps them linear).
BUILTIN_PATTERNS: dict[str, tuple[str, ...]] = {
    "sfinae_templates": (
        r"\benable_if(?:_t)?\b",
        r"\bvoid_t\b",
        r"\bdecltype\s*\(",
        r"\bstd::declval\b",
        r"\brequires\b",
        r"\bconcept\b",
        r"template\s*<(?:(?!template\b)[^;{}])*?\btypename\s*=",   # a defaulted type parameter in this head
        r"\bstd::is_\w+(?:_v)?\b",
        r"\bconditional_t\b",
        r"\bSFINAE\b",
        r"::value\b",
        r"typename\s+\w+::type\b",
    ),
    "build_files": (
        r"\bcmake_minimum_required\b",
        r"\badd_(?:executable|library|subdirectory|compile_options)\s*\(",
        r"\btarget_(?:link_libraries|include_directories|compile_features|compile_definitions)\s*\(",
        r"\bfind_package\s*\(",
        r"\bCMakeLists\.txt\b",
        r"\bCMAKE_[A-Z_]+\b",
        r"\bcc_(?:library|binary|test)\s*\(",
        r"\b(?:BUILD\.bazel|WORKSPACE|MODULE\.bazel)\b",
        r"\bbazel\s+(?:build|test|run)\b",
        r'\bload\(\s*"@',
        r"\bdeps\s*=\s*\[",
        r"\bmake(?:\[\d+\])?:\s",
        r"\bninja:\s",
        r"\bcollect2: error\b",
        r"\bundefined reference to\b",
    ),
    "gdb_transcript": (
        r"^\(gdb\)",
        r"\bProgram received signal\b",
        r"^#\d+\s+0x[0-9a-fA-F]+ in ",
        r"^#\d+\s+[\w:<>~]+\s*\(",
        r"\bBreakpoint \d+\b",
        r"\bSIG(?:SEGV|ABRT|BUS|FPE|ILL)\b",
        r"\bSegmentation fault\b",
        r"\bcore dumped\b",
        r"\bAddressSanitizer\b",
        r"^\(lldb\)",
        r"\bframe #\d+",
        r"\bThread \d+ (?:(?!Thread )[^\n])*?received signal\b",  # to the line's end or the next "Thread "
    ),
}

SCAN_LIMIT = DETECTOR_SCAN_CHARS


def _alternation(patterns: Sequence[str]) -> str:
    return "|".join(f"(?:{p})" for p in patterns)


def count_matches(regex: re.Pattern[str], text: str, stop_at: int | None = None) -> int:
    n = 0
    for _ in regex.finditer(text, 0, SCAN_LIMIT):
        n += 1
        if stop_at is not None and n >= stop_at:
            break
    return n


@dataclass(frozen=True)
class CompiledDetector:
    name: str
    specialist: str
    regex: re.Pattern[str] | None    # the built-in set, searched in-process (linear)
    user_pattern: str | None         # the EnsembleRouter's patterns as one alternation (PatternSandbox)
    min_matches: int

    def count(self, text: str, stop_at: int | None = None) -> int:
        """Occurrences of the built-in patterns."""
        return count_matches(self.regex, text, stop_at) if self.regex is not None else 0


def compile_detector(d: Detector) -> CompiledDetector:
    builtin = re.compile(_alternation(BUILTIN_PATTERNS[d.builtin]), re.MULTILINE) if d.builtin else None
    return CompiledDetector(d.name, d.specialist, builtin, _alternation(d.patterns) if d.patterns else None,
                            d.min_matches)


def user_patterns(detectors: list[CompiledDetector]) -> tuple[str | None, ...] | None:
    """Each detector's own patterns (None where it has none), or None when no detector has any."""
    pats = tuple(d.user_pattern for d in detectors)
    return pats if any(pats) else None


def detect(detectors: list[CompiledDetector], text: str,
           user_counts: Sequence[int] | None = None) -> CompiledDetector | None:
    """The first detector (in order) that trips on `text`, or None. user_counts: each detector's
    occurrences of its own patterns, from PatternSandbox; None counts them here (tests, tools)."""
    for i, d in enumerate(detectors):
        n = d.count(text, stop_at=d.min_matches)
        if n < d.min_matches and d.user_pattern is not None:
            n += (user_counts[i] if user_counts is not None else
                  count_matches(re.compile(d.user_pattern, re.MULTILINE), text, d.min_matches - n))
        if n >= d.min_matches:
            return d
    return None


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
    specialists: dict[str, SpecialistRoute] = field(default_factory=dict)   # by name (names are unique)

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
            specialists={s.name: s for s in config.specialists},
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


def fallback_chain(table: RoutingTable, lanes: dict[str, LaneView], name: str) -> list[str]:
    """The routable lanes along `name`'s fallback links, in order (cycles cut)."""
    chain, seen = [], {name}
    spec = table.specialists.get(name)
    while spec is not None and spec.fallback is not None and spec.fallback not in seen:
        seen.add(spec.fallback)
        if lanes.get(spec.fallback, LaneView()).routable:
            chain.append(spec.fallback)
        spec = table.specialists.get(spec.fallback)
    return chain


def route(table: RoutingTable, req: RouteInput, lanes: dict[str, LaneView]) -> RouteDecision:
    cfg = table.config
    lane = lambda name: lanes.get(name, LaneView())  # noqa: E731

    # 1. pin: the caller insists on a specialist; no fallback, no shadow.
    if req.model is not None and req.model != cfg.ensemble:  # (consults_detectors mirrors steps 1-2)
        if req.model not in table.specialists:
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
    fallback = table.specialists[routed].fallback

    # An open breaker or no ready replica: the first routable lane of the fallback chain serves.
    # An open-breaker lane that can still serve gets the shadow copy (its correctness window goes
    # on); a lane without a ready replica gets nothing.
    if r.breaker == OPEN or not r.routable:
        reason = "breaker_open" if r.breaker == OPEN else "no_ready_replica"
        chain = fallback_chain(table, lanes, routed)
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
