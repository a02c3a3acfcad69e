"""Specialist.spec.kv.tier -> the engine's --kv-tier-* flags (as the real engine CLI parses them) and its volume."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from consort_engine.serving.cli import parse_args
from consort_operator.api.specialist import SpecialistSpec
from consort_operator.resources import specialist as S
from consort_operator.resources.common import BuildContext

CTX = BuildContext(engine_image="engine:test", router_image="router:test", operator_namespace="consort-system")


def pod(kv: dict) -> dict:
    s = SpecialistSpec.model_validate({"model": {"source": "pvc://models/algo"}, "kv": kv})
    return S.engine_deployment("algo", "ns", "u", s, CTX)["spec"]["template"]["spec"]


def test_no_tier_by_default():
    p = pod({})
    a = parse_args(p["containers"][0]["args"])
    assert a.kv_tier_path is None and a.kv_tier_bytes is None
    assert "kv-tier" not in {v["name"] for v in p["volumes"]}


def test_memory_tier_is_a_byte_bound_without_a_path_or_volume():
    p = pod({"tier": {"kind": "memory", "size": "2Gi"}})
    a = parse_args(p["containers"][0]["args"])
    assert a.kv_tier_bytes == 2 << 30 and a.kv_tier_path is None
    assert "kv-tier" not in {v["name"] for v in p["volumes"]}


def test_disk_tier_on_an_emptydir_counts_in_the_ephemeral_storage_limit():
    base = pod({"tier": {"kind": "memory"}})["containers"][0]["resources"]["limits"]["ephemeral-storage"]
    p = pod({"tier": {"kind": "disk", "size": "8Gi"}})
    c = p["containers"][0]
    a = parse_args(c["args"])
    assert a.kv_tier_path == S.KV_TIER_DIR and a.kv_tier_bytes == 8 << 30
    assert {"name": "kv-tier", "emptyDir": {"sizeLimit": "8Gi"}} in p["volumes"]
    assert {"name": "kv-tier", "mountPath": S.KV_TIER_DIR} in c["volumeMounts"]
    assert int(c["resources"]["limits"]["ephemeral-storage"][:-2]) - int(base[:-2]) == 8 * 1024


def test_disk_tier_on_a_claim_is_shared_writable():
    p = pod({"tier": {"kind": "disk", "size": "20Gi", "claim": "kv-shared"}})
    assert {"name": "kv-tier", "persistentVolumeClaim": {"claimName": "kv-shared"}} in p["volumes"]
    assert parse_args(p["containers"][0]["args"]).kv_tier_path == S.KV_TIER_DIR


def test_no_tier_without_prefix_caching_and_a_claim_needs_disk():
    a = parse_args(pod({"prefixCaching": False, "tier": {"kind": "disk"}})["containers"][0]["args"])
    assert a.kv_tier_path is None and a.kv_tier_bytes is None
    with pytest.raises(ValidationError, match="claim needs kind: disk"):
        pod({"tier": {"kind": "memory", "claim": "kv-shared"}})
    with pytest.raises(ValidationError):
        pod({"tier": {"kind": "tape"}})
