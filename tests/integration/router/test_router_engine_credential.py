"""The engine credential (issue 25 part 3): an engine started with --credential-file answers nobody
without it except its probes, and serves /metrics on its own port; the router presents it on every
call (requests, /v1/status polls, tokenize), so requests through the router work."""
from __future__ import annotations

import httpx
import pytest

import procs

pytestmark = pytest.mark.timeout(300)
CREDENTIAL = "engine-cred-0123456789abcdef"
NEXT = "engine-cred-next-fedcba9876543210"     # rotation: the engines accept both while the router switches


@pytest.fixture
def locked_engine(demo_model, logs, tmp_path):
    cred = tmp_path / "engine-credential"
    cred.write_text(f"# the engine credentials\n{CREDENTIAL}\n{NEXT}\n")
    cred.chmod(0o600)
    mport = procs.free_port()
    e = procs.start_engine(demo_model, logs, "--num-blocks", "64", "--credential-file", str(cred),
                           "--metrics-port", str(mport), name="Locked")
    yield e, cred, mport
    e.stop()


def test_engine_requires_its_credential_and_the_router_presents_it(locked_engine, make_router, tmp_path):
    e, cred, mport = locked_engine
    body = {"prompt": "int main() {", "max_tokens": 2, "temperature": 0}
    for auth in (None, "Bearer wrong", f"Basic {CREDENTIAL}"):
        h = {"Authorization": auth} if auth else {}
        r = httpx.post(e.url + "/v1/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 401, (auth, r.text)
        assert r.json()["error"]["code"] == "invalid_credential"
    for method, path in (("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/x"), ("GET", "/v1/status"),
                         ("POST", "/tokenize"), ("GET", "/v1/models"), ("GET", "/metrics")):
        assert httpx.request(method, e.url + path, json={}, timeout=30).status_code == 401, path
    assert httpx.get(e.url + "/health", timeout=10).status_code == 200
    assert httpx.get(e.url + "/ready", timeout=10).status_code == 200
    m = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10)
    assert m.status_code == 200 and "vllm:" in m.text
    ok = httpx.post(e.url + "/v1/completions", json=body, timeout=60,
                    headers={"Authorization": f"Bearer {CREDENTIAL}"})
    assert ok.status_code == 200, ok.text

    # through the router: it polls the engine ready with the credential and sends it on every call
    router_cred = tmp_path / "router-engine-credential"
    router_cred.write_text(CREDENTIAL + "\n")
    r = make_router({"ensemble": "cpp", "specialists": [{"name": "Locked", "replicas": [e.url]}],
                     "default_specialist": "Locked", "store": {"kind": "none"}, "reload_interval_s": 0.2,
                     "auth": {"engine_credential_file": str(router_cred)}})
    out = r.post("/v1/completions", {**body, "model": "cpp"})
    assert out.status_code == 200, out.text
    tok = r.post("/tokenize", {"model": "Locked", "prompt": "int main"})
    assert tok.status_code == 200 and tok.json()["tokens"], tok.text
    assert r.routing()["specialists"]["Locked"]["replicas"][0]["ready"] is True

    # rotation: the router follows its file without a restart (a wrong credential is refused, then the next works)
    router_cred.write_text("not-the-credential\n")
    procs.wait_until(lambda: r.post("/v1/completions", {**body, "model": "cpp"}).status_code != 200, 20,
                     what="the router presenting the changed (wrong) credential")
    # The engine's 401 blames the router's credential, not the client's key: never relayed. The
    # replica is not ready for this router (its poll says why), and the client gets a typed 503.
    refused = r.post("/v1/completions", {**body, "model": "cpp"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_ready_replica", refused.text
    assert "retry-after" in {k.lower() for k in refused.headers}
    procs.wait_until(lambda: r.routing()["specialists"]["Locked"]["replicas"][0]["reason"].startswith(
        "the engine refuses this router's engine credential"), 20, what="the poll marking the replica not ready")
    assert r.routing()["specialists"]["Locked"]["replicas"][0]["ready"] is False
    router_cred.write_text(NEXT + "\n")
    procs.wait_until(lambda: r.post("/v1/completions", {**body, "model": "cpp"}).status_code == 200, 20,
                     what="the router presenting the next credential")


def test_the_operators_probe_counts_an_engine_warm_only_once_it_accepts_the_routers_credential(locked_engine):
    """A Specialist's credentials Secret reaches running pods within the kubelet's sync period: until
    then its engine answers /ready but would refuse its router, so the operator must not call it warm."""
    import asyncio

    from consort_operator.probe import Prober

    e, _, _ = locked_engine
    address = e.url.removeprefix("http://")

    async def probe(token: str | None):
        prober = Prober(timeout=10)
        try:
            return await prober.probe(address, token)
        finally:
            await prober.close()

    refused = asyncio.run(probe("a-token-the-engine-does-not-hold"))
    assert refused.reachable and not refused.warm and "credential" in refused.reason
    accepted = asyncio.run(probe(CREDENTIAL))
    assert accepted.warm and accepted.reason == ""
    # no router token known yet (an operator that just started): /ready alone decides
    assert asyncio.run(probe(None)).warm
