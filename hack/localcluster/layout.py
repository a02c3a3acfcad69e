"""Where a local cluster lives (state dir layout, ports, saved state) and bounded waiting."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

class ClusterError(RuntimeError):
    """A failure with a one-line explanation for the user."""


class NotYet(Exception):
    """Raised by a wait_for check to report what it saw while its condition does not hold yet."""


@dataclass(frozen=True)
class Layout:
    root: Path
    bin_dir: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def stages_file(self) -> Path:
        return self.bin_dir.parent / "share" / "kwok" / "stages.yaml"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def component_kubeconfig(self, name: str) -> Path:
        return self.root / f"{name}.kubeconfig"


@dataclass
class Ports:
    etcd: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


@dataclass
class State:
    ports: Ports
    started_at: float
    apiserver_ready_s: float = 0.0
    ready_s: float = 0.0
    real_node: bool = False  # a containerd node (node.py) runs beside the kwok nodes
    node_ports: dict[str, int] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: Path) -> State | None:
        try:
            raw = json.loads(path.read_text())
            return State(**{**raw, "ports": Ports(**raw["ports"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Polls `check` until it returns a truthy value; a raised ClusterError aborts at once."""
    deadline = time.monotonic() + timeout
    last: object = "no observation yet"
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except ClusterError:
            raise
        except NotYet as exc:
            last = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is an observation to report
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}: {last}")
        time.sleep(interval)


def choose_free_ports(count: int) -> list[int]:
    """Ports the kernel says are free on 127.0.0.1, all distinct (sockets held until all chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
