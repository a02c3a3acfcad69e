"""CRD generator: pydantic models -> structural OpenAPI v3 CustomResourceDefinitions.

`consort crds` prints them (multi-document YAML); `crds/consort.dev.yaml` and the Helm chart's copy
are this output, checked in (a unit test proves they are equal).

Conversion rules (JSON Schema 2020-12 from pydantic -> Kubernetes structural schema):
  $ref/$defs inlined; titles dropped; `Optional[X]` (anyOf X|null) -> X, not required;
  `additionalProperties: false` dropped (unknown fields are pruned by the apiserver and rejected by
  strict field validation); numeric exclusiveMinimum/Maximum -> boolean form; defaults kept except null.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from . import router as router_api
from . import specialist as specialist_api
from .base import GROUP, VERSION, cel

_DROP = {"title", "$defs"}


def _deref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        name = node["$ref"].split("/")[-1]
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        node = {**copy.deepcopy(defs[name]), **siblings}
    return node


def structural(node: Any, defs: dict[str, Any]) -> Any:
    """Convert one pydantic JSON-schema node (recursively) into a structural OpenAPI v3 node."""
    if not isinstance(node, dict):
        return node
    node = _deref(node, defs)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union of {branches} structurally")
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**_deref(branches[0], defs), **outer}
        if node.get("default", 0) is None:
            del node["default"]
        return structural(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "additionalProperties":
            if value is False or value is True:
                continue  # false: strictness comes from pruning + strict field validation
            out[key] = structural(value, defs)
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "default" and value is None:
            continue
        else:
            out[key] = value
    if "properties" in out:
        out.setdefault("type", "object")
    if out.get("required") == []:
        del out["required"]
    return out


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _ordered(structural(raw, raw.get("$defs", {})))


DESCRIPTIONS = {
    "Specialist": "A specialist LLM served by Consort's paged-KV engine: the operator runs it as a GPU "
                  "Deployment with a Service and PodDisruptionBudget, gates it on warmup and tracks "
                  "adapter rollouts and breaker demotion in status.",
    "EnsembleRouter": "The front door of an ensemble of Specialists: the operator runs the router "
                      "Deployment, Service, routing ConfigMap and least-privilege RBAC.",
}

_ORDER = ["type", "description", "required", "properties", "items", "additionalProperties"]


def _ordered(node: Any) -> Any:
    """Stable, readable key order: type, description, ... then the rest alphabetically."""
    if isinstance(node, list):
        return [_ordered(v) for v in node]
    if not isinstance(node, dict):
        return node
    keys = [k for k in _ORDER if k in node] + sorted(k for k in node if k not in _ORDER)
    return {k: (_ordered(node[k]) if k != "properties" else {p: _ordered(v) for p, v in node[k].items()}) for k in keys}


def _strip_defaults(node: Any) -> Any:
    """Status carries no defaults: the apiserver would add fields the operator did not write, and
    the operator's 'did status change?' comparison would never settle."""
    if isinstance(node, list):
        return [_strip_defaults(v) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: _strip_defaults(v) for k, v in node.items() if k != "default"}


def _root(spec_model: type, status_model: type, kind: str, root_rules: list[dict] | None) -> dict[str, Any]:
    root: dict[str, Any] = {
        "type": "object",
        "description": DESCRIPTIONS[kind],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion: consort.dev/v1alpha1."},
            "kind": {"type": "string", "description": f"Kind: {kind}."},
            "metadata": {"type": "object"},
            "spec": {**model_schema(spec_model), "description": f"Desired state of the {kind}."},
            "status": {**_strip_defaults(model_schema(status_model)), "description": f"Observed state of the {kind}, written by the operator (and, for breaker state, the router)."},
        },
    }
    if root_rules:
        root["x-kubernetes-validations"] = root_rules
    return root


def _crd(kind: str, plural: str, singular: str, short: list[str], root: dict[str, Any],
         columns: list[dict[str, Any]], scale: dict[str, str] | None) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = scale
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "consort"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": singular, "shortNames": short,
                      "listKind": f"{kind}List", "categories": ["consort"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": subresources,
                "additionalPrinterColumns": columns,
            }],
        },
    }


def specialist_crd() -> dict[str, Any]:
    S = specialist_api
    root = _root(S.SpecialistSpec, S.SpecialistStatus, S.KIND, [
        cel("!has(self.spec.fallback) || self.spec.fallback != self.metadata.name",
            "spec.fallback must name another Specialist, not this one", field_path=".spec.fallback"),
    ])
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Warm replicas / desired replicas."},
        {"name": "Adapter", "type": "string", "jsonPath": ".status.activeAdapter", "description": "Active adapter."},
        {"name": "Breaker", "type": "string", "jsonPath": ".status.breaker.state", "description": "Circuit-breaker state."},
        {"name": "Block", "type": "integer", "jsonPath": ".spec.kv.blockSize", "priority": 1, "description": "KV block size."},
        {"name": "Speculative", "type": "string", "jsonPath": ".spec.speculative.mode", "priority": 1, "description": "Speculative decoding mode."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
             "labelSelectorPath": ".status.selector"}
    return _crd(S.KIND, S.PLURAL, S.SINGULAR, S.SHORT_NAMES, root, columns, scale)


def ensemble_router_crd() -> dict[str, Any]:
    R = router_api
    root = _root(R.EnsembleRouterSpec, R.EnsembleRouterStatus, R.KIND, None)
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready router replicas / desired."},
        {"name": "Specialists", "type": "integer", "jsonPath": ".status.specialists", "description": "Specialists in the ensemble."},
        {"name": "Ready-Specialists", "type": "integer", "jsonPath": ".status.readySpecialists", "description": "Specialists that are Ready."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd(R.KIND, R.PLURAL, R.SINGULAR, R.SHORT_NAMES, root, columns, None)


def all_crds() -> list[dict[str, Any]]:
    return [specialist_crd(), ensemble_router_crd()]


def peering_crds() -> list[dict[str, Any]]:
    """Kopf's peering resources (kopf.dev/v1): two operator replicas agree through them that only
    the one with the highest priority acts. Status maps each operator's identity to its liveness."""
    peer = {"type": "object", "description": "One operator replica: its priority and last keep-alive.",
            "properties": {"priority": {"type": "integer", "description": "Peering priority; the highest acts."},
                           "lastseen": {"type": "string", "description": "Last keep-alive (ISO 8601)."},
                           "lifetime": {"type": "integer", "description": "Seconds after lastseen the peer counts as dead."}}}
    schema = {"type": "object", "description": "Kopf peering object.",
              "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
                             "status": {"type": "object", "description": "Operator identity -> peer.", "additionalProperties": peer}}}
    out = []
    for kind, scope in (("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")):
        plural = kind.lower() + "s"
        out.append({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev", "labels": {"app.kubernetes.io/part-of": "consort"}},
            "spec": {"group": "kopf.dev", "scope": scope,
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": schema},
                                   "additionalPrinterColumns": [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]}]},
        })
    return out


HEADER = "# GENERATED by `consort crds` from operator/consort_operator/api (pydantic). Do not edit; run `make crds`.\n"
FILES = {"consort.dev.yaml": all_crds, "kopf.dev.yaml": peering_crds}


def render(which: str = "consort.dev.yaml") -> str:
    return HEADER + yaml.safe_dump_all(FILES[which](), sort_keys=False, width=120)


def _md_rows(node: dict[str, Any], path: str, required: bool, rows: list[str]) -> None:
    typ = node.get("type") or ("int-or-string" if node.get("x-kubernetes-int-or-string") else "")
    if typ == "array" and isinstance(node.get("items"), dict):
        typ = f"[]{node['items'].get('type', 'object')}"
    elif typ == "object" and isinstance(node.get("additionalProperties"), dict):
        typ = f"map[string]{node['additionalProperties'].get('type', 'object')}"
    checks = []
    if "enum" in node:
        checks.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "minimum" in node or "maximum" in node:
        checks.append(f"range [{node.get('minimum', '-inf')}, {node.get('maximum', 'inf')}]")
    if "pattern" in node and len(node["pattern"]) <= 60:
        checks.append(f"pattern `{node['pattern']}`")
    if "maxItems" in node:
        checks.append(f"at most {node['maxItems']} items")
    for rule in node.get("x-kubernetes-validations") or []:
        checks.append(f"CEL `{rule['rule']}`")
    default = node.get("default")
    default_s = "" if default is None else f"`{yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}`"
    desc = (node.get("description") or "").replace("|", "\\|").replace("\n", " ")
    check_s = "; ".join(checks).replace("|", "\\|")
    req_s = " (required)" if required else ""
    rows.append(f"| `{path}` | {typ}{req_s} | {default_s} | {check_s} | {desc} |")
    props = node.get("properties") or {}
    if not props and isinstance(node.get("items"), dict):
        props, path = node["items"].get("properties") or {}, path + "[]"
        req = set(node["items"].get("required") or [])
    else:
        req = set(node.get("required") or [])
    for name, sub in props.items():
        _md_rows(sub, f"{path}.{name}", name in req, rows)


def render_reference() -> str:
    """docs/crd-reference.md: every field of every Consort CRD, from the same schemas."""
    out = ["<!-- GENERATED by `consort crds --reference` from the pydantic models. Do not edit; run `make crds`. -->",
           "# CRD reference (consort.dev/v1alpha1)", "",
           "Both kinds are namespaced, have a `status` subresource and reject unknown fields "
           "(structural schema pruning plus `kubectl apply`'s strict field validation). "
           "`kubectl explain specialist.spec.kv` prints the same descriptions.", ""]
    for crd in all_crds():
        version = crd["spec"]["versions"][0]
        root = version["schema"]["openAPIV3Schema"]
        kind = crd["spec"]["names"]["kind"]
        out += [f"## {kind}", "", root.get("description", ""), "",
                f"Short names: {', '.join(crd['spec']['names'].get('shortNames', []))}; category `consort` "
                "(`kubectl get consort` lists both kinds).", ""]
        rules = [(r, "object") for r in root.get("x-kubernetes-validations") or []]
        rules += [(r, "spec") for r in root["properties"]["spec"].get("x-kubernetes-validations") or []]
        for rule, where in rules:
            out.append(f"- {where}-level rule: `{rule['rule']}` ({rule['message']}).")
        if rules:
            out.append("")
        out += ["Printer columns: " + ", ".join(f"{c['name']} (`{c['jsonPath']}`)" for c in version["additionalPrinterColumns"]), ""]
        for part in ("spec", "status"):
            rows = ["| field | type | default | validation | description |", "|---|---|---|---|---|"]
            for name, sub in root["properties"][part].get("properties", {}).items():
                _md_rows(sub, f".{part}.{name}", name in set(root["properties"][part].get("required") or []), rows)
            out += [f"### {kind} {part}", "", *rows, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from consort_common.help import HelpFormatter

    p = argparse.ArgumentParser(prog="consort crds", description="Print (or write) the CRDs generated from the pydantic models.",
                                formatter_class=HelpFormatter)
    p.add_argument("--out-dir", metavar="DIR",
                   help="write consort.dev.yaml and kopf.dev.yaml into this directory (created if missing) "
                        "instead of printing")
    p.add_argument("--reference", action="store_true", help="print the Markdown CRD reference instead")
    args = p.parse_args(argv or [])
    if args.reference:
        sys.stdout.write(render_reference())
        return 0
    if args.out_dir:
        from pathlib import Path

        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)   # an OSError here names the path: one line (consort_common.cli)
        for name in FILES:
            (out / name).write_text(render(name))
        return 0
    sys.stdout.write(render("consort.dev.yaml") + "---\n" + render("kopf.dev.yaml"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
