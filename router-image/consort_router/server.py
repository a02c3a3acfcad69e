"""`consort router --config FILE --port P`: the ensemble's OpenAI-compatible front door (aiohttp).

Handlers are thin: api.py parses, routing.py decides the specialist, replicas.py the replica,
proxy.py moves bytes, state.py holds lane state (breakers, admission knobs), verifier.py and
shadow.py produce correctness samples and calibration records off the hot path.

Embedding (the operator, tests): `Router(config, config_path=..., store=...)` then `build_app(router)`.
A custom `BreakerStore` (e.g. one backed by EnsembleRouter status) replaces the FileStore.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import random
import secrets
import signal
import sys
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

from .api import ApiError, ParsedRequest, parse_json, parse_request, tokenizer_lane, upstream_body
from .auth import ANONYMOUS, EngineCredential, KeyRing
from .breaker import STATE_CODES, BreakerStore, FileStore, MemoryStore, is_fresh
from .config import RouterConfig
from .detectors import PatternSandbox
from .metrics import RouterMetrics
from .plan import Plan, PlanInput, plan_request
from .proxy import Attempt, NoReplica, Upstream, copy_headers, error_code, open_upstream, relay_stream
from .affinity import Affinity, PrefixIndex, prefix_hashes
from .replicas import ReplicaPoller, choice_outcome
from .routing import RouteDecision
from .shadow import CalibrationLog, CalibrationRecord, disagree, shadow_body, text_of_response, text_of_sse
from .state import Lanes, Runtime, build_runtime
from .verifier import Verifier, VerifyResult
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
        for i, target in enumerate(plan.targets):
            spec = cfg.specialist(target)
            assert spec is not None

            def on_attempt(a: Attempt, retried: bool, target: str = target) -> None:
                if a.status:
                    self.lanes.record_response(target, a.status == 429, plan.decision.intent, time.monotonic())
                if retried:
                    self.metrics.retries.labels(target, "connect" if a.status == 0 else str(a.status)).inc()

            body = upstream_body(req.body, target, spec.adapter)
            payload = json.dumps(body).encode()
            affinity = self.affinity(cfg, req, target, plan.adapters.get(target) or body.get("adapter"), tenant)
            try:
                up = await open_upstream(self.session, rt.replicas.get(target, []), path, payload,
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


# ====================================================================== HTTP handlers


def _json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers())


@web.middleware
async def middleware(request: web.Request, handler):
    router: Router = request.app[ROUTER]
    request["request_id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
    request["tenant"] = ANONYMOUS
    generation = request.path in GENERATION_PATHS
    try:
        if router.keys.enabled and request.path not in OPEN_PATHS:
            cfg = router.config.auth
            protected = (cfg.protect_metrics if request.path == "/metrics"
                         else cfg.protect_routing if request.path == "/v1/routing" else True)
            tenant = router.keys.tenant(request.headers.get("Authorization"))
            if protected and tenant is None:
                generation = False   # an unknown caller is no tenant: counted in rejections only
                raise ApiError(401, "invalid_api_key", "missing or invalid API key (Authorization: Bearer <key>)")
            request["tenant"] = tenant or ANONYMOUS
        resp = await handler(request)
        if generation:
            router.metrics.tenant_requests.labels(router.tenant_label(request["tenant"]), str(resp.status)).inc()
        return resp
    except ApiError as err:
        if err.status >= 400:
            router.metrics.rejections.labels(err.code).inc()
        if generation:
            router.metrics.tenant_requests.labels(router.tenant_label(request["tenant"]), str(err.status)).inc()
        return _json_error(err)
    except web.HTTPException as exc:
        if exc.status >= 400:
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
            return _json_error(ApiError(exc.status, code, exc.reason))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a bug must never take the router down
        rid = request["request_id"]
        log.exception("request %s: unhandled error on %s %s", rid, request.method, request.path)
        # the id, not the cause: exception text can carry upstream addresses, paths or another request's data
        return _json_error(ApiError(500, "internal_error", f"internal error (request id {rid}; the cause is in "
                                    "the router log)"))


async def stamp(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-request-id"] = request.get("request_id") or uuid.uuid4().hex
    st = request.get("stamp")
    if st is not None:
        for k in GEN_HEADERS:
            response.headers[k] = st.get(k, "none")
    if response.status == 200 and request.get("feedback_id"):
        response.headers[FEEDBACK_HEADER] = request["feedback_id"]


def upstream_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    """A request to an engine: the whole answer within limits.request_timeout_s."""
    return aiohttp.ClientTimeout(total=cfg.limits.request_timeout_s, sock_connect=cfg.limits.connect_timeout_s)


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "request_too_large", f"request body exceeds {limit} bytes")
    buf = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, "request_too_large", f"request body exceeds {limit} bytes")
    return bytes(buf)


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "completion", "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "chat", "/v1/chat/completions")


async def responses(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, "responses", "/v1/responses")


async def handle_generation(request: web.Request, kind: str, path: str) -> web.StreamResponse:
    """Executes plan_request's Plan: reject, or open the first target that answers (failover before
    the first byte), spawn the shadow, relay, record what happened."""
    router: Router = request.app[ROUTER]
    rt = router.runtime  # this request's config, whatever reloads happen meanwhile
    cfg = rt.config
    t0 = time.monotonic()
    rid, tenant = request["request_id"], request["tenant"]
    req = parse_request(parse_json(await read_body(request, cfg.limits.max_body_bytes)), kind,
                        request.headers.get("x-consort-intent"), tn.policy(cfg.tenants, tenant).max_priority)
    router.charge(cfg, tenant, req)
    user_counts = None
    if rt.table.user_patterns is not None and rt.table.consults_detectors(req.model, req.intent):
        user_counts = await router.patterns.counts(rt.table.user_patterns, req.text,
                                                   tuple(d.min_matches for d in rt.table.detectors))
    plan = plan_request(cfg, rt.table, req, PlanInput(
        router.lanes.lane_views(rt), router.lanes.floors, router.shadow_inflight < cfg.shadow.max_inflight,
        router.verifier.available, random.random(), random.random(), user_counts))
    d = plan.decision
    router.metrics.routing_seconds.observe(time.monotonic() - t0)
    request["stamp"] = plan.headers(d.specialist)
    if plan.rejection is not None:
        raise plan.rejection
    primary_done: asyncio.Future | None = None
    if plan.shadow is not None:
        primary_done = asyncio.get_running_loop().create_future()
        router.spawn(router.run_shadow(rt, d, req.body, path, rid, primary_done, tenant))
    elif d.shadow is not None:
        router.metrics.shadows.labels(d.shadow, d.shadow_reason, "dropped").inc()

    served, text, status = d.specialist, None, 0
    request["feedback_id"] = feedback_id = secrets.token_urlsafe(16)   # sent only with a 200 (stamp)
    pre_upstream = time.monotonic() - t0
    try:
        try:
            served, up = await router.open_plan(rt, plan, req, path, rid, tenant)
        except ApiError:
            request["stamp"] = plan.headers(d.specialist, admission="rejected:no_ready_replica")
            status = 503
            raise
        request["stamp"] = plan.headers(served, adapter=up.response.headers.get("x-consort-adapter"))
        router.metrics.ttft.labels(served).observe(time.monotonic() - t0)
        resp = up.response
        status = resp.status
        try:
            if status == 200 and resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                out = web.StreamResponse(status=200)
                copy_headers(resp, out)
                result = await relay_stream(up, out, request, plan.capture, cfg.limits.stream_idle_timeout_s)
                router.metrics.overhead.observe(pre_upstream + result.first_relay_s)
                if result.error in ("upstream_failed", "idle_timeout"):
                    router.metrics.stream_errors.labels(served).inc()
                    status = 502 if result.error == "upstream_failed" else 504
                    if result.error == "idle_timeout":   # a lane that hangs mid-stream is failing
                        router.feed(served, 0.0)
                elif result.error == "client_disconnected":
                    router.metrics.disconnects.labels(served).inc()
                    status = 499
                elif plan.capture:
                    text = text_of_sse(result.captured)
                return out
            raw = await resp.read()
            if status == 429:
                code = error_code(raw) or "rejected"
                request["stamp"]["x-consort-admission"] = f"rejected:{code}"
                router.metrics.upstream_429.labels(served, code).inc()
            elif status == 200 and plan.capture:
                try:
                    text = text_of_response(json.loads(raw))
                except ValueError:
                    text = None
            out = web.Response(status=status, body=raw)
            copy_headers(resp, out)
            router.metrics.overhead.observe(pre_upstream)
            return out
        finally:
            up.replica.inflight -= 1
            resp.release() if resp.closed is False and resp.content.at_eof() else resp.close()
    except asyncio.CancelledError:
        status = 499
        router.metrics.disconnects.labels(served).inc()
        raise
    finally:
        router.metrics.requests.labels(served, d.intent, d.source, str(status or "error")).inc()
        if status == 200:
            router.lanes.remember(feedback_id, tenant, served, plan.shadow)
        if primary_done is not None and not primary_done.done():
            if text is not None:
                primary_done.set_result(text)
            else:
                primary_done.cancel()
        if plan.verify and text is not None:
            router.spawn(router.verify_and_feed(served, text))


async def feedback(request: web.Request) -> web.Response:
    """A correctness signal about one answered request, named by the id the router issued with it
    (x-consort-feedback-id): accepted once, and only from the tenant that made the request, so no caller
    can trip a lane's breaker for everyone with invented or replayed ids."""
    router: Router = request.app[ROUTER]
    obj = parse_json(await read_body(request, 64 * 1024))
    fid = obj.get("feedback_id")
    if not isinstance(fid, str) or not fid:
        raise ApiError(400, "missing_field", f"'feedback_id' (string) is required: the {FEEDBACK_HEADER} header "
                       "of the answer", param="feedback_id")
    if "correct" in obj:
        if not isinstance(obj["correct"], bool):
            raise ApiError(400, "invalid_type", "'correct' must be a boolean", param="correct")
        value = 1.0 if obj["correct"] else 0.0
    elif "score" in obj:
        s = obj["score"]
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0:
            raise ApiError(400, "invalid_type", "'score' must be a number in [0, 1]", param="score")
        value = float(s)
    else:
        raise ApiError(400, "missing_field", "give 'correct' (boolean) or 'score' (0..1)")
    g = router.lanes.feedback.get(fid)
    specialist = obj.get("specialist", g.primary if g else None)
    if g is not None and g.tenant == request["tenant"] and specialist not in (g.primary, g.shadow):
        raise ApiError(400, "not_involved", f"specialist {specialist!r} neither answered nor shadowed this request "
                       f"(primary {g.primary!r}, shadow {g.shadow!r})", param="specialist")
    # unknown, already used and another tenant's ids are answered alike: nothing leaks about others' ids
    if router.lanes.claim(fid, request["tenant"]) is None:
        raise ApiError(404, "unknown_feedback_id", "feedback id is unknown, already used, too old or not "
                       "this tenant's", param="feedback_id")
    b = router.lanes.observe(specialist, value)
    router.metrics.feedback.labels(specialist).inc()
    return web.json_response({"feedback_id": fid, "specialist": specialist, "breaker": b.state if b else None,
                              "samples": len(b.samples) if b else 0,
                              "rate": b.rate if b else None})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def ready(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER]
    routable = sorted(n for n, reps in router.runtime.replicas.items() if any(r.ready for r in reps))
    if routable:
        return web.json_response({"status": "ready", "routable": routable})
    return web.json_response({"status": "not_ready", "reason": "no specialist has a ready replica"}, status=503)


async def routing_view(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER]
    rt, lanes = router.runtime, router.lanes
    cfg = rt.config
    views = lanes.lane_views(rt)
    specialists = {}
    for s in cfg.specialists:
        b = lanes.breakers.get(s.name)
        k = lanes.knobs.get(s.name, adm.Knobs())
        specialists[s.name] = {
            "intents": s.intents, "fallback": s.fallback, "adapter": s.adapter, "revision": s.revision,
            "routable": views[s.name].routable,
            "replicas": [r.view() for r in rt.replicas.get(s.name, [])],
            "breaker": None if b is None else {
                "state": b.state, "rate": b.rate, "samples": len(b.samples), "window": cfg.breaker.window,
                "total": b.total, "since": b.since, "fresh": is_fresh(b, cfg.breaker), "transitions": b.transitions,
                "breach_run": b.breach_run, "recovery_run": b.recovery_run,
            },
            "admission": {"level": k.level, "shadow_threshold_delta": adm.threshold_delta(cfg.admission, k),
                          "floor": adm.floor_value(cfg.admission, k), "floor_intents": sorted(k.intents)},
        }
    table = rt.table
    return web.json_response({
        "ensemble": cfg.ensemble,
        "intents": table.intents,
        "detectors": [{"name": d.name, "specialist": d.specialist, "min_matches": d.min_matches} for d in table.detectors],
        "classifier": None if table.classifier is None else {"labels": list(table.classifier.labels),
                                                             "kind": cfg.classifier.kind},
        "default_specialist": cfg.default_specialist,
        "shadow": {"default_threshold": cfg.shadow.default_threshold, "thresholds": cfg.shadow.thresholds,
                   "inflight": router.shadow_inflight},
        "priority_floors": lanes.floors,
        "breaker_params": cfg.breaker.model_dump(),
        "specialists": specialists,
    })


def model_cards(router: Router) -> list[dict]:
    """The ensemble (routed) and each specialist (pinned), with vLLM's `root`, `parent`, `created`
    and `max_model_len`: a specialist's is its engines' (the least, should they differ; None before
    one has answered a poll), the ensemble's the least of all, since a routed request may land on any."""
    cfg = router.config
    lens = {s.name: min((r.max_model_len for r in router.runtime.replicas.get(s.name, []) if r.max_model_len),
                        default=None) for s in cfg.specialists}
    known = [n for n in lens.values() if n]

    def card(model_id: str, parent: str | None, max_model_len: int | None) -> dict:
        return {"id": model_id, "object": "model", "created": router.created, "owned_by": "consort",
                "root": model_id, "parent": parent, "max_model_len": max_model_len}

    return [card(cfg.ensemble, None, min(known, default=None))] + [
        card(s.name, cfg.ensemble, lens[s.name]) for s in cfg.specialists]


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_cards(request.app[ROUTER])})


async def model_card(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    card = next((c for c in model_cards(request.app[ROUTER]) if c["id"] == model_id), None)
    if card is None:
        raise ApiError(404, "model_not_found", f"model {model_id!r} is not served here", param="model")
    return web.json_response(card)


async def tokenizer_call(request: web.Request) -> web.Response:
    """/tokenize and /detokenize, answered by one ready replica of the specialist `model` names."""
    router: Router = request.app[ROUTER]
    cfg = router.config
    obj = parse_json(await read_body(request, cfg.limits.max_body_bytes))
    specialist, adapter = tokenizer_lane(obj.get("model"), cfg)
    payload = json.dumps(upstream_body(obj, specialist, adapter)).encode()
    try:
        up = await open_upstream(router.session, router.runtime.replicas.get(specialist, []), request.path, payload,
                                 {"Content-Type": "application/json", TENANT_HEADER: request["tenant"]},
                                 upstream_timeout(cfg),
                                 cfg.polling.preempting_penalty)
    except NoReplica as e:
        rid = request["request_id"]
        log.warning("request %s: no ready replica of %s: %s", rid, specialist, e)
        raise ApiError(503, "no_ready_replica", f"no ready replica of {specialist} (request id {rid})",
                       retry_after_ms=1000)
    try:
        body = await up.response.read()
    finally:
        up.response.release()
        up.replica.inflight -= 1
    out = web.Response(body=body, status=up.response.status)
    copy_headers(up.response, out)
    out.headers["x-consort-specialist"] = specialist
    return out


async def version(request: web.Request) -> web.Response:
    try:
        v = importlib.metadata.version("consort")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree that is not installed
        v = "unknown"
    return web.json_response({"version": v})


async def metrics(request: web.Request) -> web.Response:
    body, ctype = request.app[ROUTER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": ctype})


def build_app(router: Router) -> web.Application:
    # the body limit is enforced in read_body (typed 413); aiohttp's own limit sits above it
    app = web.Application(middlewares=[middleware], client_max_size=1 << 30)
    app[ROUTER] = router
    app.on_response_prepare.append(stamp)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/feedback", feedback)
    app.router.add_get("/v1/routing", routing_view)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model_card)
    app.router.add_post("/tokenize", tokenizer_call)
    app.router.add_post("/detokenize", tokenizer_call)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


# ====================================================================== CLI


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, where there is one to show: a required flag has none, and an
    unset one (None, or an empty list) says in its help what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort router", description="Run the ensemble router.",
                                formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="RouterConfig YAML/JSON (reloaded when it changes)")
    p.add_argument("--port", type=int, required=True, help="port (0 = any free port, printed at start)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, store: BreakerStore | None = None) -> int:
    """Run until SIGINT/SIGTERM. `store` replaces the config's breaker store (e.g. EnsembleRouter status)."""
    config = RouterConfig.load(args.config)
    router = Router(config, config_path=args.config, store=store)
    app = build_app(router)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log if args.access_log else None,
                           shutdown_timeout=DRAIN_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError:   # port in use: close the upstream session first, so the cause stays the last line
        await runner.cleanup()
        raise
    port = runner.addresses[0][1] if runner.addresses else args.port
    print(f"consort router: ensemble {config.ensemble!r}, {len(config.specialists)} specialists; listening on "
          f"http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("consort router: shutting down", flush=True)
    await runner.cleanup()
    close = getattr(router.lanes.store, "close", None)   # stores that write in the background: flush, close
    if close is not None:
        close()
    return 0


def main(argv: list[str] | None = None, store: BreakerStore | None = None) -> int:
    """`consort router`. The breaker store: `store` when given (tests), else the EnsembleRouter's status
    when CONSORT_ENSEMBLE_ROUTER names one (router pods: kube_store.py), else the config's."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if store is None:
        from .kube_store import store_from_env

        try:
            store = store_from_env()
        except ValueError as e:
            print(f"consort router: fatal: {e}", file=sys.stderr, flush=True)
            return 2
        if store is not None:
            print(f"consort router: breaker state in {store.url}", flush=True)
    try:
        return asyncio.run(serve(args, store=store))
    except Exception as exc:  # noqa: BLE001 - any escape from serve() is fatal
        # Bad config, unreadable file, port in use, ...: exit non-zero at once with the cause as the
        # last line, so a supervisor (`consort up`, kubelet) shows why instead of a traceback.
        log.debug("start-up failed", exc_info=True)
        print(f"consort router: fatal: {one_line(exc, args.config)}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ValueError) else 1


def one_line(exc: BaseException, config_path: str) -> str:
    """A start-up exception as one line: a config that fails validation as `PATH: loc: msg; ...`."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return f"invalid config {config_path}: " + "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors())
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
