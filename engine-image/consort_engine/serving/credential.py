"""The engine credential: the shared secret its router (and nobody else) presents as
`Authorization: Bearer <credential>` on every route but /health and /ready (the kubelet's probes)
and /metrics (unless /metrics has a port of its own: --metrics-port).

Without it anyone who reaches an engine port could load any directory on the pod as a LoRA adapter,
drop adapters, or claim any tenant (x-consort-tenant) and read its prefix cache through
cached_tokens. Configured by `consort engine --credential-file PATH` (or the environment variable
CONSORT_ENGINE_CREDENTIAL_FILE); unset, the engine stays open as before. The file holds one
credential a line (# comments): any of them is accepted, so a new one can be added, given to the
router, and the old line removed after. PATH may also be a directory (the operator mounts one file
per EnsembleRouter there): every line of every file in it is accepted, and an empty directory
accepts nothing (closed, never open). Only SHA-256 digests are kept, compared in constant time.

The engine follows the file: `CredentialSource.follow` re-reads it when it changes (a rotated
Kubernetes Secret lands in the pod within the kubelet's sync period), so rotation restarts nothing.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
from typing import Callable

log = logging.getLogger("consort.engine")

CREDENTIAL_ENV = "CONSORT_ENGINE_CREDENTIAL_FILE"
PROBE_PATHS = frozenset({"/health", "/ready"})
FOLLOW_S = 2.0          # how often the file's stat is compared (a few syscalls, off the request path)
# Required, and nothing presented matches: a 0-byte "digest" never equals a SHA-256 one.
CLOSED: tuple[bytes, ...] = (b"",)


def _digest(s: str) -> bytes:
    return hashlib.sha256(s.encode()).digest()


def parse_credentials(text: str) -> tuple[bytes, ...]:
    return tuple(_digest(line.strip()) for line in text.splitlines() if line.strip() and not line.startswith("#"))


class CredentialSource:
    """The configured credential file (or directory), read at start and re-read when it changes."""

    def __init__(self, path: str | None):
        self.path = path or os.environ.get(CREDENTIAL_ENV) or None
        self._stamp: tuple = ()

    def files(self) -> list[str]:
        if self.path is not None and os.path.isdir(self.path):
            # a Secret volume's own entries (..data, ..2026_...) start with dots
            return [os.path.join(self.path, n) for n in sorted(os.listdir(self.path)) if not n.startswith(".")]
        return [self.path] if self.path is not None else []

    def stamp(self) -> tuple:
        """Changes whenever a file's content may have: a Secret update swaps the files' targets
        (new inode), an editor rewrites them (new mtime or size)."""
        out = []
        for f in self.files():
            st = os.stat(f)
            out.append((f, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def read(self) -> tuple[bytes, ...]:
        """The accepted credentials' digests; () when none is configured (argument or environment). A
        file that is configured but empty or missing is an error: the engine must not start open by
        accident. An empty directory is CLOSED: its files may come later."""
        if self.path is None:
            return ()
        stamp = self.stamp()
        digests: tuple[bytes, ...] = ()
        for f in self.files():
            with open(f) as fh:
                digests += parse_credentials(fh.read())
        self._stamp = stamp
        if digests:
            return digests
        if os.path.isdir(self.path):
            return CLOSED
        raise ValueError(f"credential file {self.path} holds no credential")

    def reread(self) -> tuple[bytes, ...] | None:
        """The new digests when the file changed since the last read, else None."""
        if self.path is None or self.stamp() == self._stamp:
            return None
        return self.read()

    async def follow(self, apply: Callable[[tuple[bytes, ...]], None], stop: asyncio.Event,
                     every: float = FOLLOW_S) -> None:
        """Until `stop`: apply the file's credentials whenever it changes. A file that turns unreadable
        or empty keeps the last good credentials (logged): a half-written update must not lock out
        the router, and an engine never turns open."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=every)
                return
            except asyncio.TimeoutError:
                pass
            try:
                new = self.reread()
            except (OSError, ValueError) as e:
                log.error("engine credential file unreadable, keeping the previous credentials: %s", e)
                continue
            if new is not None:
                apply(new)
                log.info("engine credential file %s changed: %d credential(s) accepted", self.path,
                         0 if new == CLOSED else len(new))


def read_credentials(path: str | None) -> tuple[bytes, ...]:
    """CredentialSource(path).read(), for a caller that does not follow the file."""
    return CredentialSource(path).read()


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
