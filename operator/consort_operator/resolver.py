"""Pod-address resolvers: how the operator reaches an engine pod's HTTP server.

Injectable (`consort operator --pod-address ...`):
  pod-ip        the pod's IP and the engine port (in a cluster; the default)
  none          never contact pods (warm signal falls back to pod readiness, if the policy allows)
  file:PATH     a JSON or YAML mapping {"<namespace>/<pod>" or "<pod>": "host:port"}, re-read when it
                changes. Tests map kwok's fake pods onto real local `consort engine` processes this
                way; a pod missing from the mapping is unreachable (never its fake IP).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    ip: str | None
    port: int


class PodAddressResolver(Protocol):
    def resolve(self, pod: PodRef) -> str | None:
        """'host:port' of the pod's engine, or None when it cannot be reached."""


class PodIPResolver:
    def resolve(self, pod: PodRef) -> str | None:
        if not pod.ip:
            return None
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        return f"{host}:{pod.port}"


class NullResolver:
    def resolve(self, pod: PodRef) -> str | None:
        return None


class MappingResolver:
    def __init__(self, mapping: dict[str, str]):
        self.mapping = dict(mapping)

    def resolve(self, pod: PodRef) -> str | None:
        return self.mapping.get(f"{pod.namespace}/{pod.name}") or self.mapping.get(pod.name)


class FileResolver:
    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._map: dict[str, str] = {}

    def _load(self) -> dict[str, str]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._map = None, {}
            return self._map
        stamp = (st.st_mtime, st.st_size)
        if stamp != self._stamp:
            with open(self.path) as f:
                text = f.read()
            try:
                data = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError:
                import yaml

                data = yaml.safe_load(text) or {}
            self._map = {str(k): str(v) for k, v in data.items()}
            self._stamp = stamp
        return self._map

    def resolve(self, pod: PodRef) -> str | None:
        m = self._load()
        return m.get(f"{pod.namespace}/{pod.name}") or m.get(pod.name)


def from_flag(value: str) -> PodAddressResolver:
    if value == "pod-ip":
        return PodIPResolver()
    if value == "none":
        return NullResolver()
    if value.startswith("file:"):
        return FileResolver(value[len("file:"):])
    raise ValueError(f"--pod-address: expected pod-ip, none or file:PATH, got {value!r}")
