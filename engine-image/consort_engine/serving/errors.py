"""The typed errors every route answers with: OpenAI's error shape ({"error": {message, type, param,
code}}) and an HTTP status; 429s carry Retry-After. A 5xx names the request id, never the cause."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("consort.server")


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    retry_after_ms: int | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        err: dict[str, Any] = {"type": self.type, "code": self.code, "message": self.message, "param": self.param}
        if self.retry_after_ms is not None:
            err["retry_after_ms"] = self.retry_after_ms
        return {"error": err}

    def headers(self) -> dict[str, str]:
        if self.retry_after_ms is None:
            return {}
        return {"Retry-After": str(retry_after_seconds(self.retry_after_ms))}


def retry_after_seconds(retry_after_ms: int) -> int:
    return max(1, math.ceil(retry_after_ms / 1000))


def bad(code: str, message: str, param: str | None = None, status: int = 400) -> ApiError:
    """A client error (400 unless told) naming the field at fault."""
    return ApiError(status, code, message, param)


def admission_error(code: str, retry_after_ms: float, message: str) -> ApiError:
    ms = max(1, int(math.ceil(retry_after_ms)))
    return ApiError(429, code, message or f"admission rejected: {code}", type="admission_rejected", retry_after_ms=ms)


def not_ready(message: str) -> ApiError:
    """A 503 with Retry-After for a route that is not a generation request (adapters, block events)
    while the engine loads: not an admission decision, so not counted as one."""
    return ApiError(503, "not_ready", message, type="server_error", retry_after_ms=1000)


def server_error(rid: str, code: str, what: str, cause: BaseException | None = None, status: int = 500) -> ApiError:
    """A 5xx that names the request id, not the cause: exception text can carry paths, shapes or another
    request's data. The cause is logged under the same id."""
    if cause is not None:
        log.error("request %s: %s: %s", rid, what, cause)
    return ApiError(status, code, f"{what} (request id {rid}; the cause is in the server log)", type="server_error")
