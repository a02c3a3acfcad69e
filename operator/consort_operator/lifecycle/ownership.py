"""Never adopt an object the operator does not own: the pure check run before every child is applied.

Children are written by server-side apply with force, which takes over whatever object already has
the child's name. Without this check a Specialist named like an existing Deployment or Service would
overwrite it, stamp its own ownerReference on it, and the garbage collector would delete the victim
with the Specialist. So an existing object is written only when it is ours: its controller owner
reference carries the parent's uid, or it has no controller owner and the operator's managed-by label
and field manager (what a Specialist deleted with `--cascade=orphan` leaves behind). Anything else is
left untouched and reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..resources.common import FIELD_MANAGER, MANAGED_BY
from .common import Event, get_condition, set_condition

CONDITION = "ChildrenOwned"


@dataclass(frozen=True)
class Conflict:
    """A child the operator refused to write, and why."""

    kind: str
    name: str
    reason: str

    def describe(self) -> str:
        return f"{self.kind} {self.name} {self.reason}"


def conflict(child: dict[str, Any], live: dict[str, Any] | None, parent_uid: str) -> Conflict | None:
    """None when `child` may be applied over `live` (absent or owned by the parent); else why not."""
    if live is None:
        return None
    meta = live.get("metadata") or {}
    kind, name = child["kind"], child["metadata"]["name"]
    controllers = [r for r in meta.get("ownerReferences") or [] if r.get("controller")]
    if any(r.get("uid") == parent_uid for r in controllers):
        return None
    if controllers:
        r = controllers[0]
        return Conflict(kind, name, f"exists and is controlled by {r.get('kind')} {r.get('name')}; left untouched")
    labelled = (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY
    written = any(f.get("manager") == FIELD_MANAGER for f in meta.get("managedFields") or [])
    if labelled and written:
        return None
    return Conflict(kind, name, "exists and is not managed by consort-operator; left untouched")


def ownership_condition(conditions: list[dict[str, Any]] | None, conflicts: list[Conflict], kind: str,
                        now: datetime, generation: int | None) -> tuple[list[dict[str, Any]], list[Event]]:
    """The ChildrenOwned condition for this pass, and a Warning Event when the set of conflicts changes
    (not on every pass: a refused child is re-checked on each one)."""
    before = get_condition(conditions, CONDITION) or {}
    if conflicts:
        msg = "; ".join(c.describe() for c in conflicts)[:1000]
        conds = set_condition(conditions, CONDITION, False, "ChildConflict", msg, now, generation)
        events = [] if before.get("message") == msg else [Event("Warning", "ChildConflict", msg)]
        return conds, events
    if not before:
        return list(conditions or []), []   # never conflicted: no extra condition
    return set_condition(conditions, CONDITION, True, "Owned", f"every child is owned by this {kind}", now,
                         generation), []
