"""Shadow dispatch helpers: the shadow request body, output extraction, and calibration records.

A shadow copy runs on the second-choice specialist at the lowest, droppable priority, is never
returned to the caller, and when its output disagrees with the primary's (different normalized text,
or different verifier verdicts) a JSONL calibration record is appended to `calibration_log`.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass

from .config import ShadowConfig


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


def text_of_response(body: object) -> str:
    """The first choice's text of a non-streamed completion or chat completion (or a Response's)."""
    if not isinstance(body, dict):
        return ""
    if body.get("object") == "response":
        return "".join(p.get("text", "") for item in body.get("output") or () if isinstance(item, dict)
                       for p in item.get("content") or () if isinstance(p, dict) and isinstance(p.get("text"), str))
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if isinstance(c.get("text"), str):
        return c["text"]
    msg = c.get("message")
    if isinstance(msg, dict) and isinstance(msg.get("content"), str):
        return msg["content"]
    return ""


def text_of_sse(raw: bytes) -> str:
    """Concatenated first-choice text of an SSE stream (completions `text` or chat `delta.content`)."""
    parts = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if obj.get("type") == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            parts.append(obj["delta"])   # a /v1/responses stream
        for c in obj.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            if isinstance(c.get("text"), str):
                parts.append(c["text"])
            delta = c.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                parts.append(delta["content"])
    return "".join(parts)


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
