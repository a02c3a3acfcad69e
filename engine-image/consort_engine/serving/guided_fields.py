"""A request's one structured-output constraint (a GuidedSpec the grammar compiler takes), from
OpenAI's response_format, vLLM's guided_* extras or its structured_outputs object; bounded in size."""
from __future__ import annotations

import json
from typing import Any

from consort_engine.serving.errors import bad
from consort_engine.serving.limits import MAX_GUIDED_CHARS
from consort_engine.text.guided import GuidedSpec

GUIDED_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(v: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> compact JSON (the compile-cache key; key
    order kept: it is the order the properties are generated in)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise bad("invalid_value", f"'{param}' is not valid JSON", param) from None
    if not isinstance(v, dict):
        raise bad("invalid_type", f"'{param}' must be a JSON schema object", param)
    return json.dumps(v, separators=(",", ":"))


def _guided_of(kind: str, v: Any, param: str) -> GuidedSpec:
    """One vLLM-style constraint (json | regex | choice | grammar | json_object) -> GuidedSpec."""
    if kind == "json":
        return GuidedSpec("json_schema", _schema_text(v, param), param)
    if kind == "json_object":
        if v is not True:
            raise bad("invalid_value", f"'{param}' must be true", param)
        return GuidedSpec("json_object", "", param)
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise bad("invalid_type", f"'{param}' must be a non-empty list of non-empty strings", param)
        return GuidedSpec("choice", json.dumps(v, ensure_ascii=False), param)
    if not (isinstance(v, str) and v):
        raise bad("invalid_type", f"'{param}' must be a non-empty string", param)
    return GuidedSpec(kind, v, param)


def _response_format(v: Any) -> GuidedSpec | None:
    """OpenAI response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("invalid_type", "'response_format' must be an object with a 'type'", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    if kind != "json_schema":
        raise bad("invalid_value", f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                  "response_format.type")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise bad("missing_field", "'response_format.json_schema' is required for type json_schema",
                  "response_format.json_schema")
    if "schema" not in js:
        raise bad("missing_field", "'response_format.json_schema.schema' is required",
                  "response_format.json_schema.schema")
    return GuidedSpec("json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"),
                      "response_format.json_schema.schema")


def guided_spec(response_format: Any, extras: dict[str, Any], structured_outputs: Any) -> GuidedSpec | None:
    """The request's one output constraint; several at once is a 400 (which should win is not obvious).
    `extras`: the guided_* fields by name."""
    found: list[GuidedSpec] = []
    rf = _response_format(response_format)
    if rf is not None:
        found.append(rf)
    for key in GUIDED_EXTRAS:
        if extras.get(key) is not None:
            found.append(_guided_of(key.removeprefix("guided_"), extras[key], key))
    so = structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise bad("invalid_type", "'structured_outputs' must be an object", "structured_outputs")
        for key, v in so.items():
            if key not in STRUCTURED_KEYS:
                continue          # vLLM's other knobs (backend, whitespace_pattern, ...) do not apply here
            if v is not None and v is not False:
                found.append(_guided_of(key, v, f"structured_outputs.{key}"))
    if len(found) > 1:
        raise bad("invalid_value", "only one structured output constraint may be given, got "
                  + ", ".join(g.param for g in found), found[1].param)
    return bounded(found[0]) if found else None


def bounded(g: GuidedSpec) -> GuidedSpec:
    """A constraint small enough to compile (MAX_GUIDED_CHARS of schema, regex, grammar or choices)."""
    if len(g.spec) > MAX_GUIDED_CHARS:
        raise bad("invalid_value", f"'{g.param}' is {len(g.spec)} characters as text; at most {MAX_GUIDED_CHARS} "
                  "are compiled", g.param)
    return g
