"""Per-tenant limits (pure): the token-rate quota bucket, the priority cap, bounded metric labels."""
from __future__ import annotations

import pytest

from consort_router.api import ApiError, check_priority, parse_request
from consort_router.config import RouterConfig, TenantPolicy, TenantsConfig
from consort_router import tenants as tn


def test_bucket_charges_refills_and_says_when():
    p = TenantPolicy(tokens_per_s=100, burst_tokens=500)
    b, wait = tn.take(None, p, 300, now=0.0)          # a new tenant starts with a full bucket
    assert wait is None and b.tokens == 200
    b, wait = tn.take(b, p, 300, now=0.0)             # 100 short: 1 s at 100 tokens/s
    assert wait == 1000 and b.tokens == 200           # a refusal charges nothing
    b, wait = tn.take(b, p, 300, now=0.5)
    assert wait == 500 and b.tokens == 250
    b, wait = tn.take(b, p, 300, now=1.0)
    assert wait is None and b.tokens == 0
    b, _ = tn.take(b, p, 1, now=100.0)                # refill stops at the burst size
    assert b.tokens == 499
    # a request larger than the bucket needs a full one, not forever
    b, wait = tn.take(tn.Bucket(0.0, 0.0), p, 10_000, now=0.0)
    assert wait == 5000
    b, wait = tn.take(b, p, 10_000, now=5.0)
    assert wait is None and b.tokens == 0


def test_default_burst_is_ten_seconds():
    assert tn.burst(TenantPolicy(tokens_per_s=7)) == 70


def test_cost_counts_prompt_and_what_may_be_generated():
    p = TenantPolicy(tokens_per_s=1, unbounded_max_tokens=1000)
    assert tn.cost({"max_tokens": 10}, "x" * 40, p) == 10 + 10
    assert tn.cost({"max_tokens": 10, "n": 3}, "", p) == 30
    assert tn.cost({"max_completion_tokens": 7}, "abc", p) == 1 + 7
    assert tn.cost({}, "", p) == 1000                                  # no max_tokens: the configured bound
    assert tn.cost({"max_tokens": "lots", "n": True}, "", p) == 1000   # the engine refuses those; count the bound


def test_priority_is_clamped_to_the_tenants_cap():
    assert check_priority(900, 10) == 10 and check_priority(-5, 10) == -5
    with pytest.raises(ApiError):
        check_priority(10**18, 10)                    # out of range is still a 400, not a clamp
    r = parse_request({"prompt": "x", "priority": 500}, "completion", None, max_priority=3)
    assert r.priority == 3 and r.body["priority"] == 3      # the engine gets the clamped value
    r = parse_request({"prompt": "x"}, "completion", None, max_priority=3)
    assert r.priority == 0 and "priority" not in r.body


def test_policy_by_name_with_defaults():
    cfg = RouterConfig.model_validate({
        "ensemble": "e", "specialists": [{"name": "A", "replicas": ["http://a"]}], "default_specialist": "A",
        "tenants": {"defaults": {"max_priority": 0}, "overrides": {"gold": {"max_priority": 100, "tokens_per_s": 5}}}})
    assert tn.policy(cfg.tenants, "gold").max_priority == 100
    assert tn.policy(cfg.tenants, "someone").max_priority == 0 and tn.policy(cfg.tenants, "x").tokens_per_s is None
    assert tn.policy(TenantsConfig(), "x").max_priority == 1000   # no tenants section: no limits


def test_metric_labels_are_bounded():
    seen: set[str] = set()
    assert [tn.label(seen, 2, t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]
    assert tn.label(set(), 0, "a") == "other"


async def test_prefix_affinity_is_salted_like_the_engines_caches():
    """A tenant's prefix is not 'cached' on a replica because another tenant sent it: the engines salt
    their caches by tenant and cache_salt, so the router's prefix index does too."""
    from consort_router.api import ParsedRequest
    from consort_router.router import Router
    cfg = RouterConfig.model_validate({"ensemble": "e", "specialists": [{"name": "A", "replicas": ["http://a"]}],
                                       "default_specialist": "A"})
    router = Router(cfg)
    text = "x" * 4096
    req = ParsedRequest({"prompt": text}, None, None, 0, False, text)
    a = await router.affinity(cfg, req, "A", None, "team-a")
    assert a is not None and a.hashes
    assert a.hashes == (await router.affinity(cfg, req, "A", None, "team-a")).hashes
    assert set(a.hashes).isdisjoint((await router.affinity(cfg, req, "A", None, "team-b")).hashes)
    salted = ParsedRequest({"prompt": text, "cache_salt": "s"}, None, None, 0, False, text)
    assert set(a.hashes).isdisjoint((await router.affinity(cfg, salted, "A", None, "team-a")).hashes)
