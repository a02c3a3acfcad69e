"""Conditions and events shared by the lifecycle state machines."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event the operator posts on the object (one per transition)."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def set_condition(conditions: list[dict[str, Any]] | None, type_: str, status: bool | None, reason: str,
                  message: str, now: datetime, generation: int | None) -> list[dict[str, Any]]:
    """Upsert one metav1.Condition; lastTransitionTime moves only when status flips."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out = [dict(c) for c in conditions or []]
    for c in out:
        if c["type"] == type_:
            if c.get("status") != value:
                c["lastTransitionTime"] = rfc3339(now)
            c.update(status=value, reason=reason, message=message)
            if generation is not None:
                c["observedGeneration"] = generation
            return out
    cond = {"type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": rfc3339(now)}
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)
