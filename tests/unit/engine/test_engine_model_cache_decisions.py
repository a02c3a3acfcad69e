"""The model cache's pure decisions: entry keys, manifest checks, which entries to evict."""
from __future__ import annotations

from consort_engine.model_cache import Entry, FileSum, cache_key, evictions, manifest_problems


def test_key_names_source_and_revision():
    a = cache_key("hf://Qwen/Qwen2.5-0.5B", "a" * 40)
    assert a == cache_key("hf://Qwen/Qwen2.5-0.5B", "a" * 40)
    assert a != cache_key("hf://Qwen/Qwen2.5-0.5B", "b" * 40)          # a moved branch is a new entry
    assert a != cache_key("hf://Qwen/Qwen2.5-1.5B", "a" * 40)
    assert a.startswith("Qwen_Qwen2.5-0.5B-")                           # readable on the node
    # one path component, whatever the source holds
    for src in ("file:///../../etc", "demo://tiny?seed=3", "hf://a/b@../../x"):
        k = cache_key(src, "r")
        assert "/" not in k and not k.startswith(".") and k not in ("", "..")


def test_manifest_problems_names_each_difference():
    m = {"config.json": FileSum(10, "aa"), "model.safetensors": FileSum(100, "bb")}
    assert manifest_problems(m, dict(m)) == []
    assert manifest_problems(m, {"config.json": FileSum(10, "aa")}) == ["missing model.safetensors"]
    assert manifest_problems(m, {**m, "x.py": FileSum(1, "cc")}) == ["unexpected x.py"]
    assert manifest_problems(m, {**m, "model.safetensors": FileSum(100, "bd")}) == ["changed model.safetensors"]
    assert manifest_problems(m, {**m, "model.safetensors": FileSum(99, "bb")}) == ["changed model.safetensors"]


def test_evictions_least_recently_used_first_until_within_bound():
    entries = [Entry("new", 40, 300.0), Entry("old", 40, 100.0), Entry("mid", 40, 200.0)]
    assert evictions(entries, 120, frozenset()) == []
    assert evictions(entries, 80, frozenset()) == ["old"]
    assert evictions(entries, 40, frozenset()) == ["old", "mid"]
    assert evictions(entries, 0, frozenset()) == ["old", "mid", "new"]


def test_evictions_skip_busy_entries_even_over_the_bound():
    entries = [Entry("new", 40, 300.0), Entry("old", 40, 100.0), Entry("mid", 40, 200.0)]
    assert evictions(entries, 80, frozenset({"old"})) == ["mid"]
    assert evictions(entries, 0, frozenset({"old", "mid", "new"})) == []
