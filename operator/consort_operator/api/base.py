"""Shared pydantic building blocks for the Consort CRDs.

Every model here is the ONE source of its CRD schema (see `crds.py`): field descriptions become the
OpenAPI descriptions that `kubectl explain` prints, `Literal`s become enums, `ge`/`le` become ranges,
`model_config["json_schema_extra"]` carries CEL rules (`x-kubernetes-validations`).
"""
from __future__ import annotations

import difflib
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "consort.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
DURATION = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"

# What a pattern means, for error messages (`explain`): a user who typed a bare path wants the
# accepted forms, not a 200-character regex. Modules with their own patterns add theirs.
PATTERN_HINTS: dict[str, str] = {
    DNS1123_LABEL: "a DNS label (lowercase letters, digits and '-', starting and ending with a letter or digit)",
    DNS1123_SUBDOMAIN: "a DNS subdomain (DNS labels joined by '.')",
    QUANTITY: "a Kubernetes quantity such as 500m, 2Gi or 4",
    DURATION: "a duration such as 500ms, 30s, 5m or 1h30m",
}

# A Kubernetes resource quantity ("16Gi", "500m", 4): int-or-string, like core/v1.
Quantity = Annotated[
    int | str,
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY,
    }),
]

SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_value(q: int | str) -> float:
    """The number a Kubernetes quantity stands for: "400m" -> 0.4, "2Gi" -> 2147483648.0, 4 -> 4.0."""
    text = str(q).strip()
    for suffix in sorted(SUFFIX, key=len, reverse=True):
        if text.endswith(suffix) and text[:-len(suffix)]:
            return float(text[:-len(suffix)]) * SUFFIX[suffix]
    return float(text)


DnsLabel = Annotated[str, Field(pattern=DNS1123_LABEL, min_length=1, max_length=63)]


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors (the CRD prunes and
    `kubectl apply --validate=strict` rejects them; pydantic refuses them too)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self, **kw: Any) -> dict[str, Any]:
        """The camelCase dict a manifest would carry (None fields dropped)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json", **kw)


def explain(error: ValidationError, model: type[BaseModel], root: str = "spec") -> str:
    """A pydantic error as one line in the manifest's own terms: each problem's path as a user writes
    it (`spec.adapters[0].source`), "did you mean" for a misspelt field, the accepted forms for a
    pattern. Several problems are joined by '; '."""
    problems = []
    for err in error.errors():
        path = root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(err["loc"][-1]), _fields_at(model, err["loc"][:-1]), n=1)
            problems.append(f"{path}: unknown field" + (f" (did you mean {close[0]}?)" if close else ""))
        elif err["type"] == "string_pattern_mismatch" and err["ctx"]["pattern"] in PATTERN_HINTS:
            problems.append(f"{path}: {err['input']!r} is not {PATTERN_HINTS[err['ctx']['pattern']]}")
        else:
            problems.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)


def _fields_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The wire names of the fields of the object at `loc` inside `model` ([] where that is no model)."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):   # a list index: the list's item model is already current
            continue
        fields = {f.alias or n: f for n, f in current.model_fields.items()}
        current = _model_in(fields[part].annotation) if part in fields else None
        if current is None:
            return []
    return [f.alias or n for n, f in current.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside Optional / list / Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, Any]:
    """One `x-kubernetes-validations` entry."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


# ---- small shared types ------------------------------------------------------------------------

class LocalObjectKeyRef(Model):
    name: DnsLabel = Field(description="Name of the object (Secret or ConfigMap) in the same namespace.")
    key: str = Field(description="Key inside the object's data.", min_length=1, max_length=253,
                     pattern=r"^[-._a-zA-Z0-9]+$")


class Toleration(Model):
    """core/v1 Toleration, spelled out so the schema stays structural and strict."""

    key: str | None = Field(default=None, description="Taint key the toleration applies to; empty matches all keys (with operator Exists).", max_length=316)
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Relation between key and value: Exists (any value) or Equal (default).")
    value: str | None = Field(default=None, description="Taint value the toleration matches when operator is Equal.", max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(default=None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(default=None, description="For NoExecute: how long the pod stays bound after the taint appears.", ge=0)


class LabelSelectorRequirement(Model):
    key: str = Field(description="Label key the selector applies to.", min_length=1, max_length=316)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="Relation of the key to the values.")
    values: list[str] | None = Field(default=None, description="Values for In/NotIn; must be empty for Exists/DoesNotExist.")


class LabelSelector(Model):
    match_labels: dict[str, str] | None = Field(default=None, description="Labels a Specialist must carry (ANDed).")
    match_expressions: list[LabelSelectorRequirement] | None = Field(default=None, description="Set-based requirements (ANDed).")

    def matches(self, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        for k, v in (self.match_labels or {}).items():
            if labels.get(k) != v:
                return False
        for req in self.match_expressions or []:
            have = req.key in labels
            vals = set(req.values or [])
            if req.operator == "In" and not (have and labels[req.key] in vals):
                return False
            if req.operator == "NotIn" and have and labels[req.key] in vals:
                return False
            if req.operator == "Exists" and not have:
                return False
            if req.operator == "DoesNotExist" and have:
                return False
        return True


class Condition(Model):
    """metav1.Condition."""

    type: str = Field(description="Condition type: Ready, Warm, AdapterRollout or Demoted (EnsembleRouter: Ready, ConfigValid).")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase machine-readable reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, description="metadata.generation the condition was computed from.")


def duration_seconds(text: str) -> float:
    """Parse a Go-style duration ("24h", "1h30m", "250ms", "90s") into seconds."""
    import re

    total = 0.0
    for num, unit in re.findall(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", text):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total
