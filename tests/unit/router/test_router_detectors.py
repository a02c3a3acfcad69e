"""Issue 25: detectors read a prompt in linear time (built-in patterns) or under a deadline in a child
process (an EnsembleRouter's own patterns), so one routed request cannot stall the router."""
from __future__ import annotations

import asyncio
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consort_router import api
from consort_router.config import Detector, RouterConfig
from consort_router.detectors import PatternSandbox
from consort_router.routing import BUILTIN_PATTERNS, SCAN_LIMIT, compile_detector, detect

KB64 = SCAN_LIMIT
# Prompts built to make a backtracking pattern rescan the text from every start: the old sfinae pattern
# took 2.7 s on 64 KB of "template<" (13.8 s on 144 KB: the old scan limit did not bound it, each start did).
HOSTILE = {
    "template<": "template<",
    "template heads without ; { }": "template <typename T, typename U> ",
    "nested template keywords": "template <template <typename> class ",
    "typename runs": "typename " + "x" * 50 + " ",
    "Thread lines": "Thread 1 ",
    "Thread with digits": "Thread 12345 worker ",
    "std::is_ words": "std::is_" + "a" * 60 + " ",
    "gdb frames": "#1 " + "a::b<c>~" * 20 + "\n",
    "whitespace after keywords": "decltype" + " " * 200,
    "cmake calls": "add_library" + " " * 100 + "target_link_libraries ",
}


@pytest.mark.parametrize("builtin", sorted(BUILTIN_PATTERNS))
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_builtin_patterns_are_linear_on_hostile_prompts(builtin, name):
    d = compile_detector(Detector(name="d", specialist="S", builtin=builtin, min_matches=10 ** 9))
    text = (HOSTILE[name] * (KB64 // len(HOSTILE[name]) + 1))[:KB64]
    t0 = time.perf_counter()
    d.count(text)
    assert time.perf_counter() - t0 < 0.3, f"{builtin} on {name}: {time.perf_counter() - t0:.2f} s"


FRAGMENTS = st.sampled_from(["template", "<", ">", " ", "typename", "=", "T", ",", "Thread", "1", "received",
                             "signal", "\n", "std::is_", "x", "::", "type", "#", "0x1f", "(", ";", "{"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(FRAGMENTS, min_size=1, max_size=60))
def test_builtin_patterns_stay_fast_on_any_soup_of_their_fragments(parts):
    text = ("".join(parts) * (KB64 // max(1, len("".join(parts))) + 1))[:KB64]
    for builtin in BUILTIN_PATTERNS:
        d = compile_detector(Detector(name="d", specialist="S", builtin=builtin, min_matches=10 ** 9))
        t0 = time.perf_counter()
        d.count(text)
        assert time.perf_counter() - t0 < 0.3, (builtin, parts)


def test_the_rewritten_sfinae_pattern_still_counts_each_defaulted_head_once():
    d = compile_detector(Detector(name="d", specialist="S", builtin="sfinae_templates", min_matches=1))
    head = re.compile(BUILTIN_PATTERNS["sfinae_templates"][6])
    assert len(head.findall("template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>")) == 1
    assert len(head.findall("template <typename T, template <typename> class C, typename = void> struct S;")) == 1
    assert not head.findall("template <typename T> struct S { using X = typename T::type; };")
    assert d.count("template <typename T, typename = void> struct has_x : std::false_type {};") >= 1


def test_priority_is_bounded_at_the_router():
    lo, hi = api.PRIORITY_RANGE
    assert api.parse_request({"prompt": "x", "priority": hi}, "completion", None).priority == hi
    for bad in (10 ** 18, lo - 1, -(10 ** 30)):
        with pytest.raises(api.ApiError) as e:
            api.parse_request({"prompt": "x", "priority": bad}, "completion", None)
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_value", "priority")
    with pytest.raises(ValueError):
        RouterConfig.model_validate({"ensemble": "e", "specialists": [{"name": "A"}], "shadow": {"priority": -5000}})


def config_with_patterns(*patterns: str) -> RouterConfig:
    return RouterConfig.model_validate({
        "ensemble": "e", "specialists": [{"name": "A"}, {"name": "B"}],
        "detectors": [{"name": "mixed", "specialist": "A", "builtin": "build_files", "patterns": [r"\bfoo\b"],
                       "min_matches": 2},
                      {"name": "own", "specialist": "B", "patterns": list(patterns), "min_matches": 1}]})


def test_detect_adds_the_sandboxs_counts_to_the_builtin_ones():
    dets = [compile_detector(d) for d in config_with_patterns(r"\bbar\b").detectors]
    assert detect(dets, "cmake_minimum_required foo").name == "mixed"                  # counted here
    assert detect(dets, "cmake_minimum_required", user_counts=(1, 0)).name == "mixed"   # 1 built-in + 1 own
    assert detect(dets, "nothing", user_counts=(0, 1)).name == "own"
    assert detect(dets, "bar", user_counts=(0, 0)) is None                               # the sandbox said no


async def test_own_patterns_run_under_a_deadline_in_a_child_and_the_loop_keeps_ticking():
    timeouts: list[int] = []
    sandbox = PatternSandbox(timeout_s=0.25, on_timeout=lambda: timeouts.append(1))
    patterns, stop_at = (r"(a+)+$", r"\bbar\b"), (1, 1)
    ticks: list[float] = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    try:
        assert await sandbox.counts(patterns, "bar bar", stop_at) == (0, 1)          # starts the child
        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        got = await sandbox.counts(patterns, "a" * 40 + "b bar", stop_at)           # ~minutes in-process
        took = time.monotonic() - t0
        t.cancel()
        assert got == (0, 0) and timeouts == [1] and took < 1.5, (got, took)
        assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.1
        assert await sandbox.counts(patterns, "bar", stop_at) == (0, 1)              # a fresh child
    finally:
        sandbox.close()
