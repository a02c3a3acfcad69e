"""RouterConfig: strict schema, cross references, YAML/JSON load, round trip."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from consort_router.config import RouterConfig

BASE = {"ensemble": "cpp", "specialists": [
    {"name": "Algo", "replicas": ["http://127.0.0.1:9001/"], "intents": ["codegen"], "fallback": "STL"},
    {"name": "STL", "service": {"namespace": "ns", "service": "stl", "port": 8000}},
]}


def cfg(**over):
    d = json.loads(json.dumps(BASE))
    d.update(over)
    return RouterConfig.model_validate(d)


def test_defaults_and_normalisation():
    c = cfg()
    assert c.specialists[0].replicas == ["http://127.0.0.1:9001"]
    assert c.intent_table() == {"codegen": "Algo"}
    assert c.shadow.priority == -1000 and c.verifier.std == "c++20"
    assert c.specialist("STL").service.port == 8000 and c.specialist("nope") is None


@pytest.mark.parametrize("over", [
    {"unknown": 1},
    {"specialists": [{"name": "A", "replicas": ["not a url"]}]},
    {"specialists": [{"name": "A"}, {"name": "A"}]},
    {"specialists": [{"name": "A", "fallback": "A"}]},
    {"specialists": [{"name": "A", "fallback": "B"}]},
    {"specialists": [{"name": "cpp"}]},
    {"rules": [{"intent": "codegen", "specialist": "STL"}]},   # conflicts with Algo's intent
    {"detectors": [{"name": "d", "specialist": "Nope", "builtin": "build_files"}]},
    {"detectors": [{"name": "d", "specialist": "Algo"}]},       # neither builtin nor patterns
    {"default_specialist": "Nope"},
    {"shadow": {"thresholds": {"x": 1.5}}},
    {"breaker": {"floor": 2}},
    {"verifier": {"std": "c++20; rm -rf /"}},
    {"specialists": [{"name": "A", "replicas": ["http://x:1"], "service": {"namespace": "n", "service": "s", "port": 1}}]},
])
def test_rejects_bad_configs(over):
    with pytest.raises(ValidationError):
        cfg(**over)


def test_load_yaml_and_json_and_round_trip(tmp_path):
    c = cfg(detectors=[{"name": "b", "specialist": "Algo", "builtin": "build_files"}],
            breaker={"floor": 0.8}, auth={"api_keys_file": "keys.txt"})
    y = tmp_path / "router.yaml"
    y.write_text(c.dump_yaml())
    assert RouterConfig.load(y) == c
    j = tmp_path / "router.json"
    j.write_text(c.model_dump_json())
    assert RouterConfig.load(j) == c
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError):
        RouterConfig.load(bad)


def test_json_schema_has_descriptions():
    schema = RouterConfig.model_json_schema()
    spec = schema["$defs"]["SpecialistRoute"]["properties"]
    assert spec["fallback"]["description"] and spec["replicas"]["description"]
    assert schema["additionalProperties"] is False


def test_import_is_light():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, consort_router.config; "
                          "print(sorted(m for m in ('torch', 'aiohttp', 'consort_engine', 'consort_operator', 'yaml') "
                          "if m in sys.modules))"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_router_server_import_does_not_pull_torch_engine_or_operator():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, consort_router.cli, consort_router.server, consort_router.bench; "
                          "print(sorted(m for m in ('torch', 'consort_engine', 'consort_operator', 'kubernetes', "
                          "'kopf') if m in sys.modules))"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
