"""Shadow dispatch: the shadow request, the comparison with the primary, and calibration records.

A shadow copy runs on the second-choice specialist at the lowest, droppable priority, is never
returned to the caller, and when its output disagrees with the primary's (different normalized text,
or different verifier verdicts) a JSONL calibration record is appended to `calibration_log`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp

from .api import upstream_body
from .config import ShadowConfig
from .metrics import RouterMetrics
from .proxy import TENANT_HEADER, answer_text
from .routing import RouteDecision
from .state import Runtime
from .verifier import VerifyResult

log = logging.getLogger("consort.router")
# (specialist, its answer's text) -> the verdict, fed to the specialist's lane; None: no verifier
Verify = Callable[[str, str], Awaitable[VerifyResult | None]]


def shadow_body(body: dict, target: str, cfg: ShadowConfig) -> dict:
    """The request the shadow specialist gets: same (first) prompt, one sample, not streamed, lowest
    priority. Only choice 0 is compared, so more samples or prompts would be work thrown away."""
    out = dict(body)
    out["model"] = target
    out["stream"] = False
    out.pop("stream_options", None)
    out["n"] = 1
    out.pop("best_of", None)
    if isinstance(out.get("prompt"), list) and out["prompt"] and all(isinstance(p, (str, list)) for p in out["prompt"]):
        out["prompt"] = out["prompt"][0]
    out["priority"] = cfg.priority
    if cfg.max_tokens is not None and "input" in out:   # /v1/responses spells it max_output_tokens
        mt = out.get("max_output_tokens")
        out["max_output_tokens"] = cfg.max_tokens if not isinstance(mt, int) else min(mt, cfg.max_tokens)
    elif cfg.max_tokens is not None:
        mt = out.get("max_tokens") or out.get("max_completion_tokens")
        capped = cfg.max_tokens if not isinstance(mt, int) else min(mt, cfg.max_tokens)
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = capped
    return out


def normalize(text: str) -> str:
    return " ".join(text.split())


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def disagree(primary: str, shadow: str, primary_pass: bool | None, shadow_pass: bool | None) -> bool:
    return normalize(primary) != normalize(shadow) or primary_pass != shadow_pass


@dataclass(frozen=True)
class CalibrationRecord:
    request_id: str
    intent: str
    reason: str
    confidence: float
    primary: str
    shadow: str
    primary_output: str
    shadow_output: str
    primary_verifier: dict | None
    shadow_verifier: dict | None

    def to_json(self, record_outputs: bool) -> str:
        def side(name: str, out: str, ver: dict | None) -> dict:
            d = {"specialist": name, "sha256": sha256(out), "chars": len(out), "verifier": ver}
            if record_outputs:
                d["output"] = out
            return d

        return json.dumps({
            "ts": time.time(), "request_id": self.request_id, "intent": self.intent, "reason": self.reason,
            "confidence": round(self.confidence, 6), "agree": False,
            "primary": side(self.primary, self.primary_output, self.primary_verifier),
            "shadow": side(self.shadow, self.shadow_output, self.shadow_verifier),
        }, sort_keys=True)


class CalibrationLog:
    """Appends one JSON line per record; safe to call from several tasks (a lock around each write)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        if self.path is None:
            return
        with self._lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")


class Shadows:
    """The shadow copies in flight and the log their disagreements go to."""

    def __init__(self, calibration: CalibrationLog) -> None:
        self.calibration = calibration
        self.inflight = 0

    async def run(self, session: aiohttp.ClientSession, rt: Runtime, d: RouteDecision, obj: dict, path: str,
                  rid: str, primary: asyncio.Future, tenant: str, verify: Verify, metrics: RouterMetrics) -> None:
        """Send the shadow copy of request `obj` to d.shadow, wait for it and for the primary's text
        (`primary`, cancelled when the primary failed) within shadow.timeout_s, verify both and record a
        disagreement. Never raises to the caller but a cancellation."""
        cfg = rt.config
        target = d.shadow
        assert target is not None
        outcome = "dropped"
        self.inflight += 1
        try:
            body = shadow_body(upstream_body(obj, target, cfg.specialist(target).adapter), target, cfg.shadow)
            lim = cfg.limits
            shadow_task = asyncio.ensure_future(answer_text(
                session, rt.replicas.get(target, []), path, body,
                {"Content-Type": "application/json", "x-request-id": f"{rid}-shadow", TENANT_HEADER: tenant},
                aiohttp.ClientTimeout(total=cfg.shadow.timeout_s, sock_connect=lim.connect_timeout_s),
                cfg.polling.preempting_penalty))
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
            pv, sv = await asyncio.gather(verify(d.specialist, primary_text), verify(target, shadow_text))
            if disagree(primary_text, shadow_text, pv.passed if pv else None, sv.passed if sv else None):
                outcome = "disagree"
                rec = CalibrationRecord(rid, d.intent, d.shadow_reason, d.confidence, d.specialist, target,
                                        primary_text, shadow_text, pv.to_dict() if pv else None,
                                        sv.to_dict() if sv else None)
                await asyncio.to_thread(self.calibration.write, rec.to_json(cfg.shadow.record_outputs))
                metrics.calibration.labels(d.specialist, target).inc()
            else:
                outcome = "agree"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:  # noqa: BLE001 - a shadow never hurts the caller
            log.exception("shadow %s for %s failed", target, rid)
            outcome = "error"
        finally:
            self.inflight -= 1
            metrics.shadows.labels(target, d.shadow_reason, outcome).inc()
