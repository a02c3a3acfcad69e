"""API-key auth: `Authorization: Bearer <key>` checked against a keys file, in constant time.

The file holds one key per line (blank lines and `#` comments ignored) and is re-read when its mtime
changes. Keys are kept only as SHA-256 digests and compared with `hmac.compare_digest` against every
key (no early exit), so neither timing nor logs reveal them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> tuple[bytes, ...]:
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(_digest(line))
    return tuple(keys)


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check(digests: tuple[bytes, ...], token: str | None) -> bool:
    """True if `token` equals one of the keys. Constant time in the token and over all keys."""
    if token is None or not digests:
        return False
    d = _digest(token)
    ok = False
    for k in digests:
        ok |= hmac.compare_digest(d, k)
    return ok


@dataclass
class KeyRing:
    path: str | None
    digests: tuple[bytes, ...] = ()
    _mtime: float | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def refresh(self) -> None:
        """Re-read the file if it changed. A missing file means no key is valid (fail closed)."""
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.digests, self._mtime = (), None
            return
        if mtime != self._mtime:
            with open(self.path) as f:
                self.digests = parse_keys(f.read())
            self._mtime = mtime

    def allows(self, authorization: str | None) -> bool:
        return check(self.digests, bearer(authorization))
