"""The CRDs are generated from the pydantic models, checked in, structural and self-describing."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from consort_operator.api import crds
from consort_operator.api.router import EnsembleRouterSpec
from consort_operator.api.specialist import SpecialistSpec

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("folder", ["crds", "charts/consort/crds"])
def test_checked_in_crds_equal_generator_output(folder):
    present = sorted(p.name for p in (REPO / folder).glob("*.yaml"))
    assert present == sorted(crds.FILES), f"{folder}: unexpected files {present}"
    for name in crds.FILES:
        assert (REPO / folder / name).read_text() == crds.render(name), f"{folder}/{name} is stale: run `make crds`"


def test_crd_reference_doc_is_generated():
    assert (REPO / "docs" / "crd-reference.md").read_text() == crds.render_reference(), "run `make crds`"


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for name, sub in (node.get("properties") or {}).items():
            yield from _walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("crd", crds.all_crds(), ids=lambda c: c["spec"]["names"]["kind"])
def test_schema_is_structural_and_described(crd):
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "anyOf" not in node and "oneOf" not in node, path
            assert "type" in node, f"{path} has no type"
        if path.count(".") >= 2 and not path.endswith(("[]", "{}")):   # every field below spec/status
            assert node.get("description"), f"{path} has no description (kubectl explain)"
        assert node.get("additionalProperties") is not False, path
        # Only the router-written breaker blob may keep unknown fields.
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert path == "$.status.breakerState", path
    assert "default" not in yaml.safe_dump(root["properties"]["status"])


def test_specialist_crd_rules_columns_and_subresources():
    crd = crds.specialist_crd()
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    rules = [r["rule"] for r in root["x-kubernetes-validations"]]
    assert "!has(self.spec.fallback) || self.spec.fallback != self.metadata.name" in rules
    spec = root["properties"]["spec"]
    spec_rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert ("!has(self.minReady) || !has(self.replicas) || self.minReady <= self.replicas"
            " || (self.replicas == 0 && has(self.scaleToZero))") in spec_rules
    assert "duration(self.idleAfter) >= duration('5s')" in [
        r["rule"] for r in spec["properties"]["scaleToZero"]["x-kubernetes-validations"]]
    assert spec["properties"]["kv"]["properties"]["blockSize"]["enum"] == [8, 16, 32, 256]
    assert spec["properties"]["speculative"]["properties"]["mode"]["enum"] == ["off", "ngram", "mtp"]
    assert spec["properties"]["replicas"]["minimum"] == 0
    assert spec["properties"]["adapters"]["x-kubernetes-list-type"] == "map"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Phase"] == ".status.phase" and cols["Ready"] == ".status.ready"
    assert cols["Adapter"] == ".status.activeAdapter" and cols["Breaker"] == ".status.breaker.state"
    assert cols["Age"] == ".metadata.creationTimestamp"


def test_auth_takes_a_secret_reference_never_inline_keys():
    auth = crds.ensemble_router_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["auth"]
    assert set(auth["properties"]) == {"enabled", "apiKeysSecretRef", "protectMetrics", "protectRouting"}
    assert auth["properties"]["enabled"]["default"] is True     # keys on unless turned off
    assert set(auth["properties"]["apiKeysSecretRef"]["properties"]) == {"name", "key"}


MINIMAL = {"model": {"source": "pvc://models/algo"}}


def test_pydantic_models_accept_a_minimal_spec_with_defaults():
    s = SpecialistSpec.model_validate(MINIMAL)
    assert s.kv.block_size is None and s.replicas == 1 and s.min_ready == 1 and s.speculative.mode == "off"
    assert s.slo.window_seconds == 86400 and s.rollout.probation_window_seconds == 3600
    assert EnsembleRouterSpec.model_validate({}).replicas == 2


@pytest.mark.parametrize("bad", [
    {**MINIMAL, "kv": {"blockSize": 12}},
    {**MINIMAL, "replicas": -1},
    {**MINIMAL, "speculative": {"mode": "eagle"}},
    {**MINIMAL, "unknownField": 1},
    {"model": {"source": "s3://bucket/x"}},
    {**MINIMAL, "slo": {"window": "one day"}},
    {**MINIMAL, "fallback": "Not_A_Name"},
])
def test_pydantic_models_reject_what_the_crd_rejects(bad):
    with pytest.raises(ValidationError):
        SpecialistSpec.model_validate(bad)


def test_camel_case_round_trip():
    s = SpecialistSpec.model_validate({**MINIMAL, "kv": {"blockSize": 8, "numBlocks": 4096}, "warmupTimeoutSeconds": 120})
    wire = s.wire()
    assert wire["kv"]["blockSize"] == 8 and wire["kv"]["numBlocks"] == 4096 and wire["warmupTimeoutSeconds"] == 120
    assert SpecialistSpec.model_validate(wire) == s
