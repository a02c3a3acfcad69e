"""The leader election shell: reads and writes the Lease, acts on lifecycle/leader.py's decisions.

`main.py` blocks in `acquire` until this replica holds the Lease, then runs Kopf (standalone: no
Kopf peering) beside `keep`, which renews every retry period. A leader that cannot renew within the
renew deadline exits the process at once (status 1; the kubelet restarts it as a standby), as
controller-runtime does: a process that is gone cannot reconcile, whatever Kopf was doing. A thread
watches the same deadline, so a blocked event loop cannot outlive it either.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable
from urllib.parse import urlparse

from .kube import Kube, KubeError
from .lifecycle.leader import (Action, Record, State, Timings, decide, lease_spec, lost, micro_time, observe,
                               record_of, released_spec)
from .metrics import LEADER

log = logging.getLogger("consort.operator.leader")


def identity(pod_name: str | None = None) -> str:
    """The pod's name (downward API) plus a random suffix: a restarted container is a new candidate,
    never mistaken for the leader it replaced."""
    base = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{secrets.token_hex(4)}"


def exit_lost(message: str) -> None:
    print(f"consort operator: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Elector:
    def __init__(self, kube: Kube, namespace: str, name: str, me: str, timings: Timings,
                 clock: Callable[[], float] = time.monotonic, on_lost: Callable[[str], None] = exit_lost):
        self.kube, self.namespace, self.name, self.me, self.t = kube, namespace, name, me, timings
        self.clock = clock
        self.on_lost = on_lost
        self.state = State()
        self.record: Record | None = None
        self._holder_logged: str | None = None
        self._error_logged: str | None = None
        LEADER.labels(me).set(0)

    @property
    def leading(self) -> bool:
        return self.state.renewed_at is not None

    def _budget(self, now: float) -> float:
        """How long one call may take: a leader's never outlasts its renew deadline."""
        if self.state.renewed_at is None:
            return self.t.renew_deadline
        return max(0.1, self.t.renew_deadline - (now - self.state.renewed_at))

    def _lease(self, spec: dict[str, Any], record: Record | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record is not None:
            meta["resourceVersion"] = record.resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _call_failed(self, what: str, e: BaseException) -> None:
        line = f"{what}: {e or type(e).__name__}"
        if line != self._error_logged:     # one line per distinct failure, not one per retry
            log.warning("Lease %s/%s: %s", self.namespace, self.name, line)
            self._error_logged = line

    async def step(self) -> Action:
        """One look at the Lease, and the write its decision calls for."""
        now = self.clock()
        if lost(self.state, now, self.t):
            return "lost"
        try:
            obj = await asyncio.wait_for(self.kube.get("Lease", self.namespace, self.name), self._budget(now))
        except Exception as e:   # noqa: BLE001  (unreachable apiserver, timeout, HTTP error: all mean "no news")
            self._call_failed("read", e)
            return "lost" if lost(self.state, self.clock(), self.t) else "wait"
        now = self.clock()
        record = record_of(obj)
        self.state = observe(self.state, record, now)
        self.record = record
        action = decide(record, self.me, now, self.state, self.t)
        if action == "wait" and record is not None and record.holder != self._holder_logged:
            log.info("standby: Lease %s/%s is held by %s", self.namespace, self.name, record.holder)
            self._holder_logged = record.holder
        if action not in ("acquire", "renew"):
            return action
        started = self.clock()   # the deadline runs from before the write: the lease may be seen from then on
        body = self._lease(lease_spec(record, self.me, datetime.now(timezone.utc), self.t), record)
        try:
            write = self.kube.create(body) if record is None else self.kube.replace(body)
            written = await asyncio.wait_for(write, self._budget(started))
        except KubeError as e:
            if e.status == 409:
                log.info("Lease %s/%s changed under us (409): another replica moved first", self.namespace, self.name)
            else:
                self._call_failed(action, e)
            return "lost" if lost(self.state, self.clock(), self.t) else "wait"
        except Exception as e:   # noqa: BLE001
            self._call_failed(action, e)
            return "lost" if lost(self.state, self.clock(), self.t) else "wait"
        self._error_logged = None
        self.record = record_of(written)
        self.state = observe(replace(self.state, renewed_at=started), self.record, self.clock())
        return action

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Block until this replica holds the Lease (True), or until `stop` (False)."""
        log.info("leader election: %s waits for Lease %s/%s (duration %gs, renew deadline %gs, retry %gs)",
                 self.me, self.namespace, self.name, self.t.lease_duration, self.t.renew_deadline, self.t.retry_period)
        while not stop.is_set():
            if await self.step() in ("acquire", "renew"):
                self._became_leader()
                await self._post_event()
                return True
            try:
                await asyncio.wait_for(stop.wait(), self.t.retry_period)
            except asyncio.TimeoutError:
                pass
        return False

    def _became_leader(self) -> None:
        LEADER.labels(self.me).set(1)
        transitions = self.record.transitions if self.record else 0
        print(f"consort operator: {self.me} leads (Lease {self.namespace}/{self.name}, transitions {transitions})",
              file=sys.stderr, flush=True)
        threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()

    def check_leading(self) -> None:
        """The write guard (Kube.write_guard): no write once the renew deadline has passed."""
        if lost(self.state, self.clock(), self.t):
            self._lost()
            raise RuntimeError(f"{self.me} is no longer the leader: write refused")

    async def _post_event(self) -> None:
        """`kubectl describe lease` / `kubectl get events` say who leads since when (as client-go does)."""
        now = micro_time(datetime.now(timezone.utc))[:19] + "Z"
        uid = (self.record and self.record.uid) or None
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": f"{self.name}.{secrets.token_hex(8)}", "namespace": self.namespace},
                 "involvedObject": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "name": self.name,
                                    "namespace": self.namespace, **({"uid": uid} if uid else {})},
                 "reason": "LeaderElection", "message": f"{self.me} became leader", "type": "Normal",
                 "source": {"component": "consort-operator"}, "firstTimestamp": now, "lastTimestamp": now,
                 "count": 1}
        try:
            await asyncio.wait_for(self.kube.create(event), 2.0)
        except Exception as e:   # noqa: BLE001  (the Lease and the log line say it too)
            self._call_failed("post the leader Event", e)

    def _lost(self) -> None:
        LEADER.labels(self.me).set(0)
        since = self.clock() - (self.state.renewed_at or 0.0)
        self.on_lost(f"{self.me} lost the leader Lease {self.namespace}/{self.name} (not renewed for {since:.1f}s, "
                     f"deadline {self.t.renew_deadline:g}s): exiting so that a standby takes over")

    def _watchdog(self) -> None:
        while self.leading:
            if lost(self.state, self.clock(), self.t):
                self._lost()
                return
            time.sleep(min(0.5, self.t.retry_period / 4))

    async def keep(self) -> None:
        """Renew every retry period while leading (run beside Kopf; cancelled when Kopf has stopped)."""
        while True:
            await asyncio.sleep(self.t.retry_period)
            if await self.step() == "lost":
                self._lost()
                return

    async def release(self) -> None:
        """After Kopf stopped: hand the Lease back so a standby acquires on its next look."""
        if not self.leading or self.record is None or lost(self.state, self.clock(), self.t):
            return
        body = self._lease(released_spec(self.record, datetime.now(timezone.utc)), self.record)
        try:
            await asyncio.wait_for(self.kube.replace(body), min(2.0, self._budget(self.clock())))
            log.info("released Lease %s/%s", self.namespace, self.name)
        except Exception as e:   # noqa: BLE001  (it expires on its own)
            self._call_failed("release", e)
        self.state = replace(self.state, renewed_at=None)
        LEADER.labels(self.me).set(0)


async def standby_health(url: str) -> Any:
    """Answer the liveness/readiness URL while waiting for the Lease (Kopf serves it once it runs):
    a standby is healthy, and a rolling update must not wait for it to lead."""
    if not url:
        return None
    from aiohttp import web

    u = urlparse(url)

    async def ok(_: Any) -> Any:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get(u.path or "/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, u.hostname, u.port or 80, reuse_address=True).start()
    return runner
