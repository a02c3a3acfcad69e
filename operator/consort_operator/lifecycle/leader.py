"""Leader election on a `coordination.k8s.io/v1` Lease, decided as client-go's leaderelection does.

Pure: (the Lease as last read, or None; my identity; now on my monotonic clock; what I observed
before; timings) -> one action. `election.py` reads and writes the Lease and acts on the answer.

The guarantee (never two leaders) rests on three rules:
  * A holder's lease is live until `leaseDuration` has passed on OUR clock since we first saw its
    current record (`observed_at`, client-go's observedTime). The holder's `renewTime` is never
    compared with our clock, so skew between the two machines cannot shorten the wait.
  * The leader stops (the process exits) when it has not renewed for `renewDeadline`, counted from
    the start of its last successful write. renewDeadline < leaseDuration, so it is gone before any
    standby may take over, even when the apiserver itself is unreachable (it cannot renew, and
    nobody can acquire).
  * Every write carries the resourceVersion read: of two standbys racing, one gets 409 Conflict.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Literal

Action = Literal["acquire", "renew", "wait", "lost"]


@dataclass(frozen=True)
class Timings:
    lease_duration: float = 15.0   # a standby waits this long after the last change it saw
    renew_deadline: float = 10.0   # the leader exits if it has not renewed for this long
    retry_period: float = 2.0      # how often the leader renews and a standby looks

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("leader election needs lease duration > renew deadline > retry period > 0, got "
                             f"{self.lease_duration} / {self.renew_deadline} / {self.retry_period}")


@dataclass(frozen=True)
class Record:
    """The Lease fields the election reads (spec), and the resourceVersion a write must carry."""
    holder: str                    # "" when free (never held, or released on a clean shutdown)
    duration: float | None         # the holder's leaseDurationSeconds
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    resource_version: str
    uid: str = ""

    def key(self) -> tuple[Any, ...]:
        """What identifies one renewal: any change restarts a standby's wait."""
        return (self.holder, self.duration, self.acquire_time, self.renew_time, self.transitions)


@dataclass(frozen=True)
class State:
    """What this replica remembers between looks; all times on its own monotonic clock."""
    observed: tuple[Any, ...] | None = None   # Record.key() last seen
    observed_at: float = 0.0                  # when that record was first seen
    renewed_at: float | None = None           # start of my last successful write; None: not leading


def record_of(lease: dict[str, Any] | None) -> Record | None:
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    duration = spec.get("leaseDurationSeconds")
    return Record(holder=spec.get("holderIdentity") or "", duration=float(duration) if duration else None,
                  acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                  transitions=int(spec.get("leaseTransitions") or 0),
                  resource_version=(lease.get("metadata") or {}).get("resourceVersion") or "",
                  uid=(lease.get("metadata") or {}).get("uid") or "")


def observe(state: State, record: Record | None, now: float) -> State:
    """Restart the clock when the record changed since the last look (or was never seen)."""
    key = record.key() if record is not None else None
    if key != state.observed or state.observed is None:
        return replace(state, observed=key, observed_at=now)
    return state


def lost(state: State, now: float, t: Timings) -> bool:
    """Leading, and no successful renewal for the renew deadline: stop before anyone may acquire."""
    return state.renewed_at is not None and now - state.renewed_at >= t.renew_deadline


def decide(record: Record | None, me: str, now: float, state: State, t: Timings) -> Action:
    """`state` must already have observed `record` (see `observe`)."""
    if lost(state, now, t):
        return "lost"
    if record is None or not record.holder:
        return "acquire"
    if record.holder == me:
        return "renew"
    if state.renewed_at is not None:
        return "lost"              # someone else holds what I thought was mine
    duration = record.duration or t.lease_duration
    if now - state.observed_at >= duration:
        return "acquire"           # expired: nobody changed it for a whole lease duration
    return "wait"


def micro_time(when: datetime) -> str:
    """A Kubernetes MicroTime."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(record: Record | None, me: str, wall: datetime, t: Timings) -> dict[str, Any]:
    """The spec to write for `acquire` or `renew`: a renewal keeps acquireTime and the transition count."""
    mine = record is not None and record.holder == me
    transitions = (record.transitions if record is not None else 0) + (0 if mine or record is None else 1)
    return {"holderIdentity": me, "leaseDurationSeconds": int(t.lease_duration),
            "acquireTime": record.acquire_time if mine and record.acquire_time else micro_time(wall),
            "renewTime": micro_time(wall), "leaseTransitions": transitions}


def released_spec(record: Record, wall: datetime) -> dict[str, Any]:
    """On a clean shutdown the leader hands the Lease back (holder "", as client-go's ReleaseOnCancel):
    a standby acquires on its next look instead of waiting out the lease duration."""
    return {"holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": record.acquire_time,
            "renewTime": micro_time(wall), "leaseTransitions": record.transitions}
