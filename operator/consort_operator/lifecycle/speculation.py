"""Specialist status.speculation: the warm replicas' speculative-decoding reports, pooled (pure)."""
from __future__ import annotations

from typing import Any


def pooled(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Drafter, state and acceptance over the engines' /v1/status "speculation" reports (camelCase,
    as status carries it). A replica in fallback makes the whole fallback: mtp was asked for and some
    replica drafts with n-grams. None without reports."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    drafted = sum(int(r.get("draft_tokens") or 0) for r in reports)
    accepted = sum(int(r.get("accepted_tokens") or 0) for r in reports)
    states = {r.get("state") for r in reports}
    state = "fallback" if "fallback" in states else "on" if "on" in states else "off"
    drafters = {r.get("drafter") for r in reports} - {None}
    drafter = "ngram" if "ngram" in drafters else ("mtp" if drafters else None)
    out: dict[str, Any] = {"state": state, "draftTokens": drafted, "acceptedTokens": accepted,
                           "acceptanceRate": round(accepted / drafted, 4) if drafted else None}
    if drafter:
        out["drafter"] = drafter
    return {k: v for k, v in out.items() if v is not None}
