"""Helpers for tests that talk to a Kubernetes API server (import as `from kube import ...`).

pytest puts tests/ on sys.path (tests/conftest.py lives there and tests/ is not a package), so
every test module can import this one by its bare name.
"""

from __future__ import annotations

import time
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
