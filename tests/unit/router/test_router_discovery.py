"""Cluster mode: ready endpoints of a Service's EndpointSlices become replica URLs (pure part)."""
from __future__ import annotations

from consort_router.config import ServiceSelector
from consort_router.discovery import ready_urls


def test_ready_urls_from_endpointslices():
    sel = ServiceSelector(namespace="ns", service="algo", port=8000)
    slices = [
        {"addressType": "IPv4", "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"]},                      # no conditions: ready
        ]},
        {"addressType": "IPv6", "endpoints": [{"addresses": ["fd00::1"], "conditions": {"ready": True}}]},
        {"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}]},  # dup
        {"addressType": "Bogus", "endpoints": [{"addresses": ["x"]}]},
        {"addressType": "IPv4"},                               # no endpoints at all
    ]
    assert ready_urls(slices, sel) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::1]:8000"]
    assert ready_urls([], sel) == []


def test_watched_services_group_the_lanes_by_namespace():
    from consort_router.config import SpecialistRoute
    from consort_router.discovery import watched_services

    lanes = [SpecialistRoute(name="a", service=ServiceSelector(namespace="ns1", service="a", port=8000)),
             SpecialistRoute(name="b", service=ServiceSelector(namespace="ns1", service="b", port=8000)),
             SpecialistRoute(name="c", service=ServiceSelector(namespace="ns2", service="c", port=8000)),
             SpecialistRoute(name="d", replicas=["http://127.0.0.1:1"])]
    assert watched_services(lanes) == {"ns1": frozenset({"a", "b"}), "ns2": frozenset({"c"})}
