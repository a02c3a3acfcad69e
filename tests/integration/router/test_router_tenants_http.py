"""Tenants end to end (issue 25): named keys, a per-tenant token-rate quota (typed 429 with Retry-After
while another tenant is served), the priority cap, feedback ids bound to the tenant that was answered
and used once, and tenant-labelled metrics."""
from __future__ import annotations

import re
import uuid

import httpx
import pytest

from conftest import router_config

pytestmark = pytest.mark.timeout(300)
BODY = {"model": "cpp", "prompt": "int main() {", "max_tokens": 2, "intent": "review", "temperature": 0}


@pytest.fixture
def tenant_router(engines, make_router, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nteam-a: sk-team-a\nteam-b: sk-team-b\nsk-legacy\n")
    return make_router(router_config(
        engines, auth={"api_keys_file": str(keys)},
        tenants={"defaults": {"max_priority": 0},
                 "overrides": {"team-a": {"tokens_per_s": 2, "burst_tokens": 10}}}))


def test_quota_is_per_tenant_with_a_typed_429(tenant_router):
    r = tenant_router
    first = r.post("/v1/completions", BODY, key="sk-team-a")    # 3 + 2 of team-a's 10 tokens
    assert first.status_code == 200, first.text
    assert r.post("/v1/completions", BODY, key="sk-team-a").status_code == 200
    over = r.post("/v1/completions", BODY, key="sk-team-a")
    assert over.status_code == 429, over.text
    err = over.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limited", "tenant_quota") and err["retry_after_ms"] > 0
    assert int(over.headers["Retry-After"]) >= 1
    # another tenant (no quota) is served meanwhile, and so is the anonymous legacy key
    assert r.post("/v1/completions", BODY, key="sk-team-b").status_code == 200
    assert r.post("/v1/completions", BODY, key="sk-legacy").status_code == 200
    metrics = r.get("/metrics")[1]
    assert 'consort_router_tenant_requests_total{code="429",tenant="team-a"} 1.0' in metrics
    assert 'consort_router_tenant_requests_total{code="200",tenant="team-b"} 1.0' in metrics
    assert re.search(r'tenant="anon-[0-9a-f]{8}"', metrics) and "sk-legacy" not in metrics


def test_priority_is_capped_per_tenant(tenant_router):
    # team-b's cap is the default 0: priority 900 is lowered, not refused; out of range is still a 400
    assert tenant_router.post("/v1/completions", {**BODY, "priority": 900}, key="sk-team-b").status_code == 200
    bad = tenant_router.post("/v1/completions", {**BODY, "priority": 10**18}, key="sk-team-b")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_feedback_ids_are_issued_bound_and_used_once(tenant_router):
    r = tenant_router
    answer = r.post("/v1/completions", BODY, key="sk-team-b")
    fid = answer.headers["x-consort-feedback-id"]
    assert len(fid) >= 16
    other = r.post("/v1/completions", BODY, key="sk-legacy").headers["x-consort-feedback-id"]
    assert other != fid
    # the request id a client chose names nothing
    chosen = httpx.post(r.url + "/v1/completions", json=BODY, timeout=60,
                        headers={"Authorization": "Bearer sk-team-b", "x-request-id": "mine"})
    assert r.post("/v1/feedback", {"feedback_id": "mine", "correct": False}, key="sk-team-b").status_code == 404
    assert chosen.headers["x-consort-feedback-id"] != "mine"
    # another tenant cannot use it (and it stays usable by its holder)
    foreign = r.post("/v1/feedback", {"feedback_id": fid, "correct": False}, key="sk-legacy")
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "unknown_feedback_id"
    ok = r.post("/v1/feedback", {"feedback_id": fid, "correct": True}, key="sk-team-b")
    assert ok.status_code == 200 and ok.json()["specialist"] == "STL"
    replay = r.post("/v1/feedback", {"feedback_id": fid, "correct": False}, key="sk-team-b")
    assert replay.status_code == 404 and replay.json()["error"]["code"] == "unknown_feedback_id"
    # a refused request gets no id
    refused = r.post("/v1/completions", {**BODY, "priority": "x"}, key="sk-team-b")
    assert refused.status_code == 400 and "x-consort-feedback-id" not in refused.headers


def cached(resp) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_tenants_never_share_cached_prefixes(tenant_router):
    """cached_tokens would otherwise be an oracle for another tenant's prompt (vLLM's CVE-2025-46570)."""
    r = tenant_router
    prompt = f"// {uuid.uuid4().hex}\n" + "int add(int a, int b) { return a + b; }\n" * 12
    body = {**BODY, "prompt": prompt}
    assert cached(r.post("/v1/completions", body, key="sk-team-b")) == 0
    assert cached(r.post("/v1/completions", body, key="sk-team-b")) > 0        # the same tenant: a hit
    assert cached(r.post("/v1/completions", body, key="sk-legacy")) == 0       # another tenant: none
    # vLLM's cache_salt is honoured inside a tenant; a client cannot pick another tenant by header
    assert cached(r.post("/v1/completions", {**body, "cache_salt": "s1"}, key="sk-team-b")) == 0
    assert cached(r.post("/v1/completions", {**body, "cache_salt": "s1"}, key="sk-team-b")) > 0
    # the router sets x-consort-tenant: one a client sends does not make it another tenant
    fresh = {**body, "prompt": f"// {uuid.uuid4().hex}\n" + prompt}
    assert cached(r.post("/v1/completions", fresh, key="sk-team-b")) == 0
    forged = httpx.post(r.url + "/v1/completions", json=fresh, timeout=60,
                        headers={"Authorization": "Bearer sk-legacy", "x-consort-tenant": "team-b"})
    assert cached(forged) == 0
