"""Routing decisions: pin, declared intent, detectors, classifier (+ reject), shadows, breaker fallback,
spike diversion. All pure: (table, request, lane views) -> decision."""
from __future__ import annotations

from pathlib import Path

import pytest

import consort_router
from consort_router.breaker import HALF_OPEN, OPEN
from consort_router.classifier import build_classifier, load_examples, train_naive_bayes
from consort_router.config import RouterConfig
from consort_router.routing import LaneView, RouteError, RouteInput, RoutingTable, compile_detector, detect, route

EXAMPLES = Path(consort_router.__file__).parent / "examples" / "cpp_routing.jsonl"
NAMES = ["Algo", "Template", "Memory", "Concurrency", "Systems", "Build", "Debug", "STL"]

SFINAE = """
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
auto f(T t) -> decltype(t + 1) { return t + 1; }
template <typename T, typename = void> struct has_x : std::false_type {};
template <typename T> struct has_x<T, std::void_t<decltype(std::declval<T>().x)>> : std::true_type {};
"""
CMAKE = """cmake_minimum_required(VERSION 3.20)
project(demo CXX)
add_executable(demo main.cpp)
target_link_libraries(demo PRIVATE fmt::fmt)
"""
GDB = """(gdb) run
Program received signal SIGSEGV, Segmentation fault.
0x0000555555555149 in main () at crash.cpp:4
(gdb) bt
#0  0x0000555555555149 in main () at crash.cpp:4
"""


def make_config(**over) -> RouterConfig:
    specs = []
    for n in NAMES:
        s = {"name": n, "replicas": [f"http://127.0.0.1:{9000 + len(specs)}"]}
        specs.append(s)
    specs[NAMES.index("Template")]["intents"] = ["templates"]
    specs[NAMES.index("Template")]["fallback"] = "STL"
    specs[NAMES.index("Debug")]["intents"] = ["debug"]
    specs[NAMES.index("Build")]["intents"] = ["build-fix"]
    specs[NAMES.index("Algo")]["intents"] = ["codegen"]
    specs[NAMES.index("Algo")]["fallback"] = "STL"
    data = {
        "ensemble": "cpp",
        "specialists": specs,
        "rules": [{"intent": "review", "specialist": "STL"}],
        "detectors": [
            {"name": "sfinae", "specialist": "Template", "builtin": "sfinae_templates", "min_matches": 3},
            {"name": "build", "specialist": "Build", "builtin": "build_files", "min_matches": 2},
            {"name": "gdb", "specialist": "Debug", "builtin": "gdb_transcript", "min_matches": 2},
        ],
        "classifier": {"examples_path": str(EXAMPLES)},
        "shadow": {"default_threshold": 0.5, "thresholds": {"review": 0.95}},
    }
    data.update(over)
    return RouterConfig.model_validate(data)


@pytest.fixture(scope="module")
def table() -> RoutingTable:
    cfg = make_config()
    clf = build_classifier(cfg.classifier, set(NAMES), Path("."))
    return RoutingTable.build(cfg, clf)


def lanes(**views) -> dict[str, LaneView]:
    out = {n: LaneView() for n in NAMES}
    out.update(views)
    return out


def test_declared_intent_routes_to_its_specialist(table):
    d = route(table, RouteInput("cpp", "debug", "Write a poem about the ocean"), lanes())
    assert (d.specialist, d.source, d.intent, d.shadow) == ("Debug", "intent", "debug", None)
    d = route(table, RouteInput(None, "review", "anything"), lanes())
    assert (d.specialist, d.source) == ("STL", "intent")


def test_unknown_intent_falls_through_to_detectors_and_classifier(table):
    d = route(table, RouteInput("cpp", "no-such-intent", CMAKE), lanes())
    assert (d.specialist, d.source, d.detail) == ("Build", "detector", "build")


@pytest.mark.parametrize("text,specialist,det", [(SFINAE, "Template", "sfinae"), (CMAKE, "Build", "build"),
                                                 (GDB, "Debug", "gdb")])
def test_detectors(table, text, specialist, det):
    d = route(table, RouteInput("cpp", None, text), lanes())
    assert (d.specialist, d.source, d.detail, d.confidence) == (specialist, "detector", det, 1.0)


def test_detector_min_matches_and_order():
    cfg = make_config()
    dets = [compile_detector(d) for d in cfg.detectors]
    # one SFINAE-ish token is not "SFINAE-heavy"
    assert detect(dets, "use std::enable_if here") is None
    assert detect(dets, "enable_if and void_t and decltype(x)").name == "sfinae"
    custom = RouterConfig.model_validate({
        "ensemble": "e", "specialists": [{"name": "A"}, {"name": "B"}],
        "detectors": [{"name": "first", "specialist": "A", "patterns": [r"\bfoo\b"], "min_matches": 2},
                      {"name": "second", "specialist": "B", "patterns": [r"\bfoo\b"], "min_matches": 1}]})
    cd = [compile_detector(d) for d in custom.detectors]
    assert detect(cd, "foo").name == "second"
    assert detect(cd, "foo foo").name == "first"


def test_bad_detector_pattern_is_a_config_error():
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"ensemble": "e", "specialists": [{"name": "A"}],
                                     "detectors": [{"name": "x", "specialist": "A", "patterns": ["("]}]})


@pytest.mark.parametrize("text,expected", [
    ("Implement Dijkstra shortest path with a priority queue and analyse complexity", "Algo"),
    ("my shared_ptr cycle leaks memory, use weak_ptr?", "Memory"),
    ("deadlock with two mutexes and a condition_variable between threads", "Concurrency"),
    ("epoll based non-blocking socket server on Linux", "Systems"),
    ("std::ranges::sort with a projection on a vector of structs", "STL"),
])
def test_classifier_routes_by_content(table, text, expected):
    d = route(table, RouteInput("cpp", None, text), lanes())
    assert d.source == "classifier" and d.specialist == expected, d
    assert 0 < d.confidence <= 1 and d.second not in (None, expected)


def test_classifier_distribution_is_normalised(table):
    dist = table.classifier.predict("std::vector iterator invalidation")
    assert set(dist) == set(NAMES) | {"reject"}
    assert abs(sum(dist.values()) - 1) < 1e-9


def test_reject_is_typed_422_or_default(table):
    with pytest.raises(RouteError) as e:
        route(table, RouteInput("cpp", None, "What is the capital of France? Tell me a joke"), lanes())
    assert (e.value.status, e.value.code) == (422, "unroutable")
    cfg = make_config(default_specialist="STL", classifier={"examples_path": str(EXAMPLES), "on_reject": "default"})
    t2 = RoutingTable.build(cfg, table.classifier)
    d = route(t2, RouteInput("cpp", None, "What is the capital of France? Tell me a joke"), lanes())
    assert (d.specialist, d.source, d.detail) == ("STL", "default", "reject")


def test_on_reject_default_requires_default_specialist():
    with pytest.raises(ValueError):
        make_config(classifier={"on_reject": "default"})


def test_min_confidence_turns_weak_top1_into_reject(table):
    cfg = make_config(classifier={"examples_path": str(EXAMPLES), "min_confidence": 0.999})
    t2 = RoutingTable.build(cfg, table.classifier)
    with pytest.raises(RouteError):
        route(t2, RouteInput("cpp", None, "vector and threads and cmake"), lanes())


def test_pin_and_unknown_model(table):
    d = route(table, RouteInput("Memory", "debug", GDB), lanes(Memory=LaneView(breaker=OPEN)))
    assert (d.specialist, d.source, d.shadow, d.breaker) == ("Memory", "pinned", None, OPEN)
    with pytest.raises(RouteError) as e:
        route(table, RouteInput("gpt-4", None, "x"), lanes())
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_no_classifier_no_default_is_unroutable():
    cfg = make_config(classifier={"kind": "none"})
    t = RoutingTable.build(cfg, None)
    with pytest.raises(RouteError) as e:
        route(t, RouteInput("cpp", None, "hello"), lanes())
    assert e.value.status == 422
    t2 = RoutingTable.build(make_config(classifier={"kind": "none"}, default_specialist="Algo"), None)
    assert route(t2, RouteInput("cpp", None, "hello"), lanes()).source == "default"


def test_low_confidence_shadows_to_second_choice(table):
    text = "vector and threads and cmake and gdb"  # deliberately ambiguous
    d0 = route(table, RouteInput("cpp", None, text), lanes())
    assert d0.source == "classifier"
    cfg_hi = make_config(shadow={"default_threshold": 1.0})
    d = route(RoutingTable.build(cfg_hi, table.classifier), RouteInput("cpp", None, text), lanes())
    assert d.shadow == d.second and d.shadow_reason == "low_confidence" and d.shadow != d.specialist
    cfg_lo = make_config(shadow={"default_threshold": 0.0})
    d = route(RoutingTable.build(cfg_lo, table.classifier), RouteInput("cpp", None, text), lanes())
    assert d.shadow is None
    cfg_off = make_config(shadow={"enabled": False, "default_threshold": 1.0})
    assert route(RoutingTable.build(cfg_off, table.classifier), RouteInput("cpp", None, text), lanes()).shadow is None


def test_per_intent_threshold(table):
    cfg = make_config(rules=[], shadow={"default_threshold": 0.0, "thresholds": {"codegen": 1.0}})
    t = RoutingTable.build(cfg, table.classifier)
    d = route(t, RouteInput("cpp", None, "Implement Dijkstra shortest path with a priority queue"), lanes())
    assert d.specialist == "Algo" and d.intent == "codegen" and d.shadow_reason == "low_confidence"
    d = route(t, RouteInput("cpp", None, "my shared_ptr cycle leaks memory, use weak_ptr?"), lanes())
    assert d.specialist == "Memory" and d.intent == "unspecified" and d.shadow is None


def test_open_breaker_hands_primary_to_fallback_and_shadows_the_lane(table):
    v = lanes(Template=LaneView(breaker=OPEN))
    d = route(table, RouteInput("cpp", "templates", "x"), v)
    assert (d.specialist, d.routed, d.shadow, d.shadow_reason, d.breaker) == ("STL", "Template", "Template",
                                                                             "breaker_open", OPEN)
    # the fallback has no ready replica: the lane keeps serving (nothing better exists)
    v = lanes(Template=LaneView(breaker=OPEN), STL=LaneView(routable=False))
    d = route(table, RouteInput("cpp", "templates", "x"), v)
    assert d.specialist == "Template" and d.breaker == OPEN


def test_fresh_and_half_open_lanes_are_shadowed_by_draw(table):
    v = lanes(Template=LaneView(fresh=True))
    frac = table.config.breaker.fresh_shadow_fraction
    d = route(table, RouteInput("cpp", "templates", "x", draw=frac / 2), v)
    assert (d.specialist, d.shadow, d.shadow_reason) == ("Template", "STL", "fresh_lane")
    d = route(table, RouteInput("cpp", "templates", "x", draw=min(0.999, frac + 0.01)), v)
    assert d.shadow is None
    v = lanes(Template=LaneView(breaker=HALF_OPEN))
    d = route(table, RouteInput("cpp", "templates", "x", draw=0.0), v)
    assert (d.shadow, d.shadow_reason, d.breaker) == ("STL", "half_open", HALF_OPEN)


def test_spiking_lane_lowers_threshold_and_diverts_low_confidence(table):
    text = "Implement Dijkstra shortest path with a priority queue"
    cfg = make_config(shadow={"default_threshold": 0.99})
    t = RoutingTable.build(cfg, table.classifier)
    d = route(t, RouteInput("cpp", None, text), lanes())
    assert d.specialist == "Algo" and d.shadow is not None
    # level 1 on Algo: its low-confidence traffic goes to the second choice, unshadowed
    d = route(t, RouteInput("cpp", None, text), lanes(Algo=LaneView(level=1, threshold_delta=0.5)))
    assert d.routed == "Algo" and d.specialist == d.second != "Algo" and "spike_diverted" in d.detail
    # the second choice is itself spiking: stay, but the lowered threshold suppresses the shadow
    second = d.second
    v = lanes(Algo=LaneView(level=1, threshold_delta=0.99), **{second: LaneView(level=1)})
    d = route(t, RouteInput("cpp", None, text), v)
    assert d.specialist == "Algo" and d.shadow is None


def test_classifier_training_from_inline_examples_and_label_check():
    cfg = make_config(classifier={"examples": [{"text": "alpha beta", "label": "Algo"},
                                               {"text": "gamma delta", "label": "STL"}]})
    clf = build_classifier(cfg.classifier, set(NAMES), Path("."))
    assert clf.predict("alpha beta alpha")["Algo"] > 0.5
    bad = make_config(classifier={"examples": [{"text": "x", "label": "Nope"}]})
    with pytest.raises(ValueError, match="Nope"):
        build_classifier(bad.classifier, set(NAMES), Path("."))
    # a shared labeled set covering more specialists than this ensemble: the others are ignored
    sub = make_config(classifier={"examples_path": str(EXAMPLES)})
    clf = build_classifier(sub.classifier, {"Algo", "STL"}, Path("."))
    assert set(clf.labels) == {"Algo", "STL", "reject"}


def test_naive_bayes_accuracy_on_its_examples():
    ex = load_examples(EXAMPLES)
    clf = train_naive_bayes(ex)
    hits = sum(max(clf.predict(e.text).items(), key=lambda kv: kv[1])[0] == e.label for e in ex)
    assert hits / len(ex) >= 0.95


def test_naive_bayes_confidence_is_tempered():
    ex = load_examples(EXAMPLES)
    clf = train_naive_bayes(ex, evidence_cap=4.0)
    short = "Implement Dijkstra shortest path priority queue"
    p_short = max(clf.predict(short).values())
    p_long = max(clf.predict(" ".join([short] * 50)).values())
    assert p_long < 0.999 and abs(p_long - p_short) < 0.05  # repetition is not more evidence
    assert max(clf.predict("vector and threads and cmake and gdb").values()) < 0.5  # ambiguous stays unsure


def test_shadow_body_asks_for_one_sample_of_the_first_prompt():
    from consort_router.config import ShadowConfig
    from consort_router.shadow import shadow_body

    body = {"model": "cpp", "prompt": ["int a;", "int b;"], "n": 4, "best_of": 4, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 500}
    out = shadow_body(body, "STL", ShadowConfig(max_tokens=64))
    assert (out["model"], out["prompt"], out["n"], out["stream"], out["max_tokens"]) == ("STL", "int a;", 1, False, 64)
    assert "best_of" not in out and "stream_options" not in out
    assert shadow_body({"prompt": [1, 2, 3]}, "STL", ShadowConfig())["prompt"] == [1, 2, 3]   # token ids stay
