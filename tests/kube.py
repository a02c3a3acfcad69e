"""Helpers for tests that talk to a Kubernetes API server (import as `from kube import ...`).

pytest puts tests/ on sys.path (tests/conftest.py lives there and tests/ is not a package), so
every test module can import this one by its bare name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class NotYet(Exception):
    """Raised by a wait_for predicate to say what it observed while the condition does not hold."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Polls `predicate` until it returns something truthy and returns that.

    A falsy return value or an exception (e.g. NotYet("phase Pending")) is recorded as the last
    observation and polling goes on;
    after `timeout` seconds TimeoutError("timed out after Ns waiting for <what>: <last observation>")
    is raised, so a failing test says what it waited for and what it last saw.
    """
    deadline = time.monotonic() + timeout
    last: Any = "no observation yet"
    while True:
        try:
            result = predicate()
            if result:
                return result
            last = result
        except NotYet as exc:
            last = str(exc)
        except Exception as exc:  # noqa: BLE001 - an error is an observation, e.g. 404 before create
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}: {last}"[:4000])
        time.sleep(interval)


def condition(obj: dict, type_: str) -> dict | None:
    """The status condition of `type_` in a Kubernetes object (as a dict from `kubectl -o json`)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def owned_by(obj: dict, owner_uid: str) -> bool:
    return any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])


class CommandFailed(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return (f"{' '.join(map(str, self.cmd))} exited {self.returncode}\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")


@dataclass
class Cluster:
    kubeconfig: Path
    bin_dir: Path
    helm_home: Path
    state_dir: Path | None = None  # the private cluster's dir (CONSORT_CLUSTER_DIR); None when existing
    _api_clients: list = field(default_factory=list)

    def bin(self, name: str) -> str:
        candidate = self.bin_dir / name
        if candidate.exists():
            return str(candidate)
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is neither in {self.bin_dir} nor on PATH (run `make controlplane`)")
        return found

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def _run(self, argv: list[str], input: str | None, check: bool, timeout: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                              env=env or self.env())
        if check and proc.returncode != 0:
            raise CommandFailed(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return self._run([self.bin("kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout)

    def kubectl_json(self, *args: str, timeout: float = 60) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(self, *args: str, input: str | None = None, check: bool = True,
             timeout: float = 180) -> subprocess.CompletedProcess:
        env = {**self.env(), **{f"HELM_{kind}_HOME": str(self.helm_home / kind.lower())
                                for kind in ("CACHE", "CONFIG", "DATA")}}
        return self._run([self.bin("helm"), f"--kubeconfig={self.kubeconfig}", *args], input, check, timeout, env)

    def api_client(self):
        from kubernetes import config

        client = config.new_client_from_config(config_file=str(self.kubeconfig))
        self._api_clients.append(client)
        return client

    def close(self) -> None:
        for client in self._api_clients:
            client.close()
