"""The engine credential of one EnsembleRouter and its rotation, pure: (live Secret, rotation asked for,
now) -> the Secret's next content; and the API keys Secret generated when the spec names none.

The operator mints a random token per EnsembleRouter. Its router pods present `current`; the engines
of the Specialists it selects accept every line of `accepted`. Rotation (annotate the EnsembleRouter
`consort.dev/rotate-credential=<any new value>`) goes in two steps so that no request is refused
while the new Secret reaches the pods (a Secret volume is updated within the kubelet's sync period,
on each node at its own time):

1. stage: a new `pending` token is minted and added to `accepted`; the router still sends `current`.
2. promote, once `propagation_s` has passed: `current` -> `previous`, `pending` -> `current`. The router
   now sends the new token, and the engines keep accepting `previous` (routers whose file has not
   changed yet) until the next rotation drops it.
"""
from __future__ import annotations

import base64
import hashlib
import secrets
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Callable

from ..resources import credential as credential_res
from . import ownership
from .common import parse_time, rfc3339

ROTATE_ANNOTATION = "consort.dev/rotate-credential"     # on the EnsembleRouter: the user's request
ROTATION_DONE = "consort.dev/credential-rotation"       # on the Secret: the request carried out last
STAGING = "consort.dev/credential-staging"              # on the Secret: the request being staged
STAGED_AT = "consort.dev/credential-staged-at"
PROPAGATION_S = 120.0   # kubelet sync period (1 min by default) + its Secret cache, with margin


def new_token() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class CredentialState:
    current: str
    previous: str | None = None
    pending: str | None = None
    rotation: str = ""                 # ROTATE_ANNOTATION's value the last rotation carried out
    staging: str | None = None         # ... and the one being staged (with `pending`)
    staged_at: datetime | None = None

    def accepted(self) -> list[str]:
        """What the engines accept, the token the router will send next first."""
        return [t for t in (self.pending, self.current, self.previous) if t]


@dataclass(frozen=True)
class RouterSecrets:
    """What one pass reads for an EnsembleRouter's Secrets (the live objects, None when absent)."""

    engine_credential: dict[str, Any] | None = None
    api_keys: dict[str, Any] | None = None
    rotation: str = ""     # the EnsembleRouter's ROTATE_ANNOTATION


def _text(data: dict[str, Any], key: str) -> str | None:
    try:
        return base64.b64decode(data.get(key) or "").decode().strip() or None
    except (ValueError, UnicodeDecodeError):
        return None


def state_from_secret(secret: dict[str, Any] | None) -> CredentialState | None:
    """The state a live Secret holds; None when there is none (or it holds no current token)."""
    data = (secret or {}).get("data") or {}
    current = _text(data, "current")
    if current is None:
        return None
    ann = ((secret or {}).get("metadata") or {}).get("annotations") or {}
    pending = _text(data, "pending")
    try:
        staged_at = parse_time(ann.get(STAGED_AT)) if pending else None
    except ValueError:
        staged_at = None
    return CredentialState(current, _text(data, "previous"), pending, ann.get(ROTATION_DONE, ""),
                           ann.get(STAGING, "") if pending else None, staged_at)


def next_state(state: CredentialState | None, requested: str, now: datetime, mint: Callable[[], str],
               propagation_s: float = PROPAGATION_S) -> CredentialState:
    """One step of the credential's life. A new Secret counts `requested` as carried out (an EnsembleRouter
    created with the annotation is not rotated at once)."""
    if state is None:
        return CredentialState(mint(), rotation=requested)
    if state.pending is None:
        if requested == state.rotation:
            return state
        return replace(state, pending=mint(), staging=requested, staged_at=now)
    if state.staged_at is None or (now - state.staged_at).total_seconds() >= propagation_s:
        return CredentialState(state.pending, state.current, None, state.staging or requested)
    return state


def accepted_text(state: CredentialState) -> str:
    """The `accepted` file: a token a line, the one the router sends next first."""
    return "".join(t + "\n" for t in state.accepted())


def accepted_digest(text: str) -> str:
    """A digest of what the engines accept, for the EnsembleRouter's status: it changes at each step of
    a rotation, which is how the Specialists it selects learn to copy the tokens again (the tokens are
    random 256-bit values: their digest reveals nothing about them)."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def wait_seconds(state: CredentialState, now: datetime, propagation_s: float = PROPAGATION_S) -> float | None:
    """Seconds until a staged token may be promoted; None when nothing is staged."""
    if state.pending is None or state.staged_at is None:
        return None
    return max(0.0, propagation_s - (now - state.staged_at).total_seconds())


def secret_content(state: CredentialState) -> tuple[dict[str, str], dict[str, str]]:
    """The Secret's data (base64) and annotations for `state`."""
    b64 = credential_res.b64
    data = {"current": b64(state.current + "\n"), "accepted": b64(accepted_text(state))}
    annotations = {ROTATION_DONE: state.rotation}
    if state.previous:
        data["previous"] = b64(state.previous + "\n")
    if state.pending:
        data["pending"] = b64(state.pending + "\n")
        annotations[STAGING] = state.staging or ""
        if state.staged_at is not None:
            annotations[STAGED_AT] = rfc3339(state.staged_at)
    return data, annotations


def ours(live: dict[str, Any] | None, name: str, uid: str) -> dict[str, Any] | None:
    """`live` when this EnsembleRouter may write it, else None (a foreign Secret is never read as ours;
    writing it is refused, and reported, by the handler's ownership check)."""
    if live is None or ownership.conflict({"kind": "Secret", "metadata": {"name": name}}, live, uid) is not None:
        return None
    return live


def router_secrets(router: str, namespace: str, uid: str, generate_keys: bool, observed: RouterSecrets,
                   labels: dict[str, str], owner: dict[str, Any], now: datetime, propagation_s: float,
                   mint: Callable[[], str] = new_token) -> tuple[list[dict[str, Any]], float | None, str]:
    """The Secrets to hold (the engine credential; generated API keys when the spec names none), the
    seconds until a staged rotation may be promoted (None: nothing staged), and accepted_digest."""
    name = credential_res.engine_credential_secret_name(router)
    state = next_state(state_from_secret(ours(observed.engine_credential, name, uid)), observed.rotation, now,
                       mint, propagation_s)
    data, annotations = secret_content(state)
    out = [credential_res.secret(name, namespace, labels, owner, data, annotations)]
    if generate_keys:
        keys_name = credential_res.api_keys_secret_name(router)
        kept = ((ours(observed.api_keys, keys_name, uid) or {}).get("data") or {}).get(credential_res.API_KEYS_KEY)
        keys = {credential_res.API_KEYS_KEY: kept or credential_res.generated_keys(mint())}
        out.append(credential_res.secret(keys_name, namespace, labels, owner, keys))
    return out, wait_seconds(state, now, propagation_s), accepted_digest(accepted_text(state))
