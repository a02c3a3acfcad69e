"""spec.model.quantization: the engine container gets `--quantization`, the real engine CLI accepts it,
and a quantization the replica's device cannot run is refused (pydantic here, the same rule in CEL)."""
from __future__ import annotations

import pytest

from consort_operator.api.specialist import QUANTIZATION_RULE, SpecialistSpec
from consort_operator.api.crds import specialist_crd
from consort_operator.resources import specialist as S
from consort_operator.resources.common import BuildContext

CTX = BuildContext(engine_image="engine:test", router_image="router:test", operator_namespace="consort-system")


def spec(quantization: str | None, gpus: int) -> SpecialistSpec:
    model = {"source": "pvc://models/algo", **({} if quantization is None else {"quantization": quantization})}
    return SpecialistSpec.model_validate({"model": model, "resources": {"gpus": gpus}})


def engine_argv(s: SpecialistSpec) -> list[str]:
    return S.engine_deployment("algo", "ns", "u", s, CTX)["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("quantization,gpus", [(None, 0), ("none", 1), ("int8", 0), ("w8a8", 0), ("fp8", 1),
                                               ("auto", 0), ("awq", 0), ("gptq", 1), ("compressed-tensors", 0)])
def test_quantization_reaches_the_engine_flags(quantization, gpus):
    from consort_engine.serving.cli import config_from_args, parse_args

    argv = engine_argv(spec(quantization, gpus))
    assert ("--quantization" in argv) == (quantization not in (None, "none"))
    assert config_from_args(parse_args(argv)).quantization == (quantization or "none")


@pytest.mark.parametrize("quantization,gpus", [("fp8", 0), ("int8", 1), ("w8a8", 2), ("int4", 0)])
def test_quantization_the_device_cannot_run_is_refused(quantization, gpus):
    with pytest.raises(ValueError):
        spec(quantization, gpus)


def test_crd_carries_the_field_its_description_and_the_rule():
    schema = specialist_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = schema["properties"]["model"]["properties"]["quantization"]
    assert field["enum"] == ["none", "auto", "int8", "w8a8", "fp8", "awq", "gptq", "compressed-tensors"]
    assert field["default"] == "none"
    assert "per output channel" in field["description"]           # what `kubectl explain` prints
    assert any(r["rule"] == QUANTIZATION_RULE for r in schema["x-kubernetes-validations"])
