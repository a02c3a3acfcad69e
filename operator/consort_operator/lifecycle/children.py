"""Which children a pass writes: pure decisions over the desired objects and what is known of the live ones.

A child is written (server-side apply) only when its desired content hash differs from the live
one, when its Deployment drifted (someone changed it: its generation moved away from the one this
operator's last write produced), or when it does not exist. Deployments are watched (Kopf's index
says their hash and generation without a read); other children are read only when this operator has
not written their current content yet, and re-read every resync period (to recreate deleted ones).
A new parent's children are created without a read (`create_first`): a create-only apply answers
409 for one that exists, and only then is it read.
An existing object that is not this parent's is never written (ownership.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..resources.common import ANNOTATION_HASH
from . import ownership
from .common import Event

Key = tuple[str, str]   # (kind, name)
Action = Literal["keep", "create", "update"]


@dataclass
class Owned:
    """What the operator knows of one parent's children (lost on restart: then it reads them)."""

    hashes: dict[Key, str] = field(default_factory=dict)       # content hash it last wrote or saw
    generations: dict[Key, int] = field(default_factory=dict)  # the generation its last write produced
    last_resync: float | None = None                           # monotonic time of the last full re-read

    def written(self, key: Key) -> tuple[str, int] | None:
        """(content hash, generation) of the child as the operator last wrote or read it, if known."""
        if key in self.hashes and key in self.generations:
            return self.hashes[key], self.generations[key]
        return None

    def record(self, key: Key, want: str, generation: int | None = None) -> None:
        self.hashes[key] = want
        if generation is not None:
            self.generations[key] = generation


def key_of(child: dict[str, Any]) -> Key:
    return child["kind"], child["metadata"]["name"]


def wanted_hash(obj: dict[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_HASH)


def resync_due(owned: Owned, now: float, resync_seconds: float) -> bool:
    return owned.last_resync is None or now - owned.last_resync >= resync_seconds


def resync_in(owned: Owned, now: float, resync_seconds: float) -> float:
    """Seconds until the next full re-read of the children."""
    return 0.0 if owned.last_resync is None else max(0.0, owned.last_resync + resync_seconds - now)


def _drifted(owned: Owned, key: Key, generation: int | None) -> bool:
    return key in owned.generations and generation is not None and generation != owned.generations[key]


def known_current(child: dict[str, Any], owned: Owned, deployment: dict[str, Any] | None, resync: bool) -> bool:
    """True when the child is known to hold its desired content without reading it. `deployment` is
    Kopf's index entry (hash, generation) of a Deployment child, None when the index has none."""
    key, want = key_of(child), wanted_hash(child)
    if child["kind"] == "Deployment":
        return deployment is not None and deployment["hash"] == want and not _drifted(owned, key, deployment["generation"])
    return owned.hashes.get(key) == want and not resync


def create_first(child: dict[str, Any], owned: Owned, parent_status: dict[str, Any]) -> bool:
    """True when the child is most likely absent, so a create-only apply (409 when it exists) should
    replace the read: this operator knows nothing of it and no pass ever wrote the parent's status
    (a new parent). After a restart the parents have a status: their children are read first."""
    return key_of(child) not in owned.hashes and not parent_status


def action(child: dict[str, Any], live: dict[str, Any] | None, owned: Owned, parent_uid: str
           ) -> Action | ownership.Conflict:
    """What to do with one child once its live object was read: keep it, create or update it, or
    refuse (someone else's object)."""
    if live is None:
        return "create"
    refused = ownership.conflict(child, live, parent_uid)
    if refused is not None:
        return refused
    generation = (live.get("metadata") or {}).get("generation")
    if wanted_hash(live) == wanted_hash(child) and not _drifted(owned, key_of(child), generation):
        return "keep"
    return "update"


def written_events(written: list[tuple[dict[str, Any], Action]]) -> list[Event]:
    """One Event per pass and verb naming every child written (each Event is a write to the apiserver:
    a new Specialist's six children are one CreatedChildren Event, not six)."""
    events = []
    for what, verb in (("create", "Created"), ("update", "Updated")):
        names = [" ".join(key_of(child)) for child, w in written if w == what]
        if names:
            events.append(Event("Normal", f"{verb}Children", f"{verb.lower()} {', '.join(names)}"))
    return events
