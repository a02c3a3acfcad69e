"""The engine credential the operator keeps per EnsembleRouter (lifecycle/credential.py), its rotation,
the generated API keys, where pods mount them, and the engines' egress policy: pure decisions."""
from __future__ import annotations

import base64
import itertools
from datetime import datetime, timedelta, timezone

from consort_operator.lifecycle import credential as cred_lc
from consort_operator.lifecycle import router as router_lc
from consort_operator.lifecycle import specialist as specialist_lc
from consort_operator.lifecycle.pacing import Pacing
from consort_operator.probe import Prober
from consort_operator.resources import credential as cred_res
from consort_operator.resources import specialist as specialist_res
from consort_operator.resources.common import ANNOTATION_HASH, BuildContext, owner_reference
from consort_operator.api.specialist import SpecialistSpec
from consort_router.config import RouterConfig

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone.utc)
CTX = BuildContext(credential_propagation_seconds=120.0)
SPECIALIST = {"model": {"source": "pvc://m/algo"}, "replicas": 1, "minReady": 1}
LANE = router_lc.SelectedSpecialist("algo", SPECIALIST, "Ready", 1, "Closed", None)


def minter():
    n = itertools.count()
    return lambda: f"tok-{next(n)}"


def data(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def as_live(secret: dict) -> dict:
    """What the apiserver hands back for an applied Secret (owner and labels as written)."""
    return {**secret, "metadata": {**secret["metadata"], "uid": "secret-uid"}}


def test_a_rotation_stages_then_promotes_and_keeps_the_previous_token():
    mint = minter()
    s = cred_lc.next_state(None, "", T0, mint)
    assert s.current == "tok-0" and s.accepted() == ["tok-0"]
    assert cred_lc.next_state(s, "", T0 + timedelta(hours=1), mint) == s            # nothing asked: unchanged
    created_with = cred_lc.next_state(None, "7", T0, minter())
    assert cred_lc.next_state(created_with, "7", T0, mint) == created_with          # no rotation at creation
    staged = cred_lc.next_state(s, "1", T0, mint)
    assert (staged.current, staged.pending, staged.staging) == ("tok-0", "tok-1", "1")
    assert staged.accepted() == ["tok-1", "tok-0"]                                   # engines learn it first
    assert cred_lc.wait_seconds(staged, T0 + timedelta(seconds=20)) == 100.0
    assert cred_lc.next_state(staged, "1", T0 + timedelta(seconds=119), mint) == staged
    done = cred_lc.next_state(staged, "1", T0 + timedelta(seconds=120), mint)
    assert (done.current, done.previous, done.pending, done.rotation) == ("tok-1", "tok-0", None, "1")
    assert done.accepted() == ["tok-1", "tok-0"] and cred_lc.wait_seconds(done, T0) is None
    again = cred_lc.next_state(cred_lc.next_state(done, "2", T0, mint), "2", T0 + timedelta(minutes=5), mint)
    assert again.accepted() == ["tok-2", "tok-1"]                                    # tok-0 dropped


def test_the_secret_round_trips_through_its_state():
    staged = cred_lc.CredentialState("cur", "prev", "pend", "1", "2", T0)
    d, ann = cred_lc.secret_content(staged)
    secret = cred_res.secret("r-engine-credential", "ns", {}, owner_reference("EnsembleRouter", "r", "u"), d, ann)
    assert data(secret) == {"current": "cur\n", "previous": "prev\n", "pending": "pend\n",
                            "accepted": "pend\ncur\nprev\n"}
    assert cred_lc.state_from_secret(secret) == staged
    assert cred_lc.state_from_secret(None) is None and cred_lc.state_from_secret({"data": {}}) is None


def router_decision(spec: dict, secrets: cred_lc.RouterSecrets = cred_lc.RouterSecrets(), now: datetime = T0):
    o = router_lc.RouterObserved("front", "ns", "uid-r", 1, (LANE,), (True,), secrets)
    return router_lc.decide(spec, o, {}, now, CTX)


def test_a_router_owns_its_engine_credential_and_generated_keys_and_mounts_them():
    d = router_decision({})
    kids = {(c["kind"], c["metadata"]["name"]): c for c in d.children}
    cred = kids[("Secret", "front-engine-credential")]
    keys = kids[("Secret", "front-api-keys")]
    assert [c["kind"] for c in d.children][:2] == ["Secret", "Secret"]   # before the pods that mount them
    for s in (cred, keys):
        assert s["metadata"]["ownerReferences"][0]["uid"] == "uid-r" and s["metadata"]["ownerReferences"][0]["controller"]
    token = data(cred)["current"].strip()
    assert len(token) >= 40 and data(cred)["accepted"] == token + "\n"
    tenant, _, key = data(keys)["keys"].splitlines()[-1].partition(": ")
    assert tenant == "default" and len(key) >= 40 and key != token
    pod = kids[("Deployment", "front-router")]["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["api-keys"]["secret"] == {"secretName": "front-api-keys", "items": [{"key": "keys", "path": "keys"}]}
    assert vols["engine-credential"]["secret"]["secretName"] == "front-engine-credential"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    cfg = RouterConfig.model_validate(__import__("yaml").safe_load(kids[("ConfigMap", "front-router")]["data"]["router.yaml"]))
    assert cfg.auth.api_keys_file == mounts["api-keys"] + "/keys"
    assert cfg.auth.engine_credential_file == mounts["engine-credential"] + "/current"

    # the next pass reads them back: same content, same hash (nothing rewritten), keys left as they are
    again = router_decision({}, cred_lc.RouterSecrets(as_live(cred), as_live(keys), ""))
    again_kids = {(c["kind"], c["metadata"]["name"]): c for c in again.children}
    for k in (("Secret", "front-engine-credential"), ("Secret", "front-api-keys")):
        assert again_kids[k]["metadata"]["annotations"][ANNOTATION_HASH] == kids[k]["metadata"]["annotations"][ANNOTATION_HASH]
    edited = as_live(keys)
    edited["data"] = {"keys": base64.b64encode(b"team-a: mine\n").decode()}
    kept = {c["metadata"]["name"]: c for c in router_decision({}, cred_lc.RouterSecrets(as_live(cred), edited)).children}
    assert data(kept["front-api-keys"]) == {"keys": "team-a: mine\n"}


def test_named_keys_or_auth_off_generate_no_keys_secret():
    named = router_decision({"auth": {"apiKeysSecretRef": {"name": "mine", "key": "k"}}})
    assert [c["metadata"]["name"] for c in named.children if c["kind"] == "Secret"] == ["front-engine-credential"]
    off = router_decision({"auth": {"enabled": False}})
    assert [c["metadata"]["name"] for c in off.children if c["kind"] == "Secret"] == ["front-engine-credential"]
    dep = next(c for c in off.children if c["kind"] == "Deployment")
    assert "api-keys" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


def test_a_foreign_secret_is_never_read_as_the_credential():
    foreign = {"kind": "Secret", "metadata": {"name": "front-engine-credential", "ownerReferences": []},
               "data": {"current": base64.b64encode(b"users-own").decode()}}
    d = router_decision({}, cred_lc.RouterSecrets(foreign, None, ""))
    cred = next(c for c in d.children if c["metadata"]["name"] == "front-engine-credential")
    assert data(cred)["current"].strip() != "users-own"


def test_a_staged_rotation_brings_the_next_pass_forward_and_promotes_on_time():
    first = next(c for c in router_decision({}).children if c["kind"] == "Secret")
    staged = router_decision({}, cred_lc.RouterSecrets(as_live(first), None, "1"))
    assert router_decision({}).requeue_seconds is None     # nothing staged: no timer
    assert staged.requeue_seconds is not None and staged.requeue_seconds <= CTX.credential_propagation_seconds + 1
    s1 = next(c for c in staged.children if c["metadata"]["name"] == "front-engine-credential")
    assert set(data(s1)) == {"current", "pending", "accepted"} and data(s1)["current"] == data(first)["current"]
    late = router_decision({}, cred_lc.RouterSecrets(as_live(s1), None, "1"), T0 + timedelta(seconds=125))
    s2 = next(c for c in late.children if c["metadata"]["name"] == "front-engine-credential")
    assert data(s2)["current"] == data(s1)["pending"] and data(s2)["previous"] == data(first)["current"]
    assert s2["metadata"]["annotations"][cred_lc.ROTATION_DONE] == "1"


def specialist_decision(credentials: tuple[tuple[str, str], ...]) -> specialist_lc.Decision:
    o = specialist_lc.SpecialistObserved("algo", "ns", "uid-1", 1, routers=tuple(r for r, _ in credentials),
                                         credentials=credentials)
    return specialist_lc.decide(SPECIALIST, o, {}, T0, CTX, Pacing("engine", 2.0, 30.0))


def engine_pod(d: specialist_lc.Decision) -> dict:
    return next(c for c in d.children if c["kind"] == "Deployment")["spec"]["template"]["spec"]


def test_engines_accept_the_credential_of_every_router_that_selects_them_and_are_closed_without_one():
    both = specialist_decision((("a-router", "tok-a\n"), ("b-router", "tok-b2\ntok-b1\n")))
    pod = engine_pod(both)
    c = pod["containers"][0]
    i = c["args"].index("--credential-file")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "engine-credentials")
    assert c["args"][i + 1] == mount["mountPath"] and mount["readOnly"]
    vol = next(v for v in pod["volumes"] if v["name"] == "engine-credentials")
    assert vol["secret"] == {"secretName": "algo-engine-credentials", "optional": True}
    secret = next(c for c in both.children if c["kind"] == "Secret")
    assert secret["metadata"]["name"] == "algo-engine-credentials"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"       # the Specialist's: gone with it
    assert data(secret) == {"a-router": "tok-a\n", "b-router": "tok-b2\ntok-b1\n"}
    # No router selecting it: the same Secret, empty (a closed engine), and the same pod template.
    lonely = specialist_decision(())
    assert data(next(c for c in lonely.children if c["kind"] == "Secret")) == {}
    assert engine_pod(lonely) == pod
    # Adding, removing or rotating a router's credential changes the Secret, never the pod template:
    # no rollout; the kubelet brings the files to the running engines.
    deployment = next(c for c in both.children if c["kind"] == "Deployment")
    one = next(c for c in specialist_decision((("a-router", "tok-a\n"),)).children if c["kind"] == "Deployment")
    assert one["metadata"]["annotations"][ANNOTATION_HASH] == deployment["metadata"]["annotations"][ANNOTATION_HASH]


def test_a_router_status_carries_a_digest_of_what_its_engines_accept_that_moves_with_each_rotation_step():
    first = router_decision({}, cred_lc.RouterSecrets(None, None, ""), T0)
    s1 = next(c for c in first.children if c["metadata"]["name"] == "front-engine-credential")
    digest = first.status["engineCredentialDigest"]
    assert digest == cred_lc.accepted_digest(data(s1)["accepted"]) and digest.startswith("sha256:")
    assert data(s1)["current"].strip() not in digest
    staged = router_decision({}, cred_lc.RouterSecrets(as_live(s1), None, "1"), T0 + timedelta(seconds=1))
    assert staged.status["engineCredentialDigest"] != digest
    same = router_decision({}, cred_lc.RouterSecrets(as_live(s1), None, ""), T0 + timedelta(seconds=1))
    assert same.status["engineCredentialDigest"] == digest


def test_engine_egress_is_dns_and_only_https_when_a_source_downloads():
    def egress(spec: dict) -> list:
        return specialist_res.engine_network_policy("algo", "ns", "u", SpecialistSpec.model_validate(spec), CTX)["spec"]
    local = egress(SPECIALIST)
    assert local["policyTypes"] == ["Ingress", "Egress"]
    assert local["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    for spec in ({**SPECIALIST, "model": {"source": "hf://org/model"}},
                 {**SPECIALIST, "adapters": [{"name": "a", "source": "hf://org/lora"}]}):
        assert {"ports": [{"protocol": "TCP", "port": 443}]} in egress(spec)["egress"]
    # monitoring namespaces reach only the metrics port
    ctx = BuildContext(metrics_namespace_labels=(("team", "monitoring"),))
    pol = specialist_res.engine_network_policy("algo", "ns", "u", SpecialistSpec.model_validate(SPECIALIST), ctx)
    spec = SpecialistSpec.model_validate(SPECIALIST)
    monitoring = [r for r in pol["spec"]["ingress"] if any("namespaceSelector" in f and "podSelector" not in f
                                                           for f in r["from"])]
    assert monitoring == [{"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}],
                           "ports": [{"protocol": "TCP", "port": specialist_res.metrics_port(spec)}]}]


def test_the_prober_presents_a_selecting_routers_token():
    p = Prober()
    p.tokens[("ns", "b")] = "tb"
    p.tokens[("other", "a")] = "elsewhere"
    assert p.token("ns", ("a", "b")) == "tb" and p.token("ns", ()) is None and p.token("ns", ("a",)) is None
