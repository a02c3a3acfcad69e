"""The ensemble's OpenAI-compatible front door (aiohttp).

The HTTP handlers and the app. Handlers are thin: api.py parses, plan.py plans a request (routing.py
decides the specialist), proxy.py sends it (failover over the plan's targets; replicas.py picks the
replica) and relays the answer, shadow.py and verifier.py produce correctness samples off the hot
path; router.py (Router) holds the process's state, state.py the lanes'; cli.py is the command line.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import random
import secrets
import time
import uuid

from aiohttp import web

from .api import ApiError, parse_json, parse_request, tokenizer_lane, upstream_body
from .auth import ANONYMOUS
from .breaker import is_fresh
from .plan import PlanInput, plan_request
from .proxy import (TENANT_HEADER, NoReplica, copy_headers, error_code, open_plan, open_upstream, relay_stream,
                    text_of_response, text_of_sse, upstream_timeout)
from .router import Router
from . import admission as adm
from . import tenants as tn

log = logging.getLogger("consort.router")

ROUTER = web.AppKey("consort_router", Router)
OPEN_PATHS = frozenset({"/health", "/ready", "/version"})
GEN_HEADERS = ("x-consort-specialist", "x-consort-shadow", "x-consort-adapter", "x-consort-admission",
               "x-consort-breaker")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
FEEDBACK_HEADER = "x-consort-feedback-id"  # issued on each answered request; /v1/feedback takes it once


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
    raw = await read_body(request, cfg.limits.max_body_bytes)
    req = parse_request(parse_json(raw), kind, request.headers.get("x-consort-intent"),
                        tn.policy(cfg.tenants, tenant).max_priority)
    tn.charge(cfg.tenants, router.buckets, tenant, req.body, req.text, time.monotonic())
    user_counts = None
    if rt.table.user_patterns is not None and rt.table.consults_detectors(req.model, req.intent):
        user_counts = await router.patterns.counts(rt.table.user_patterns, req.text,
                                                   tuple(d.min_matches for d in rt.table.detectors))
    plan = plan_request(cfg, rt.table, req, PlanInput(
        router.lanes.lane_views(rt), router.lanes.floors, router.shadows.inflight < cfg.shadow.max_inflight,
        router.verifier.available, random.random(), random.random(), user_counts))
    d = plan.decision
    router.metrics.routing_seconds.observe(time.monotonic() - t0)
    request["stamp"] = plan.headers(d.specialist)
    if plan.rejection is not None:
        raise plan.rejection
    primary_done: asyncio.Future | None = None
    if plan.shadow is not None:
        primary_done = asyncio.get_running_loop().create_future()
        router.spawn(router.shadows.run(router.session, rt, d, req.body, path, rid, primary_done, tenant,
                                        router.verify_and_feed, router.metrics))
    elif d.shadow is not None:
        router.metrics.shadows.labels(d.shadow, d.shadow_reason, "dropped").inc()

    served, text, status = d.specialist, None, 0
    request["feedback_id"] = feedback_id = secrets.token_urlsafe(16)   # sent only with a 200 (stamp)
    pre_upstream = time.monotonic() - t0
    try:
        try:
            served, up = await open_plan(router.session, rt, plan, req, path, rid, tenant, router.lanes,
                                         router.metrics, router.prefixes, router.activator, router.replicas_now,
                                         router.affinity)
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
                        router.lanes.observe(served, 0.0)
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
    # A lane scaled to zero serves too: its requests are held while the router starts a replica. A
    # router whose lanes are all at zero must stay in its Service, or no request could wake them.
    from_zero = sorted(s.name for s in router.runtime.config.specialists
                       if s.scale_from_zero is not None and s.name not in routable)
    if routable or from_zero:
        return web.json_response({"status": "ready", "routable": routable, "from_zero": from_zero})
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
                   "inflight": router.shadows.inflight},
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


