"""spec.model.quantization and spec.kv.dtype: the engine container gets `--quantization` /
`--kv-cache-dtype` and the real engine CLI accepts them; a quantization the replica's device cannot run
is refused (pydantic here, the same rule in CEL)."""
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
    assert field["enum"] == ["none", "auto", "int8", "w8a8", "fp8", "awq", "gptq", "compressed-tensors", "modelopt"]
    assert field["default"] == "none"
    assert "per output channel" in field["description"]           # what `kubectl explain` prints
    assert any(r["rule"] == QUANTIZATION_RULE for r in schema["x-kubernetes-validations"])


@pytest.mark.parametrize("kv_dtype,gpus", [(None, 0), ("auto", 1), ("bfloat16", 0), ("fp8", 0), ("fp8", 1)])
def test_the_kv_cache_dtype_reaches_the_engine_and_the_default_adds_no_argument(kv_dtype, gpus):
    from consort_engine.serving.cli import config_from_args, parse_args

    s = SpecialistSpec.model_validate({"model": {"source": "pvc://models/algo"}, "resources": {"gpus": gpus},
                                       **({} if kv_dtype is None else {"kv": {"dtype": kv_dtype}})})
    argv = engine_argv(s)
    assert ("--kv-cache-dtype" in argv) == (kv_dtype not in (None, "auto"))
    assert config_from_args(parse_args(argv)).kv_cache_dtype == (kv_dtype or "auto")


def test_crd_carries_the_kv_dtype_field_and_an_unknown_element_is_refused():
    schema = specialist_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = schema["properties"]["kv"]["properties"]["dtype"]
    assert field["enum"] == ["auto", "bfloat16", "fp8"] and field["default"] == "auto"
    assert "twice the tokens" in field["description"]
    with pytest.raises(ValueError):
        SpecialistSpec.model_validate({"model": {"source": "pvc://models/algo"}, "kv": {"dtype": "int8"}})
