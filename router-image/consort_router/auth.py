"""API keys as named tenants: `Authorization: Bearer <key>` resolved against a keys file in constant time.

The file (the EnsembleRouter's Secret) holds one tenant per line, `name: key`; a line without `: ` is
an old-style bare key, an anonymous tenant named `anon-<first 8 hex of its SHA-256>` (stable, and
not enough of the digest to help guess the key). Blank lines and `#` comments are ignored. The file
is re-read when its mtime changes. Keys are kept only as SHA-256 digests and compared with
`hmac.compare_digest` against every key (no early exit), so neither timing nor logs reveal them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field

TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ANONYMOUS = "anonymous"   # the tenant of every request when auth is off


@dataclass(frozen=True)
class KeyEntry:
    digest: bytes
    tenant: str


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> tuple[KeyEntry, ...]:
    """`name: key` lines and bare keys (anonymous tenants). Raises ValueError on a bad tenant name or a
    name given twice (two tenants sharing a name would share quotas and cache salt by accident)."""
    out: list[KeyEntry] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = (line + " ").partition(": ")   # `name:` alone is a tenant without a key
        if sep:
            name, key = name.strip(), key.strip()
            if not TENANT_NAME.match(name) or not key:
                raise ValueError(f"keys file line {n}: expected `name: key` with a name of letters, digits, "
                                 "'.', '_' or '-' (at most 63)")
            if name in seen:
                raise ValueError(f"keys file line {n}: tenant {name!r} is given twice")
            seen.add(name)
        else:
            key = line
            name = "anon-" + hashlib.sha256(key.encode()).hexdigest()[:8]
        out.append(KeyEntry(_digest(key), name))
    return tuple(out)


def engine_credential(path: str | None) -> str | None:
    """The credential the router presents to its engines: the file's first line (# comments skipped).
    A file that is named but holds none is an error (the engines would refuse every call)."""
    if path is None:
        return None
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                return line.strip()
    raise ValueError(f"engine credential file {path} holds no credential")


@dataclass
class EngineCredential:
    """The engine credential file, re-read when it changes (rotation: the engines accept the new line
    before it becomes this file's first)."""

    path: str | None
    value: str | None = field(default=None, repr=False)
    _mtime: int | None = field(default=None, repr=False)

    def refresh(self) -> bool:
        """Re-read the file if it changed; True when the value changed. Raises as engine_credential()
        (at start-up; the caller keeps the old value and logs it later)."""
        if self.path is None:
            return False
        mtime = os.stat(self.path).st_mtime_ns
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        old, self.value = self.value, engine_credential(self.path)
        return self.value != old

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"} if self.value else {}


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def resolve(entries: tuple[KeyEntry, ...], token: str | None) -> str | None:
    """The tenant whose key is `token`, or None. Constant time in the token and over all keys."""
    if token is None or not entries:
        return None
    d = _digest(token)
    found = None
    for e in entries:
        if hmac.compare_digest(d, e.digest) and found is None:
            found = e.tenant
    return found


@dataclass
class KeyRing:
    path: str | None
    entries: tuple[KeyEntry, ...] = ()
    _mtime: float | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def refresh(self) -> None:
        """Re-read the file if it changed. A missing file means no key is valid (fail closed); a file
        that does not parse keeps the previous keys (raised at start-up, logged by the caller later)."""
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.entries, self._mtime = (), None
            return
        if mtime != self._mtime:
            with open(self.path) as f:
                text = f.read()
            self._mtime = mtime
            self.entries = parse_keys(text)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant: ANONYMOUS when auth is off, None when a key is required and not valid."""
        if not self.enabled:
            return ANONYMOUS
        return resolve(self.entries, bearer(authorization))
