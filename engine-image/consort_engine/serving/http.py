"""HTTP plumbing every route shares: typed errors rendered as JSON, request ids, the credential and
error middlewares, response headers, and request bodies parsed (off the loop when large)."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import Any

from aiohttp import web

from consort_engine.serving.context import CTX, ServerContext
from consort_engine.serving.credential import needs_credential, presented
from consort_engine.serving.errors import ApiError, bad, server_error

log = logging.getLogger("consort.server")


def _json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers())


def request_id(request: web.Request) -> str:
    """This request's id (the client's x-request-id, else a new one), stamped on the response."""
    rid = request.get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex
    request["request_id"] = rid
    return rid


@web.middleware
async def credential_middleware(request: web.Request, handler):
    """With a credential configured, every route but the probes (and /metrics) needs it: a typed 401,
    which error_middleware (outside this one) renders."""
    ctx: ServerContext = request.app[CTX]
    if ctx.credentials and needs_credential(request.path, ctx.metrics_port) \
            and not presented(ctx.credentials, request.headers.get("Authorization")):
        raise ApiError(401, "invalid_credential", "this engine requires its credential (Authorization: "
                         "Bearer <engine credential>); clients reach it through the router",
                         type="authentication_error")
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        ctx: ServerContext = request.app[CTX]
        if err.status == 429:
            ctx.metrics.observe_rejected(request.get("consort_adapter"), err.code)
        else:
            ctx.metrics.observe_invalid(err.code)
        return _json_error(err)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status, "http_error")
            return _json_error(ApiError(exc.status, code, exc.reason))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a bug must never take the server down
        rid = request_id(request)
        log.exception("request %s: unhandled error on %s %s", rid, request.method, request.path)
        return _json_error(server_error(rid, "internal_error", "internal error"))


async def stamp_headers(request: web.Request, response: web.StreamResponse) -> None:
    ctx: ServerContext = request.app[CTX]
    h = response.headers
    h["x-request-id"] = request.get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex
    h["x-consort-specialist"] = ctx.config.name
    h["x-consort-adapter"] = request.get("consort_adapter") or "none"
    h["x-consort-speculation"] = ctx.speculation_state()
    if request.get("ignored_fields"):
        h["x-consort-ignored-fields"] = ",".join(request["ignored_fields"])


# A JSON escape of a UTF-16 surrogate: json.loads pairs valid ones, a lone one stays in the str
# and breaks the tokenizer (and UTF-8) later.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Bodies above this are parsed and tokenized on a worker thread so /health and streams keep flowing.
OFF_LOOP_BYTES = 64 * 1024


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("invalid_json", f"request body is not valid JSON: {e}")
    except RecursionError:      # nested deeper than the parser's stack (about a thousand levels)
        raise bad("invalid_json", "request body is nested too deeply") from None
    if SURROGATE_ESCAPE.search(raw) and has_lone_surrogate(body):
        raise bad("invalid_unicode", "request body contains a lone UTF-16 surrogate escape (such as "
                    "\\ud800): strings must be valid Unicode")
    return body


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string in the parsed body (keys included) is not valid Unicode. Each string is
    checked on its own: re-encoding the whole body at once would hold the GIL for ~100 ms per 10 MB."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    return await asyncio.to_thread(decode_json, raw) if len(raw) > OFF_LOOP_BYTES else decode_json(raw)
