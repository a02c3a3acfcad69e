"""Router internals without a network: verifier results feed breakers, lane state survives reloads,
revision changes, the feedback map stays bounded, and store restore on construction."""
from __future__ import annotations

import os
import time

import pytest
import yaml

from consort_router.breaker import OPEN, BreakerState, FileStore, dump_states
from consort_router.config import RouterConfig
from consort_router.router import Router

BASE = {"ensemble": "cpp", "specialists": [{"name": "A", "replicas": ["http://127.0.0.1:1"], "intents": ["a"]},
                                           {"name": "B", "replicas": ["http://127.0.0.1:2"], "fallback": "A"}],
        "classifier": {"kind": "none"}, "default_specialist": "A", "store": {"kind": "none"},
        "breaker": {"window": 4, "min_samples": 2, "trip_after": 1}}


_bump = [0]


def touch(path):
    _bump[0] += 1
    t = time.time_ns() + _bump[0] * 10**9
    os.utime(path, ns=(t, t))


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    touch(path)


async def test_verifier_results_feed_the_breaker():
    r = Router(RouterConfig.model_validate(BASE))
    ok = "```cpp\n#include <vector>\nint main() { std::vector<int> v; return (int)v.size(); }\n```"
    bad = "```cpp\nint main() { return nope; }\n```"
    assert (await r.verify_and_feed("B", ok)).passed is True
    assert r.lanes.breakers["B"].samples == (1.0,)
    assert (await r.verify_and_feed("B", bad)).passed is False
    assert (await r.verify_and_feed("B", "no code at all")).passed is None
    assert r.lanes.breakers["B"].samples == (1.0, 0.0)
    await r.verify_and_feed("B", bad)
    assert r.lanes.breakers["B"].state == OPEN  # rate 1/3 < 0.7 with trip_after=1
    assert r.lanes.transitions == [("B", "closed", "open")]


def test_reload_keeps_lane_state_and_applies_revisions(tmp_path):
    path = tmp_path / "router.yaml"
    write(path, BASE)
    r = Router(RouterConfig.load(path), config_path=path)
    r.feed("B", 0.0)
    r.feed("B", 0.0)
    assert r.lanes.breakers["B"].state == OPEN
    rep = r.runtime.replicas["A"][0]
    rep.ready = True
    # a reload with an unrelated change keeps breaker and replica state
    data = dict(BASE, rules=[{"intent": "x", "specialist": "B"}])
    write(path, data)
    assert r.maybe_reload()
    assert r.runtime.table.intents == {"a": "A", "x": "B"}
    assert r.lanes.breakers["B"].state == OPEN and r.runtime.replicas["A"][0] is rep
    # a new revision of B restarts its window and half-opens it
    data["specialists"] = [BASE["specialists"][0], dict(BASE["specialists"][1], revision="v2")]
    write(path, data)
    assert r.maybe_reload()
    b = r.lanes.breakers["B"]
    assert (b.state, b.samples, b.revision) == ("half_open", (), "v2")
    # an invalid file is refused and the old runtime stays
    old = r.runtime
    path.write_text("ensemble: cpp\nspecialists: []\n")
    touch(path)
    assert not r.maybe_reload() and r.runtime is old
    # removing a specialist drops its knobs; adding one creates a fresh lane
    data["specialists"] = [BASE["specialists"][0], {"name": "C", "replicas": ["http://127.0.0.1:3"]}]
    data["rules"] = []
    write(path, data)
    assert r.maybe_reload()
    assert set(r.lanes.knobs) == {"A", "C"} and "C" in r.lanes.breakers


def test_feedback_map_is_bounded():
    cfg = RouterConfig.model_validate(dict(BASE, limits={"feedback_map_size": 3}))
    r = Router(cfg)
    for i in range(10):
        r.lanes.remember(f"id{i}", "t", "A", None)
    assert list(r.lanes.feedback) == ["id7", "id8", "id9"]


def test_feedback_ids_are_bound_to_a_tenant_and_used_once():
    r = Router(RouterConfig.model_validate(BASE))
    r.lanes.remember("fb1", "team-a", "A", "C")
    assert r.lanes.claim("fb1", "team-b") is None          # another tenant's id: refused, and left alone
    g = r.lanes.claim("fb1", "team-a")
    assert (g.tenant, g.primary, g.shadow) == ("team-a", "A", "C")
    assert r.lanes.claim("fb1", "team-a") is None          # used up
    assert r.lanes.claim("never-issued", "team-a") is None


def test_store_restore_on_start(tmp_path):
    store = FileStore(tmp_path / "b.json")
    store.save(dump_states({"B": BreakerState(state=OPEN, samples=(0.0, 0.0), total=2)}))
    cfg = RouterConfig.model_validate(dict(BASE, store={"kind": "file", "path": str(tmp_path / "b.json")}))
    r = Router(cfg)
    assert r.lanes.breakers["B"].state == OPEN and r.lanes.breakers["A"].state == "closed"
    r.feed("A", 1.0)
    r.lanes.save()
    assert set(FileStore(tmp_path / "b.json").load()["breakers"]) == {"A", "B"}


def test_injected_store_is_used():
    class Recording:
        def __init__(self):
            self.saved = []

        def load(self):
            return {"version": 1, "breakers": {"A": BreakerState(state=OPEN).to_dict()}}

        def save(self, data):
            self.saved.append(data)

    s = Recording()
    r = Router(RouterConfig.model_validate(BASE), store=s)
    assert r.lanes.breakers["A"].state == OPEN
    r.lanes.save()
    assert s.saved and s.saved[-1]["breakers"]["A"]["state"] == OPEN
