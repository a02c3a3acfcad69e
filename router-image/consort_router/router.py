"""Router: one router process's state (runtime, lanes, tenants, prefix index, shadows in flight,
upstream session) and its background work (housekeeping, config reload, discovery). A request's
dispatch lives beside it: plan.py plans, proxy.py fails over and relays, shadow.py runs the shadow;
server.py's handlers hand them the parts of this state they touch.

Embedding (the operator, tests): `Router(config, config_path=..., store=...)` then
`server.build_app(router)`. A custom `BreakerStore` (e.g. one backed by EnsembleRouter status)
replaces the FileStore."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
from aiohttp import web

from .activator import Activator
from .affinity import Affinity, PrefixIndex, precise_affinity, request_affinity
from .api import ParsedRequest
from .auth import EngineCredential, KeyRing
from .breaker import STATE_CODES, BreakerStore, FileStore, MemoryStore
from .config import RouterConfig
from .detectors import PatternSandbox
from .kv_index import KVSubscriber
from .metrics import RouterMetrics
from .lane_tokenizers import LaneTokenizers
from .prompt_tokens import off_loop, prompt_ids
from .replicas import ReplicaPoller, ReplicaState
from .shadow import CalibrationLog, Shadows
from .state import Lanes, Runtime, build_runtime
from .verifier import Verifier, VerifyResult
from .wake import waker
from . import admission as adm
from . import tenants as tn

log = logging.getLogger("consort.router")

# On SIGTERM the listener closes and the requests in flight (streams included) get this long to
# finish; the pod's grace period (operator resources/router.py) leaves room for it after preStop.
DRAIN_S = 45


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
        self.shadows = Shadows(CalibrationLog(self._path(config.calibration_log)))
        self.session: aiohttp.ClientSession | None = None
        self.poller: ReplicaPoller | None = None
        self.created = int(time.time())   # the model cards' `created`, as vLLM stamps its start
        self.prefixes = PrefixIndex(config.replica_choice.index_blocks)
        self.kv: KVSubscriber | None = None
        self.tokenizers = LaneTokenizers()
        self.waker = waker(lambda: self.config, self.base_dir)
        self.activator = Activator(self.waker, lambda lane: any(r.ready for r in self.replicas_now(lane)), self.metrics)
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

    def replica_ready(self, url: str) -> bool:
        """Whether the replica at `url` answers /ready as warm (the poller's last look)."""
        return any(r.ready for reps in self.runtime.replicas.values() for r in reps if r.url == url)

    def replicas_now(self, lane: str) -> list[ReplicaState]:
        """The lane's replicas in the current runtime (discovery swaps the runtime)."""
        return self.runtime.replicas.get(lane, [])

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
        rc = self.config.replica_choice
        self.kv = KVSubscriber(self.session, rc.kv_events_interval_s, p.timeout_s, rc.kv_max_hashes,
                               metrics=self.metrics, is_ready=self.replica_ready, wait_s=rc.kv_events_wait_s)
        self.track_kv()
        self.kv.start()
        self._bg.append(asyncio.create_task(self.housekeeping(), name="router-housekeeping"))
        if any(s.service is not None for s in self.config.specialists):
            from .discovery import discovery_loop

            self._bg.append(asyncio.create_task(discovery_loop(lambda: self.config, self.replace_discovered,
                                                               self.metrics), name="router-discovery"))

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
        if self.kv:
            await self.kv.stop()
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
        self.track_kv()

    def track_kv(self) -> None:
        """Follow the block events of every replica (prefix-affine with kv_events on), and load the tokenizer
        directories the lanes name (lane_tokenizers.py)."""
        rc = self.config.replica_choice
        if self.kv is not None:
            on = rc.policy == "prefix-affine" and rc.kv_events
            self.kv.track({r.url for reps in self.runtime.replicas.values() for r in reps} if on else set())
        for s in self.config.specialists:
            if s.tokenizer is not None:
                self.tokenizers.load_dir(s.name, self._path(s.tokenizer))

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
        self.shadows.calibration = CalibrationLog(self._path(new.calibration_log))
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

    async def affinity(self, cfg: RouterConfig, req: ParsedRequest, target: str, adapter: object,
                       tenant: str, body: dict | None = None) -> Affinity | None:
        """The prompt's prefix blocks on lane `target` and how deep each replica holds them (affinity.py):
        the engines' own block hashes scored from their block events when the lane's replicas publish
        them and the router knows the prompt's token ids exactly; else the character-hash guess."""
        rc = cfg.replica_choice
        if rc.policy == "prefix-affine" and rc.kv_events and self.kv is not None:
            # precise only while every ready replica is followed (one whose events are not known yet,
            # or an engine without the route, would look empty) and they cut blocks alike
            ready = [r for r in self.replicas_now(target) if r.ready]
            views = {r.url: v for r in ready if (v := self.kv.blocks.get(r.url)) is not None and v.epoch}
            sizes = {r.block_size for r in ready}
            spec = cfg.specialist(target)
            if views and len(views) == len(ready) and len(sizes) == 1 and None not in sizes and spec is not None:
                tokenizer = self.tokenizers.get(target, self._path(spec.tokenizer), [r.url for r in ready],
                                                self.session, self.spawn)
                body = body if body is not None else req.body
                block_size = sizes.pop()
                args = (tokenizer, body, rc.max_blocks * block_size, block_size)
                # the tokenizers library lets go of the GIL: a long prompt's head is cut, and a long chat
                # rendered, on a worker thread
                ids = await asyncio.to_thread(prompt_ids, *args) if off_loop(tokenizer, body, req.text) else prompt_ids(*args)
                if ids is not None:
                    return precise_affinity(rc, views, block_size, ids, body, target, adapter, tenant)
        return request_affinity(rc, self.prefixes, req.body, req.text, target, adapter, tenant)

    # ------------------------------------------------------------------ discovery
    async def replace_discovered(self, urls: dict[str, list[str]]) -> None:
        """Discovery's answer: each Service-backed lane's replica URLs now. Swapped into the runtime,
        and every replica probed before the next request picks one."""
        self.lanes.discovered.update(urls)
        rt = self.runtime
        reps = dict(rt.replicas)
        for s in rt.config.specialists:
            if s.service is not None:
                reps[s.name] = [self.lanes.replica(s.name, u) for u in self.lanes.discovered.get(s.name, [])]
        self.swap_runtime(replace(rt, replicas=reps))
        if self.poller:
            await self.poller.poll_all()
