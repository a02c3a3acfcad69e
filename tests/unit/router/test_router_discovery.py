"""Cluster mode: ready endpoints of a Service's EndpointSlices become replica URLs (pure part)."""
from __future__ import annotations

from consort_router.config import ServiceSelector
from consort_router.discovery import lane_replicas, ready_urls, unconfirmed_urls


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


def test_a_node_blink_does_not_empty_a_lane():
    """The node controller marks a silent node's pods not ready (the apiserver was away): the lane keeps
    the replicas it routed (the router's own /ready probes then decide), while a new endpoint enters
    only when ready and a terminating or removed one leaves at once."""
    sel = ServiceSelector(namespace="ns", service="algo", port=8000)

    def slices(*eps):
        return [{"addressType": "IPv4", "endpoints": [{"addresses": [a], "conditions": c} for a, c in eps]}]
    blink = slices(("10.0.0.1", {"ready": False, "serving": False, "terminating": False}),
                   ("10.0.0.2", {"ready": False}),
                   ("10.0.0.3", {"ready": False, "terminating": True}),
                   ("10.0.0.4", {"ready": True}))
    assert unconfirmed_urls(blink, sel) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    known = ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://10.0.0.9:8000"]
    urls, held = lane_replicas(known, ready_urls(blink, sel), unconfirmed_urls(blink, sel))
    # .1 held (known, not terminating); .2 never routed: waits to be ready; .3 terminating and
    # .9 gone from the slices: dropped; .4 ready: in
    assert urls == ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]
    assert held == ["http://10.0.0.1:8000"]
    # the node reports again: nothing held, the same replicas
    back = slices(("10.0.0.1", {"ready": True}), ("10.0.0.4", {"ready": True}))
    assert lane_replicas(urls, ready_urls(back, sel), unconfirmed_urls(back, sel)) == (urls, [])
    # before this rule the blink emptied the lane of every replica but the one that stayed ready
    assert ready_urls(blink, sel) == ["http://10.0.0.4:8000"]


def test_watched_services_group_the_lanes_by_namespace():
    from consort_router.config import SpecialistRoute
    from consort_router.discovery import watched_services

    lanes = [SpecialistRoute(name="a", service=ServiceSelector(namespace="ns1", service="a", port=8000)),
             SpecialistRoute(name="b", service=ServiceSelector(namespace="ns1", service="b", port=8000)),
             SpecialistRoute(name="c", service=ServiceSelector(namespace="ns2", service="c", port=8000)),
             SpecialistRoute(name="d", replicas=["http://127.0.0.1:1"])]
    assert watched_services(lanes) == {"ns1": frozenset({"a", "b"}), "ns2": frozenset({"c"})}
