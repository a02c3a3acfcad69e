"""Published objectives, observed: the engines judge every finished request against the
Specialist's `spec.slo` targets (p95 TTFT and ITL, passed as `--slo-ttft-ms/--slo-itl-ms`) and
report attainment over their recent requests in /v1/status. This pure function pools the warm
replicas' reports into `status.slo` and the `SLOMet` condition, with an Event per transition.

Targets are p95: an objective is met while at least 95% of the judged requests meet it. Fewer
than MIN_REQUESTS judged requests is too little evidence either way (condition Unknown).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from ..api.specialist import SpecialistSpec
from .common import Event, get_condition, set_condition

QUANTILE = 0.95
MIN_REQUESTS = 20
OBJECTIVES = (("ttft", "ttftMs", "TTFT"), ("itl", "itlMs", "ITL"))


def pool(spec: SpecialistSpec, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Replica reports ({"ttft": {"requests", "attainment", ...}, ...}) -> status.slo, weighted by
    each replica's judged requests. Only reports made against the spec's current targets count:
    a replica still running an older target is not evidence about the new one."""
    out: dict[str, Any] = {}
    targets = {"ttft": spec.slo.ttft_ms, "itl": spec.slo.itl_ms}
    for key, _, _ in OBJECTIVES:
        requests, attained = 0, 0.0
        for rep in reports:
            obj = rep.get(key) or {}
            n = int(obj.get("requests") or 0)
            if n and obj.get("target_ms") == targets[key] and obj.get("attainment") is not None:
                requests += n
                attained += float(obj["attainment"]) * n
        entry: dict[str, Any] = {"targetMs": targets[key], "requests": requests}
        if requests:
            entry["attainment"] = round(attained / requests, 4)
        out[key] = entry
    return out


def evaluate(spec: SpecialistSpec, reports: list[dict[str, Any]], conditions: list[dict[str, Any]] | None,
             now: datetime, generation: int | None) -> tuple[dict[str, Any], list[dict[str, Any]], list[Event]]:
    slo = pool(spec, reports)
    judged = {key: slo[key] for key, _, _ in OBJECTIVES if slo[key]["requests"] >= MIN_REQUESTS}
    missed = [(label, slo[key]) for key, _, label in OBJECTIVES
              if key in judged and slo[key]["attainment"] < QUANTILE]
    if missed:
        status, reason = False, "".join(label for label, _ in missed) + "Missed"
        message = "; ".join(f"{label} p95 target {o['targetMs']} ms met by {o['attainment']:.1%} of "
                            f"{o['requests']} recent requests" for label, o in missed)
    elif len(judged) == len(OBJECTIVES):
        status, reason = True, "ObjectivesMet"
        message = "; ".join(f"{label} {slo[key]['attainment']:.1%} within {slo[key]['targetMs']} ms"
                            for key, _, label in OBJECTIVES)
    else:
        status, reason = None, "NotEnoughRequests"
        message = (f"fewer than {MIN_REQUESTS} judged requests on the warm replicas "
                   f"(TTFT {slo['ttft']['requests']}, ITL {slo['itl']['requests']})")
    before = get_condition(conditions, "SLOMet")
    events: list[Event] = []
    was = None if before is None else before.get("status")
    if status is False and was != "False":
        events.append(Event("Warning", "SLOMissed", message))
    elif status is True and was == "False":
        events.append(Event("Normal", "SLOMet", message))
    return slo, set_condition(conditions, "SLOMet", status, reason, message, now, generation), events
