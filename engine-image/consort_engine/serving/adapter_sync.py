"""The engine keeps its loaded LoRA adapters equal to a desired list in a file: the Specialist's
adapters ConfigMap, mounted into the pod. An adapter rotation is then a hot-load on every replica
(new and old alike: a new pod reads the same file at start), never a pod restart, and works
whatever the operator can or cannot dial.

The file is JSON: `{"adapters": [{"name": ..., "path": ..., "source": ...}]}`. `path` is where the
adapter lives in the pod; a `demo://lora?seed=N` source is written there on first use (demo models
only); any other source must already be there (a mounted volume).

`plan_adapters` is pure; `AdapterSync` is the thin loop that reads the file, plans and applies.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

log = logging.getLogger("consort.engine.adapters")

POLL_SECONDS = 2.0


class AdapterFileError(ValueError):
    """The desired-adapters file is not what the operator writes."""


@dataclass(frozen=True)
class DesiredAdapter:
    name: str
    path: str
    source: str = ""


def read_desired(path: str | Path) -> dict[str, DesiredAdapter]:
    """The desired adapters in `path`, or AdapterFileError (missing, not JSON, wrong shape)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AdapterFileError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterFileError(f"{path}: {e}") from None
    items = raw.get("adapters") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise AdapterFileError(f'{path}: expected {{"adapters": [...]}}')
    out: dict[str, DesiredAdapter] = {}
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str)):
            raise AdapterFileError(f"{path}: adapters[{i}] needs string name and path")
        out[item["name"]] = DesiredAdapter(item["name"], item["path"], str(item.get("source") or ""))
    return out


@dataclass(frozen=True)
class AdapterPlan:
    unload: list[str]                   # first: frees a slot under max_adapters
    load: list[DesiredAdapter]

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def plan_adapters(desired: dict[str, DesiredAdapter], loaded: dict[str, str],
                  failed: dict[str, DesiredAdapter]) -> AdapterPlan:
    """What to change so `loaded` (name -> path) matches `desired`. An adapter whose path changed is
    unloaded, then loaded from the new path. One that failed to load is not retried until its entry
    in the file changes (a broken adapter must not be re-read every poll)."""
    unload = sorted(n for n, p in loaded.items() if n not in desired or desired[n].path != p)
    load = [d for n, d in sorted(desired.items())
            if (n not in loaded or n in unload) and failed.get(n) != d]
    return AdapterPlan(unload, load)


def materialize(adapter: DesiredAdapter, model_dir: str) -> None:
    """Write a demo adapter where the file says it lives, the first time it is asked for."""
    if adapter.source.startswith("demo://lora") and not (Path(adapter.path) / "adapter_config.json").exists():
        from consort_engine.demo_model import write_demo_adapter
        query = adapter.source.partition("?")[2]
        seed = int(query.split("=", 1)[1]) if query.startswith("seed=") else 0
        write_demo_adapter(model_dir, adapter.path, seed=seed)


@dataclass
class AdapterSync:
    """Polls the desired-adapters file and hot-loads / unloads through `call` (which runs a function
    on the engine thread between steps). Errors are kept per adapter for /v1/status."""

    path: str
    model_dir: str
    call: Callable[[Callable], Awaitable]
    failed: dict[str, DesiredAdapter] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)       # name -> last load/unload error
    desired: dict[str, DesiredAdapter] = field(default_factory=dict)
    startup: frozenset[str] = frozenset()      # desired when the engine started: /ready waits for them

    def initial(self) -> None:
        """Read the file at start (a missing or broken one is no adapters, as a ConfigMap not yet
        written is) and write any demo adapters, before the model loads. The engine loads them as
        soon as it is warm, and /ready waits for those (`startup`) unless they fail: a broken adapter
        is reported in /v1/status, it neither crashes the pod nor keeps it out of rotation."""
        try:
            self.desired = read_desired(self.path)
        except AdapterFileError as e:
            log.warning("adapters file: %s; starting without adapters", e)
        self.startup = frozenset(self.desired)
        for d in self.desired.values():
            try:
                materialize(d, self.model_dir)
            except Exception as e:  # noqa: BLE001 - reported when its load fails
                log.warning("adapter %s: cannot write %s: %s", d.name, d.path, e)

    async def run(self, loaded: Callable[[], dict[str, str] | None], stop: asyncio.Event,
                  interval: float = POLL_SECONDS) -> None:
        """Until `stop`: every `interval`, match the file (once the engine is ready: `loaded` is None before)."""
        while not stop.is_set():
            try:
                paths = loaded()
                if paths is not None:
                    await self.sync_once(paths)
            except Exception:  # noqa: BLE001 - a sync bug must not stop serving
                log.exception("adapter sync failed")
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def sync_once(self, loaded: dict[str, str]) -> AdapterPlan:
        try:
            self.desired = read_desired(self.path)
        except AdapterFileError as e:
            log.warning("adapters file: %s; keeping the loaded adapters", e)
            return AdapterPlan([], [])
        for name in [n for n, d in self.failed.items() if self.desired.get(n) != d]:
            del self.failed[name]           # its entry changed: try again
            self.errors.pop(name, None)
        plan = plan_adapters(self.desired, loaded, self.failed)
        blocked: set[str] = set()
        for name in plan.unload:
            try:
                await self.call(lambda engine, n=name: engine.unload_adapter(n))
                log.info("adapter %s unloaded", name)
                self.errors.pop(name, None)
            except Exception as e:  # noqa: BLE001 - in use: retried on the next poll
                self.errors[name] = str(e)
                blocked.add(name)
        for d in plan.load:
            if d.name in blocked:
                continue
            try:
                await asyncio.to_thread(materialize, d, self.model_dir)
                await self.call(lambda engine, d=d: engine.load_adapter(d.name, d.path))
                log.info("adapter %s hot-loaded from %s", d.name, d.path)
                self.errors.pop(d.name, None)
            except Exception as e:  # noqa: BLE001 - reported in /v1/status; retried when its entry changes
                log.warning("adapter %s failed to load from %s: %s", d.name, d.path, e)
                self.failed[d.name] = d
                self.errors[d.name] = str(e)
        return plan

    def states(self, loaded: dict[str, str]) -> dict[str, str]:
        """name -> loaded | pending | failed, for every desired or loaded adapter."""
        out = {n: "loaded" for n in loaded}
        for n, d in self.desired.items():
            if loaded.get(n) != d.path:
                out[n] = "failed" if n in self.failed else "pending"
        return out
