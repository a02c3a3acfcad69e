"""Per-tenant limits (pure): the priority cap, the token-rate quota (a token bucket) and the bounded set
of tenant names that metrics may carry as label values.

A tenant is named by the keys file (auth.py). The quota's cost is an estimate made before the engine
tokenizes: prompt characters / 4 plus max_tokens x n (a request without max_tokens counts as
`unbounded_max_tokens`). Requests are charged up front and never refunded: the quota bounds what a
tenant may ask for, which is what it can make the engines spend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .api import ApiError
from .config import TenantPolicy, TenantsConfig

CHARS_PER_TOKEN = 4          # a conservative estimate for the quota (the router does not tokenize)
OTHER = "other"              # the metric label of tenants past TenantsConfig.metric_tenants


def policy(cfg: TenantsConfig, tenant: str) -> TenantPolicy:
    return cfg.overrides.get(tenant, cfg.defaults)


def cost(body: dict, text: str, p: TenantPolicy) -> int:
    """Tokens a request is charged: its prompt (estimated from characters) plus what it may generate."""
    mt = None
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            mt = v
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    return math.ceil(len(text) / CHARS_PER_TOKEN) + max(0, p.unbounded_max_tokens if mt is None else mt) * n


@dataclass(frozen=True)
class Bucket:
    tokens: float
    at: float


def burst(p: TenantPolicy) -> float:
    assert p.tokens_per_s is not None
    return float(p.burst_tokens) if p.burst_tokens is not None else 10.0 * p.tokens_per_s


def take(b: Bucket | None, p: TenantPolicy, amount: int, now: float) -> tuple[Bucket, int | None]:
    """Charge `amount` tokens: (the bucket after, None) when they are there, else (the bucket refilled to
    now, milliseconds until they will be). A request larger than the bucket needs a full bucket."""
    assert p.tokens_per_s is not None
    size = burst(p)
    level = size if b is None else min(size, b.tokens + (now - b.at) * p.tokens_per_s)
    need = min(float(amount), size)
    if level >= need:
        return Bucket(level - need, now), None
    return Bucket(level, now), max(1, math.ceil((need - level) / p.tokens_per_s * 1000))


def charge(cfg: TenantsConfig, buckets: dict[str, Bucket], tenant: str, body: dict, text: str, now: float) -> None:
    """Take a request's tokens from the tenant's quota (its bucket in `buckets`), or refuse it with a
    typed 429."""
    p = policy(cfg, tenant)
    if p.tokens_per_s is None:
        return
    b, wait_ms = take(buckets.get(tenant), p, cost(body, text, p), now)
    buckets[tenant] = b
    if wait_ms is not None:
        raise ApiError(429, "tenant_quota", f"tenant {tenant!r} is over its token-rate quota "
                       f"({p.tokens_per_s:g} tokens/s); retry in {wait_ms} ms", type="rate_limited",
                       retry_after_ms=wait_ms)


def label(seen: set[str], limit: int, tenant: str) -> str:
    """The tenant's metric label: its name while at most `limit` names are in use, else `other`
    (a tenant seen before keeps its name). Adds to `seen`."""
    if tenant in seen:
        return tenant
    if len(seen) < limit:
        seen.add(tenant)
        return tenant
    return OTHER
