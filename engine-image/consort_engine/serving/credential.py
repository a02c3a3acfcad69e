"""The engine credential: the shared secret its router (and nobody else) presents as
`Authorization: Bearer <credential>` on every route but /health and /ready (the kubelet's probes)
and /metrics (unless /metrics has a port of its own: --metrics-port).

Without it anyone who reaches an engine port could load any directory on the pod as a LoRA adapter,
drop adapters, or claim any tenant (x-consort-tenant) and read its prefix cache through
cached_tokens. Configured by `consort engine --credential-file PATH` (or the environment variable
CONSORT_ENGINE_CREDENTIAL_FILE); unset, the engine stays open as before. The file holds one
credential a line (# comments): any of them is accepted, so a new one can be added, given to the
router, and the old line removed after. Only SHA-256 digests are kept, compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import os

CREDENTIAL_ENV = "CONSORT_ENGINE_CREDENTIAL_FILE"
PROBE_PATHS = frozenset({"/health", "/ready"})


def _digest(s: str) -> bytes:
    return hashlib.sha256(s.encode()).digest()


def parse_credentials(text: str) -> tuple[bytes, ...]:
    return tuple(_digest(line.strip()) for line in text.splitlines() if line.strip() and not line.startswith("#"))


def read_credentials(path: str | None) -> tuple[bytes, ...]:
    """The accepted credentials' digests; () when none is configured (argument or environment). A file
    that is configured but empty or missing is an error: the engine must not start open by accident."""
    path = path or os.environ.get(CREDENTIAL_ENV) or None
    if path is None:
        return ()
    with open(path) as f:
        digests = parse_credentials(f.read())
    if not digests:
        raise ValueError(f"credential file {path} holds no credential")
    return digests


def needs_credential(path: str, metrics_port: bool) -> bool:
    """Whether a request to `path` must carry the credential (the probes never do; /metrics only when it
    has its own port, so the API port can be closed to monitoring)."""
    return path not in PROBE_PATHS and (metrics_port or path != "/metrics")


def presented(digests: tuple[bytes, ...], authorization: str | None) -> bool:
    """True when `authorization` is `Bearer <one of the credentials>`. Constant time over all of them."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    d = _digest(token.strip())
    ok = False
    for k in digests:
        ok |= hmac.compare_digest(d, k)
    return ok
