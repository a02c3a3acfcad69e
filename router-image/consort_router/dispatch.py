"""Router: one router process's state (runtime, lanes, tenants, affinity, upstream session) and
its dispatch of a request: plan, failover over the lane's replicas, shadows, verification samples.

Embedding (the operator, tests): `Router(config, config_path=..., store=...)` then
`server.build_app(router)`. A custom `BreakerStore` (e.g. one backed by EnsembleRouter status)
replaces the FileStore."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from .activator import Activator
from .api import ApiError, ParsedRequest, upstream_body
from .auth import EngineCredential, KeyRing
from .breaker import STATE_CODES, BreakerStore, FileStore, MemoryStore
from .config import RouterConfig
from .detectors import PatternSandbox
from .metrics import RouterMetrics
from .plan import Plan
from .proxy import Attempt, NoReplica, Upstream, open_upstream
from .affinity import Affinity, PrefixIndex, prefix_hashes
from .replicas import ReplicaPoller, choice_outcome
from .routing import RouteDecision
from .shadow import CalibrationLog, CalibrationRecord, disagree, shadow_body, text_of_response
from .state import Lanes, Runtime, build_runtime
from .verifier import Verifier, VerifyResult
from .wake import waker
from . import admission as adm
from . import tenants as tn

log = logging.getLogger("consort.router")


ROUTER = web.AppKey("consort_router", object)
OPEN_PATHS = frozenset({"/health", "/ready", "/version"})
# On SIGTERM the listener closes and the requests in flight (streams included) get this long to
# finish; the pod's grace period (operator resources/router.py) leaves room for it after preStop.
DRAIN_S = 45
GEN_HEADERS = ("x-consort-specialist", "x-consort-shadow", "x-consort-adapter", "x-consort-admission",
               "x-consort-breaker")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
TENANT_HEADER = "x-consort-tenant"         # set by the router on every upstream call, never taken from a client
FEEDBACK_HEADER = "x-consort-feedback-id"  # issued on each answered request; /v1/feedback takes it once


def upstream_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    """A request to an engine: the whole answer within limits.request_timeout_s."""
    return aiohttp.ClientTimeout(total=cfg.limits.request_timeout_s, sock_connect=cfg.limits.connect_timeout_s)


class Router:
    """Everything one router process holds; see the module docstring for how the parts divide."""

    def __init__(self, config: RouterConfig, config_path: str | Path | None = None,
                 store: BreakerStore | None = None) -> None:
        self.config_path = Path(config_path) if config_path else None
        self.base_dir = self.config_path.parent if self.config_path else Path.cwd()
        if store is None:
            if config.store.kind == "file" and config.store.path:
                p = Path(config.store.path)
                store = FileStore(p if p.is_absolute() else self.base_dir / p)
            else:
                store = MemoryStore()
        self.lanes = Lanes(config, store)
        self.lanes.restore()
        self.runtime: Runtime = build_runtime(config, self.base_dir, self.lanes)
        self.metrics = RouterMetrics()
        self.patterns = PatternSandbox(on_timeout=self.metrics.detector_timeouts.inc)
        self.keys = KeyRing(self._path(config.auth.api_keys_file))
        self.keys.refresh()
        self.engine_credential = EngineCredential(self._path(config.auth.engine_credential_file))
        self.engine_credential.refresh()
        self.verifier = Verifier(config.verifier)
        self.calibration = CalibrationLog(self._path(config.calibration_log))
        self.session: aiohttp.ClientSession | None = None
        self.poller: ReplicaPoller | None = None
        self.created = int(time.time())   # the model cards' `created`, as vLLM stamps its start
        self.prefixes = PrefixIndex(config.replica_choice.index_blocks)
        self.shadow_inflight = 0
        self.buckets: dict[str, tn.Bucket] = {}   # tenant -> its token-rate quota bucket
        self.tenant_labels: set[str] = set()     # tenant names metrics carry (bounded; tenants.label)
        self.tasks: set[asyncio.Task] = set()
        self._config_mtime = self._mtime()
        self._bg: list[asyncio.Task] = []
        self._last_save = 0.0
        self._saving: asyncio.Task | None = None
        self._last_reload_check = 0.0
        self.waker = waker(lambda: self.config, self.base_dir)
        self.activator = Activator(self.waker, lambda lane: any(r.ready for r in self.runtime.replicas.get(lane, [])),
                                   self.metrics)

    # ------------------------------------------------------------------ plumbing
    def _path(self, p: str | None) -> str | None:
        if p is None:
            return None
        return p if os.path.isabs(p) else str(self.base_dir / p)

    def _mtime(self) -> int | None:
        try:
            return self.config_path.stat().st_mtime_ns if self.config_path else None
        except FileNotFoundError:
            return None

    @property
    def config(self) -> RouterConfig:
        return self.runtime.config

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    async def start(self, app: web.Application) -> None:
        # every engine call goes through this session: the engine credential rides on all of them
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True),
            auto_decompress=False, skip_auto_headers=("User-Agent",), headers=self.engine_credential.headers(),
        )
        p = self.config.polling
        self.poller = ReplicaPoller(self.session, p.interval_s, p.timeout_s)
        self.poller.track(self._tracked())
        await self.poller.poll_all()
        self.poller.start()
        self._bg.append(asyncio.create_task(self.housekeeping(), name="router-housekeeping"))
        if any(s.service is not None for s in self.config.specialists):
            from .discovery import discovery_loop

            self._bg.append(asyncio.create_task(discovery_loop(self), name="router-discovery"))

    async def stop(self, app: web.Application) -> None:
        for t in self._bg:
            t.cancel()
        saving = self._saving
        for t in list(self.tasks):
            if t is not saving:
                t.cancel()
        await asyncio.gather(*self._bg, *self.tasks, return_exceptions=True)
        await self.activator.close()
        await self.waker.close()
        if self.poller:
            await self.poller.stop()
        self.lanes.save()
        self.patterns.close()
        if self.session:
            await self.session.close()

    def _tracked(self) -> dict:
        return {f"{name}|{r.url}": r for name, reps in self.runtime.replicas.items() for r in reps}

    def swap_runtime(self, runtime: Runtime) -> None:
        before = {r.url for reps in self.runtime.replicas.values() for r in reps}
        self.runtime = runtime
        for url in before - {r.url for reps in runtime.replicas.values() for r in reps}:
            self.prefixes.forget(url)  # a replica that left takes its cache with it
        self.prefixes.capacity = runtime.config.replica_choice.index_blocks
        if self.poller:
            self.poller.track(self._tracked())

    # ------------------------------------------------------------------ background
    async def housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                self.tick()
            except Exception:  # noqa: BLE001
                log.exception("housekeeping failed")

    def tick(self) -> None:
        now = time.monotonic()
        self.lanes.tick(now)
        for spec, old, new in self.lanes.transitions:
            self.metrics.breaker_transitions.labels(spec, new).inc()
        self.lanes.transitions.clear()
        if now - self._last_save >= self.config.store.save_interval_s and self._saving is None:
            snap = self.lanes.snapshot()
            if snap is not None:  # write off the event loop (a file fsync or an API call)
                self._last_save = now
                self._saving = self.spawn(asyncio.to_thread(self.lanes.write, snap))
                self._saving.add_done_callback(lambda _t: setattr(self, "_saving", None))
        if now - self._last_reload_check >= self.config.reload_interval_s:
            self._last_reload_check = now
            self.maybe_reload()
            self.keys.refresh()
            self.refresh_engine_credential()
        self.update_gauges()

    def maybe_reload(self) -> bool:
        m = self._mtime()
        if m is None or m == self._config_mtime:
            return False
        self._config_mtime = m
        try:
            new = RouterConfig.load(self.config_path)  # type: ignore[arg-type]
            rt = build_runtime(new, self.base_dir, self.lanes, previous=self.runtime)
        except Exception as e:  # noqa: BLE001 - keep serving the old config
            log.error("config reload failed, keeping the previous config: %s", e)
            self.metrics.config_reloads.labels("error").inc()
            return False
        self.keys = KeyRing(self._path(new.auth.api_keys_file))
        self.keys.refresh()
        if self._path(new.auth.engine_credential_file) != self.engine_credential.path:
            self.engine_credential = EngineCredential(self._path(new.auth.engine_credential_file))
            self.refresh_engine_credential(force=True)
        if new.verifier != self.verifier.cfg:
            self.verifier = Verifier(new.verifier)
        self.calibration = CalibrationLog(self._path(new.calibration_log))
        self.swap_runtime(rt)
        self.metrics.config_reloads.labels("ok").inc()
        log.info("config reloaded from %s", self.config_path)
        return True

    def refresh_engine_credential(self, force: bool = False) -> None:
        """A rotated credential file takes effect on the next engine call (one session carries it)."""
        try:
            changed = self.engine_credential.refresh()
        except (OSError, ValueError) as e:   # keep presenting the last good one
            log.error("engine credential file unreadable, keeping the previous credential: %s", e)
            return
        if (changed or force) and self.session is not None:
            self.session.headers.pop("Authorization", None)
            self.session.headers.update(self.engine_credential.headers())

    def update_gauges(self) -> None:
        m, cfg = self.metrics, self.config
        for name, b in self.lanes.breakers.items():
            m.breaker_state.labels(name).set(STATE_CODES[b.state])
            m.breaker_rate.labels(name).set(-1 if b.rate is None else b.rate)
            m.breaker_samples.labels(name).set(len(b.samples))
        for name, k in self.lanes.knobs.items():
            m.admission_level.labels(name).set(k.level)
            m.shadow_threshold_delta.labels(name).set(adm.threshold_delta(cfg.admission, k))
        m.priority_floor.clear()
        for intent, f in self.lanes.floors.items():
            m.priority_floor.labels(intent).set(f)
        m.replica_ready.clear()   # replicas come and go: a gone one's series must not linger
        m.replica_load.clear()    # (a stale ready=1 would hide the ConsortNoWarmReplicas alert)
        for name, reps in self.runtime.replicas.items():
            for i, r in enumerate(reps):   # the replica's index, not its URL: /metrics shows no pod addresses
                m.replica_ready.labels(name, str(i)).set(1 if r.ready else 0)
                m.replica_load.labels(name, str(i)).set(r.waiting + r.running)

    # ------------------------------------------------------------------ tenants
    def charge(self, cfg: RouterConfig, tenant: str, req: ParsedRequest) -> None:
        """Take the request's tokens from the tenant's quota, or refuse it with a typed 429."""
        p = tn.policy(cfg.tenants, tenant)
        if p.tokens_per_s is None:
            return
        b, wait_ms = tn.take(self.buckets.get(tenant), p, tn.cost(req.body, req.text, p), time.monotonic())
        self.buckets[tenant] = b
        if wait_ms is not None:
            raise ApiError(429, "tenant_quota", f"tenant {tenant!r} is over its token-rate quota "
                           f"({p.tokens_per_s:g} tokens/s); retry in {wait_ms} ms", type="rate_limited",
                           retry_after_ms=wait_ms)

    def tenant_label(self, tenant: str) -> str:
        return tn.label(self.tenant_labels, self.config.tenants.metric_tenants, tenant)

    # ------------------------------------------------------------------ correctness
    def feed(self, specialist: str, value: float) -> None:
        self.lanes.observe(specialist, value)

    async def verify_and_feed(self, specialist: str, text: str) -> VerifyResult | None:
        if not self.verifier.available:
            return None
        res = await self.verifier.verify(text)
        self.metrics.verifier.labels(specialist, res.reason if res.passed is not True else "pass").inc()
        if res.passed is not None:
            self.feed(specialist, 1.0 if res.passed else 0.0)
        return res

    # ------------------------------------------------------------------ upstream
    def affinity(self, cfg: RouterConfig, req: ParsedRequest, target: str, adapter: object,
                 tenant: str) -> Affinity | None:
        """The prompt's prefix blocks on lane `target` (salted by lane and adapter: other weights, other
        KV; and by tenant and cache_salt, as the engines salt their caches) and how deep each replica
        holds them; None when the lane picks by load only."""
        rc = cfg.replica_choice
        if rc.policy != "prefix-affine":
            return None
        prompt = req.body.get("prompt")
        text = req.text or (json.dumps(prompt) if isinstance(prompt, list) else "")  # token ids: their digits
        salt = req.body.get("cache_salt")
        hashes = prefix_hashes(text, f"{target}\0{adapter or ''}\0{tenant}\0{salt if isinstance(salt, str) else ''}",
                               rc.block_chars, rc.max_blocks)
        return Affinity(hashes, self.prefixes.match(hashes), rc.load_slack)

    async def open_plan(self, rt: Runtime, plan: Plan, req: ParsedRequest, path: str,
                        rid: str, tenant: str) -> tuple[str, Upstream]:
        """The first of plan.targets that answers, before any byte reaches the client: a lane with no
        ready or reachable replica, or whose replicas all answer 5xx, passes the request on to the
        next target (its fallback). A 429 is an answer (admission), passed through."""
        assert self.session is not None
        cfg = rt.config
        timeout = upstream_timeout(cfg)
        failures: list[str] = []
        deadline = time.monotonic() + cfg.limits.request_timeout_s
        for i, target in enumerate(plan.targets):
            spec = cfg.specialist(target)
            assert spec is not None
            if not await self.activator.admit(spec, rt.replicas.get(target, []), i + 1 < len(plan.targets), deadline):
                failures.append(f"{target}: starting from zero replicas")
                continue
            replicas = self.runtime.replicas.get(target, [])   # current: discovery may have added one while held

            def on_attempt(a: Attempt, retried: bool, target: str = target) -> None:
                if a.status:
                    self.lanes.record_response(target, a.status == 429, plan.decision.intent, time.monotonic())
                if retried:
                    self.metrics.retries.labels(target, "connect" if a.status == 0 else str(a.status)).inc()

            body = upstream_body(req.body, target, spec.adapter)
            payload = json.dumps(body).encode()
            affinity = self.affinity(cfg, req, target, plan.adapters.get(target) or body.get("adapter"), tenant)
            try:
                up = await open_upstream(self.session, replicas, path, payload,
                                         {"Content-Type": "application/json", "x-request-id": rid,
                                          TENANT_HEADER: tenant}, timeout,
                                         cfg.polling.preempting_penalty, on_attempt, adapter=plan.adapters.get(target),
                                         affinity=affinity)
            except NoReplica as e:
                failures.append(f"{target}: {e}")
                continue
            if up.response.status >= 500 and i + 1 < len(plan.targets):
                failures.append(f"{target}: HTTP {up.response.status}")
                up.response.release()
                up.replica.inflight -= 1
                self.metrics.retries.labels(target, "fallback").inc()
                continue
            self.metrics.replica_choice.labels(target, choice_outcome(affinity, up.replica)).inc()
            if affinity is not None and up.response.status < 400:
                self.prefixes.record(affinity.hashes, up.replica.url)
            if i > 0:
                log.info("request %s: %s served for %s (%s)", rid, target, plan.targets[0], "; ".join(failures))
            return target, up
        log.warning("request %s: no ready replica could serve: %s", rid, "; ".join(failures))
        raise ApiError(503, "no_ready_replica", f"no ready replica of {', '.join(plan.targets)} could serve this "
                       f"request (request id {rid})", retry_after_ms=1000)

    # ------------------------------------------------------------------ shadow
    async def run_shadow(self, rt: Runtime, d: RouteDecision, obj: dict, path: str, rid: str,
                         primary: asyncio.Future, tenant: str) -> None:
        cfg = rt.config
        target = d.shadow
        assert target is not None
        outcome = "dropped"
        self.shadow_inflight += 1
        try:
            body = shadow_body(upstream_body(obj, target, cfg.specialist(target).adapter), target, cfg.shadow)
            shadow_task = asyncio.ensure_future(self._shadow_request(rt, target, path, body, rid, tenant))
            pending: set = {shadow_task, primary}
            deadline = time.monotonic() + cfg.shadow.timeout_s
            while pending:
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    shadow_task.cancel()
                    outcome = "timeout"
                    return
                if primary in done and (primary.cancelled() or primary.exception() is not None):
                    shadow_task.cancel()
                    outcome = "primary_failed"
                    return
            shadow_text = shadow_task.result()
            primary_text = primary.result()
            if shadow_text is None:
                outcome = "rejected"
                return
            pv = sv = None
            if self.verifier.available:
                pv, sv = await asyncio.gather(self.verifier.verify(primary_text), self.verifier.verify(shadow_text))
                for spec, res in ((d.specialist, pv), (target, sv)):
                    self.metrics.verifier.labels(spec, res.reason if res.passed is not True else "pass").inc()
                    if res.passed is not None:
                        self.feed(spec, 1.0 if res.passed else 0.0)
            if disagree(primary_text, shadow_text, pv.passed if pv else None, sv.passed if sv else None):
                outcome = "disagree"
                rec = CalibrationRecord(rid, d.intent, d.shadow_reason, d.confidence, d.specialist, target,
                                        primary_text, shadow_text, pv.to_dict() if pv else None,
                                        sv.to_dict() if sv else None)
                await asyncio.to_thread(self.calibration.write, rec.to_json(cfg.shadow.record_outputs))
                self.metrics.calibration.labels(d.specialist, target).inc()
            else:
                outcome = "agree"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:  # noqa: BLE001 - a shadow never hurts the caller
            log.exception("shadow %s for %s failed", target, rid)
            outcome = "error"
        finally:
            self.shadow_inflight -= 1
            self.metrics.shadows.labels(target, d.shadow_reason, outcome).inc()

    async def _shadow_request(self, rt: Runtime, target: str, path: str, body: dict, rid: str,
                              tenant: str) -> str | None:
        assert self.session is not None
        lim = rt.config.limits
        try:
            up = await open_upstream(
                self.session, rt.replicas.get(target, []), path, json.dumps(body).encode(),
                {"Content-Type": "application/json", "x-request-id": f"{rid}-shadow", TENANT_HEADER: tenant},
                aiohttp.ClientTimeout(total=rt.config.shadow.timeout_s, sock_connect=lim.connect_timeout_s),
                rt.config.polling.preempting_penalty, adapter=body.get("adapter"),
            )
        except NoReplica:
            return None
        try:
            if up.response.status != 200:
                return None
            return text_of_response(await up.response.json(content_type=None))
        finally:
            up.replica.inflight -= 1
            up.response.release()
