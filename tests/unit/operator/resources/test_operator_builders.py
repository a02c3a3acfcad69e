"""Pure builders: Specialist/EnsembleRouter spec -> the Kubernetes objects the operator applies."""
from __future__ import annotations

import json

import pytest
from consort_router.config import RouterConfig

from consort_operator.api.router import EnsembleRouterSpec
from consort_operator.api.specialist import SpecialistSpec
from consort_operator.resources import router as R
from consort_operator.resources import specialist as S
from consort_operator.resources.common import ANNOTATION_HASH, BuildContext

CTX = BuildContext(engine_image="engine:test", router_image="router:test", operator_namespace="consort-system")


def spec(**kw) -> SpecialistSpec:
    return SpecialistSpec.model_validate({"model": {"source": "pvc://models/algo"}, **kw})


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def test_engine_deployment_gpu_probes_security_and_owner():
    s = spec(replicas=3, minReady=2, warmupTimeoutSeconds=305, resources={"gpus": 2, "memory": "40Gi", "cpu": 8},
             nodeSelector={"gpu": "h100"})
    d = S.engine_deployment("algo", "ns", "uid-1", s, CTX)
    assert d["metadata"]["ownerReferences"] == [{"apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
                                                  "name": "algo", "uid": "uid-1", "controller": True,
                                                  "blockOwnerDeletion": True}]
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["consort", "engine"] and c["image"] == "engine:test"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["limits"]["memory"] == "40Gi" and "cpu" not in c["resources"]["limits"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    # 305 s of warmup at a 10 s period -> 31 attempts.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 305
    assert c["startupProbe"]["failureThreshold"] == 31
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("kv,gpus,want", [({}, 1, 256), ({}, 0, 16), ({"blockSize": 16}, 1, 16),
                                          ({"blockSize": 256}, 0, 256), ({"blockSize": 32}, 2, 32)])
def test_block_size_defaults_by_device_and_explicit_values_win(kv, gpus, want):
    from consort_engine.serving.cli import config_from_args, parse_args

    d = S.engine_deployment("x", "ns", "u", spec(kv=kv, resources={"gpus": gpus, "cpu": 2}), CTX)
    argv = d["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ("--block-size" in argv) == ("blockSize" in kv)
    assert config_from_args(parse_args(argv)).block_size == want


def test_block_size_rejects_values_outside_the_enum():
    with pytest.raises(ValueError):
        spec(kv={"blockSize": 64})


def test_engine_args_are_accepted_by_the_real_engine_cli():
    from consort_engine.serving.cli import parse_args

    s = spec(kv={"blockSize": 8, "numBlocks": 2048, "prefixCaching": False}, maxContext=4096,
             speculative={"mode": "ngram", "numTokens": 4}, dtype="bfloat16",
             adapters=[{"name": "v2", "source": "pvc://models/adapters/v2"}],
             scheduler={"maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "maxWaiting": 10}, enforceEager=True)
    d = S.engine_deployment("template", "ns", "u", s, CTX)
    args = parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.enforce_eager is True
    assert parse_args(S.engine_deployment("t", "ns", "u", spec(), CTX)["spec"]["template"]["spec"]["containers"][0]["args"]).enforce_eager is False
    assert (args.block_size, args.num_blocks, args.no_prefix_caching) == (8, 2048, True)
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 4)
    assert args.max_model_len == 4096 and args.dtype == "bfloat16" and args.device == "cuda"
    assert args.name == "template" and args.port == 8000 and args.host == "0.0.0.0"
    assert args.adapter == [] and args.adapters_file == "/etc/consort/adapters/adapters.json"
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_waiting) == (64, 4096, 10)
    assert args.model == "/models/pvc/models/algo"


def test_the_draft_policy_reaches_the_engine_and_the_default_adds_no_argument():
    from consort_engine.serving.cli import parse_args

    def engine_args(speculative: dict) -> list[str]:
        d = S.engine_deployment("t", "ns", "u", spec(speculative=speculative), CTX)
        return d["spec"]["template"]["spec"]["containers"][0]["args"]

    default, always = engine_args({"mode": "ngram"}), engine_args({"mode": "ngram", "policy": "always"})
    assert "--speculative-policy" not in default and parse_args(default).speculative_policy == "goodput"
    assert parse_args(always).speculative_policy == "always"
    assert [a for a in always if a not in default] == ["--speculative-policy", "always"]
    with pytest.raises(ValueError, match="policy"):
        spec(speculative={"mode": "ngram", "policy": "sometimes"})


def test_sources_pvc_hf_and_tokenizer_assembly():
    s = spec(model={"source": "hf://Qwen/Qwen2.5-Coder-1.5B@main", "tokenizer": "pvc://tok/qwen"}, resources={"gpus": 0})
    d = S.engine_deployment("x", "ns", "u", s, CTX)
    pod = d["spec"]["template"]["spec"]
    inits = {c["name"]: c for c in pod["initContainers"]}
    assert "snapshot_download(repo_id='Qwen/Qwen2.5-Coder-1.5B', revision='main'" in inits["fetch"]["command"][2]
    assert "assemble" in inits
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/assembled"
    assert args[args.index("--device") + 1] == "cpu"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["pvc-tok"]["persistentVolumeClaim"] == {"claimName": "tok", "readOnly": True}


def test_service_pdb_networkpolicy():
    s = spec(replicas=4, minReady=3, port=9000)
    objs = by_kind(S.specialist_children("algo", "ns", "u", s, CTX))
    assert set(objs) == {"ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    assert objs["Service"]["spec"]["ports"][0]["port"] == 9000
    assert objs["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1          # the slack above minReady
    assert "minAvailable" not in objs["PodDisruptionBudget"]["spec"]
    np = objs["NetworkPolicy"]["spec"]
    peers = np["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "router", "app.kubernetes.io/part-of": "consort"}}} in peers
    assert any(p.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "consort-system"} for p in peers)
    assert np["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert len(np["ingress"]) == 1      # no metrics namespaces named: nobody else
    # monitoring reaches the engine's own metrics port (consort engine --metrics-port), never its API
    pod = objs["Deployment"]["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-port") + 1] == "9001" == pod["metadata"]["annotations"]["prometheus.io/port"]
    assert {"name": "metrics", "containerPort": 9001, "protocol": "TCP"} in pod["spec"]["containers"][0]["ports"]
    mon_ctx = BuildContext(metrics_namespace_labels=(("team", "mon"),))
    mon = by_kind(S.specialist_children("algo", "ns", "u", s, mon_ctx))
    rules = mon["NetworkPolicy"]["spec"]["ingress"]
    assert {"namespaceSelector": {"matchLabels": {"team": "mon"}}} not in rules[0]["from"]
    assert rules[1] == {"from": [{"namespaceSelector": {"matchLabels": {"team": "mon"}}}],
                        "ports": [{"protocol": "TCP", "port": 9001}]}
    no_np = by_kind(S.specialist_children("algo", "ns", "u", s, BuildContext(network_policy=False)))
    assert "NetworkPolicy" not in no_np


def test_content_hash_is_stable_and_tracks_changes():
    a = S.engine_deployment("algo", "ns", "u", spec(), CTX)
    b = S.engine_deployment("algo", "ns", "u", spec(), CTX)
    c = S.engine_deployment("algo", "ns", "u", spec(replicas=2), CTX)
    h = lambda o: o["metadata"]["annotations"][ANNOTATION_HASH]  # noqa: E731
    assert h(a) == h(b) != h(c)


def test_adapters_live_in_a_configmap_so_a_rotation_or_rollback_restarts_no_pod():
    one = spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}])
    two = spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}, {"name": "v2", "source": "pvc://m/v2"},
                         {"name": "demo", "source": "demo://lora?seed=3"}])
    h = lambda o: o["metadata"]["annotations"][ANNOTATION_HASH]  # noqa: E731
    d1, d2 = S.engine_deployment("algo", "ns", "u", one, CTX), S.engine_deployment("algo", "ns", "u", two, CTX)
    assert h(d1) == h(d2)            # same template: the rotation is a hot-load
    pod = d2["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--adapter" not in args and args[args.index("--adapters-file") + 1] == "/etc/consort/adapters/adapters.json"
    assert {"name": "adapters", "configMap": {"name": "algo-adapters"}} in pod["volumes"]
    assert not any(i["name"].startswith("demo-model-lora") for i in pod.get("initContainers") or [])
    cm = S.adapters_configmap("algo", "ns", "u", two, CTX, exclude_adapters=frozenset({"v2"}))
    listed = json.loads(cm["data"]["adapters.json"])["adapters"]
    assert listed == [{"name": "v1", "path": "/models/pvc/m/v1", "source": "pvc://m/v1"},
                      {"name": "demo", "path": "/tmp/consort-adapters/lora-3", "source": "demo://lora?seed=3"}]
    assert cm["metadata"]["ownerReferences"][0]["name"] == "algo"
    # A source on a volume the pods lack changes the template: that rotation rolls the pods (the fallback).
    other = spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}, {"name": "x", "source": "pvc://other/x"}])
    assert h(S.engine_deployment("algo", "ns", "u", other, CTX)) != h(d1)


def lanes():
    return [
        R.Lane("algo", "ns", spec(intents=["codegen"], fallback="stl")),
        R.Lane("stl", "ns", spec(intents=["ranges"], slo={"correctnessFloor": 0.6})),
        R.Lane("debug", "ns", spec(intents=["debug"], fallback="not-in-ensemble")),
    ]


def test_router_config_is_a_valid_routerconfig():
    er = EnsembleRouterSpec.model_validate({
        "rules": [{"intent": "review", "specialist": "algo"}],
        "detectors": [{"name": "gdb", "specialist": "debug", "builtin": "gdb_transcript"}],
        "shadow": {"thresholds": {"review": 0.9}},
        "auth": {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}},
        "breaker": {"tripAfterSeconds": 30},
    })
    cfg = R.router_config("cpp", er, lanes())
    again = RouterConfig.model_validate_json(cfg.model_dump_json())
    assert again == cfg
    algo = cfg.specialist("algo")
    assert algo.service.service == "algo" and algo.service.port == 8000 and algo.service.namespace == "ns"
    assert algo.fallback == "stl"
    assert cfg.specialist("debug").fallback is None   # not in the ensemble: the router could not use it
    assert cfg.intent_table() == {"codegen": "algo", "ranges": "stl", "debug": "debug", "review": "algo"}
    assert cfg.breaker.floor == 0.6 and cfg.breaker.trip_after_s == 30
    assert cfg.auth.api_keys_file == "/etc/consort/auth/api-keys"
    assert [s.name for s in cfg.specialists] == ["algo", "debug", "stl"]


def test_rules_and_detectors_outside_the_ensemble_are_skipped_not_fatal():
    er = EnsembleRouterSpec.model_validate({
        "rules": [{"intent": "review", "specialist": "gone"}, {"intent": "perf", "specialist": "algo"}],
        "detectors": [{"name": "gdb", "specialist": "gone", "builtin": "gdb_transcript"}]})
    cfg = R.router_config("cpp", er, lanes())
    assert [(r.intent, r.specialist) for r in cfg.rules] == [("perf", "algo")] and cfg.detectors == []
    assert R.skipped_references(er, lanes()) == ["rule review -> gone", "detector gdb -> gone"]


def test_lane_revision_follows_the_checkpoint_and_the_default_adapter():
    s = spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}, {"name": "v2", "source": "pvc://m/v2"}])
    base = R.Lane("algo", "ns", s)
    v1, v2 = R.Lane("algo", "ns", s, "v1"), R.Lane("algo", "ns", s, "v2")
    assert len({base.revision, v1.revision, v2.revision}) == 3
    assert R.Lane("algo", "ns", spec(adapters=[{"name": "v1", "source": "pvc://m/v1"}]), "v1").revision == v1.revision
    assert R.Lane("algo", "ns", spec(model={"source": "pvc://models/other"})).revision != base.revision
    cfg = R.router_config("cpp", EnsembleRouterSpec(), [v2])
    assert cfg.specialist("algo").adapter == "v2" and cfg.specialist("algo").revision == v2.revision


def test_router_config_rejects_conflicts_and_empty_ensembles():
    er = EnsembleRouterSpec.model_validate({"rules": [{"intent": "codegen", "specialist": "stl"}]})
    with pytest.raises(ValueError):
        R.router_config("cpp", er, lanes())
    with pytest.raises(ValueError):
        R.router_config("cpp", EnsembleRouterSpec(), [])


@pytest.mark.parametrize("replicas,min_ready,disruptions", [(1, 1, 1), (2, 2, 1), (4, 1, 3), (3, 2, 1)])
def test_a_node_drain_may_always_take_one_engine_replica(replicas, min_ready, disruptions):
    """minAvailable = minReady blocked `kubectl drain` for ever when replicas == minReady."""
    pdb = S.engine_pdb("algo", "ns", "u", spec(replicas=replicas, minReady=min_ready), CTX)
    assert pdb["spec"]["maxUnavailable"] == disruptions


def test_the_router_drains_on_deletion_and_through_node_drains():
    er = EnsembleRouterSpec.model_validate({"replicas": 2})
    objs = by_kind(R.router_children("cpp", "ns", "u", er, R.router_config("cpp", er, lanes()), CTX))
    pdb = objs["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["metadata"]["name"] == "cpp-router"
    assert pdb["spec"]["selector"] == objs["Deployment"]["spec"]["selector"]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    from consort_router.router import DRAIN_S
    prestop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert prestop > 0 and pod["terminationGracePeriodSeconds"] > prestop + DRAIN_S
    # started = listening (after the classifier trained); never restarted while its engines still warm
    assert c["startupProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_router_children_rbac_is_least_privilege():
    er = EnsembleRouterSpec.model_validate({"replicas": 3, "auth": {"apiKeysSecretRef": {"name": "keys", "key": "k"}},
                                            "service": {"type": "LoadBalancer", "port": 443}})
    cfg = R.router_config("cpp", er, lanes())
    objs = by_kind(R.router_children("cpp", "ns", "u", er, cfg, CTX))
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
                         "PodDisruptionBudget"}
    rules = objs["Role"]["rules"]
    assert rules[0] == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    verbs = {v for r in rules for v in r["verbs"]}
    assert verbs <= {"get", "list", "watch", "patch"}
    assert all(r.get("resourceNames") == ["cpp"] for r in rules[1:])
    assert RouterConfig.model_validate(__import__("yaml").safe_load(objs["ConfigMap"]["data"]["router.yaml"])) == cfg
    dep = objs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cpp-router" and dep["spec"]["replicas"] == 3
    c = pod["containers"][0]
    assert c["command"] == ["consort", "router"]
    assert c["args"][:2] == ["--config", "/etc/consort/router/router.yaml"]
    from consort_router.cli import parse_args   # the entry point takes the router's own flags

    assert parse_args(c["args"]).port == 8080
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CONSORT_ENSEMBLE_ROUTER"] == "ns/cpp"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert "subPath" not in mounts["config"]    # hot reload needs the directory mount
    assert mounts["api-keys"]["mountPath"] == "/etc/consort/auth"
    assert objs["Service"]["metadata"]["name"] == "cpp" and objs["Service"]["spec"]["type"] == "LoadBalancer"
    for o in objs.values():
        assert o["metadata"]["ownerReferences"][0]["kind"] == "EnsembleRouter"


def test_demo_model_init_container_has_the_engines_requests_and_demo_loras_are_the_engines_to_write():
    s = SpecialistSpec.model_validate({"model": {"source": "demo://tiny?seed=2"}, "resources": {"cpu": "400m", "memory": "2Gi"},
                                       "adapters": [{"name": "fresh", "source": "demo://lora?seed=7"}]})
    pod = S.engine_deployment("algo", "ns", "uid-1", s, CTX)["spec"]["template"]["spec"]
    [model] = pod["initContainers"]     # the engine writes demo://lora adapters itself (adapter_sync)
    assert model["command"] == ["consort", "demo-model", "/models/demo/tiny-2", "--size", "tiny", "--seed", "2"]
    engine = pod["containers"][0]
    # An init container asking for more than the engine would raise the whole pod's request.
    assert model["resources"] == engine["resources"]


def test_a_hybrid_demo_model_is_written_as_a_bamba_by_its_init_container_or_the_model_cache():
    s = SpecialistSpec.model_validate({"model": {"source": "demo://tiny-bamba?seed=2"},
                                       "resources": {"cpu": "400m", "memory": "2Gi"}})
    pod = S.engine_deployment("algo", "ns", "uid-1", s, CTX)["spec"]["template"]["spec"]
    [model] = pod["initContainers"]
    assert model["name"] == "demo-model-tiny-bamba-2"
    assert model["command"] == ["consort", "demo-model", "/models/demo/tiny-bamba-2", "--size", "tiny",
                                "--arch", "bamba", "--seed", "2"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/demo/tiny-bamba-2"
    cached = S.engine_deployment("algo", "ns", "uid-1", s, CACHE_CTX)["spec"]["template"]["spec"]
    from consort_engine.model_cache import parse_args
    assert parse_args(cached["initContainers"][1]["command"][2:]).pairs == ["demo://tiny-bamba?seed=2",
                                                                          "/models/demo/tiny-bamba-2"]
    for bad in ("demo://tiny-mamba", "demo://bamba", "demo://lora-bamba", "demo://tiny-bamba?seed=x"):
        with pytest.raises(ValueError):
            SpecialistSpec.model_validate({"model": {"source": bad}})


def test_demo_lora_is_an_adapter_source_only():
    with pytest.raises(ValueError):
        SpecialistSpec.model_validate({"model": {"source": "demo://lora"}})
    with pytest.raises(ValueError):
        SpecialistSpec.model_validate({"model": {"source": "demo://tiny"}, "adapters": [{"name": "a", "source": "demo://tiny"}]})


def test_engine_pod_drains_inside_its_grace_period():
    pod = S.engine_deployment("algo", "ns", "uid-1", spec(), CTX)["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    pre_stop = engine["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(engine["args"][engine["args"].index("--drain-timeout") + 1])
    assert pre_stop > 0 and pod["terminationGracePeriodSeconds"] > pre_stop + drain


def test_a_cpu_engine_runs_as_many_threads_as_its_cpu_request():
    from consort_engine.serving.cli import parse_args

    for cpu, threads in (("400m", 1), ("1500m", 2), (4, 4)):
        d = S.engine_deployment("x", "ns", "u", spec(resources={"gpus": 0, "cpu": cpu}), CTX)
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert parse_args(c["args"]).threads == threads, cpu
        assert "cpu" not in c["resources"]["limits"]          # a request, no limit: no CFS throttling
    gpu = S.engine_deployment("x", "ns", "u", spec(), CTX)["spec"]["template"]["spec"]["containers"][0]
    assert "--threads" not in gpu["args"]


def test_tensor_parallel_size_reaches_the_engine_and_requests_one_gpu_per_rank():
    from consort_engine.serving.cli import parse_args

    s = spec(tensorParallelSize=2, resources={"gpus": 2})
    d = S.engine_deployment("algo", "ns", "u", s, CTX)
    c = d["spec"]["template"]["spec"]["containers"][0]
    assert parse_args(c["args"]).tensor_parallel_size == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert parse_args(S.engine_deployment("algo", "ns", "u", spec(), CTX)["spec"]["template"]["spec"]
                      ["containers"][0]["args"]).tensor_parallel_size == 1
    cpu = spec(tensorParallelSize=2, resources={"gpus": 0, "cpu": 4})
    args = parse_args(S.engine_deployment("algo", "ns", "u", cpu, CTX)["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (args.tensor_parallel_size, args.device, args.threads) == (2, "cpu", 4)   # the ranks share the 4
    with pytest.raises(ValueError, match="resources.gpus must equal tensorParallelSize"):
        spec(tensorParallelSize=2)                        # default gpus: 1
    with pytest.raises(ValueError, match="not supported with tensorParallelSize"):
        spec(tensorParallelSize=2, resources={"gpus": 2}, adapters=[{"name": "v2", "source": "pvc://m/v2"}])


def test_replica_choice_reaches_the_router_config():
    from consort_operator.resources.router import Lane, router_config
    lanes = [Lane("algo", "ns", spec(), None)]
    default = router_config("cpp", EnsembleRouterSpec.model_validate({}), lanes)
    assert default.replica_choice.policy == "prefix-affine" and default.replica_choice.load_slack == 4.0
    cfg = router_config("cpp", EnsembleRouterSpec.model_validate(
        {"replicaChoice": {"policy": "least-loaded", "loadSlack": 2, "blockChars": 64}}), lanes)
    assert (cfg.replica_choice.policy, cfg.replica_choice.load_slack, cfg.replica_choice.block_chars) == \
        ("least-loaded", 2.0, 64)
    assert RouterConfig.model_validate(cfg.model_dump()).replica_choice == cfg.replica_choice
    with pytest.raises(ValueError):
        EnsembleRouterSpec.model_validate({"replicaChoice": {"policy": "random"}})


CACHE_CTX = BuildContext(engine_image="engine:test", router_image="router:test", operator_namespace="consort-system",
                         model_cache_dir="/var/lib/consort/model-cache", model_cache_bytes=50 * 2**30)


def test_model_cache_is_mounted_into_the_fetching_init_containers_only():
    from consort_engine.model_cache import parse_args

    s = spec(model={"source": "hf://Qwen/Qwen2.5-Coder-1.5B@main", "tokenizer": "pvc://tok/qwen"})
    pod = S.engine_deployment("x", "ns", "u", s, CACHE_CTX)["spec"]["template"]["spec"]
    inits = {c["name"]: c for c in pod["initContainers"]}
    fetch = inits["fetch"]
    assert fetch["command"][:2] == ["consort", "model-cache"]
    args = parse_args(fetch["command"][2:])      # what the engine image's `consort model-cache` accepts
    assert args.pairs == ["hf://Qwen/Qwen2.5-Coder-1.5B@main", "/models/hf/Qwen/Qwen2.5-Coder-1.5B@main"]
    assert (args.cache_dir, args.max_bytes) == (S.MODEL_CACHE_MOUNT, 50 * 2**30)
    assert {"name": "model-cache", "mountPath": S.MODEL_CACHE_MOUNT} in fetch["volumeMounts"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"   # the hit/miss line in the pod status
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-cache"] == {"name": "model-cache",
                                   "hostPath": {"path": "/var/lib/consort/model-cache", "type": "DirectoryOrCreate"}}
    # the engine (and the assemble step) read the pod's own verified copy, never the node's directory
    for c in [*pod["containers"], inits["assemble"]]:
        assert "model-cache" not in {m["name"] for m in c["volumeMounts"]}
    # the pod's security settings stay as they are without the cache
    plain = S.engine_deployment("x", "ns", "u", s, CTX)["spec"]["template"]["spec"]
    assert pod["securityContext"] == plain["securityContext"] and pod["securityContext"]["runAsNonRoot"] is True
    assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in [*pod["containers"], *pod["initContainers"]])
    assert "model-cache" not in {v["name"] for v in plain["volumes"]}
    assert "snapshot_download" in {c["name"]: c for c in plain["initContainers"]}["fetch"]["command"][2]


def test_model_cache_builds_demo_models_through_the_cache_and_leaves_pvc_sources_alone():
    from consort_engine.model_cache import parse_args

    s = SpecialistSpec.model_validate({"model": {"source": "demo://tiny?seed=2"}, "resources": {"cpu": "400m", "memory": "2Gi"}})
    pod = S.engine_deployment("algo", "ns", "uid-1", s, CACHE_CTX)["spec"]["template"]["spec"]
    owner, model = pod["initContainers"]
    assert owner["name"] == "model-cache-owner"
    assert parse_args(model["command"][2:]).pairs == ["demo://tiny?seed=2", "/models/demo/tiny-2"]
    assert model["resources"] == pod["containers"][0]["resources"]
    assert {"name": "model-cache", "mountPath": S.MODEL_CACHE_MOUNT} in model["volumeMounts"]
    # unpinned hf:// keeps its form (the cache resolves the branch to a commit on the node)
    hf = S.engine_deployment("x", "ns", "u", spec(model={"source": "hf://org/m"}), CACHE_CTX)["spec"]["template"]["spec"]
    assert parse_args(hf["initContainers"][1]["command"][2:]).pairs == ["hf://org/m", "/models/hf/org/m"]
    # a pvc:// checkpoint is read in place: nothing to cache, no hostPath
    pvc = S.engine_deployment("algo", "ns", "u", spec(), CACHE_CTX)["spec"]["template"]["spec"]
    assert "initContainers" not in pvc and "model-cache" not in {v["name"] for v in pvc["volumes"]}


def test_model_cache_directory_is_handed_to_the_engines_user_by_a_root_step_with_chown_only():
    """kubelet creates a missing hostPath directory owned by root; fsGroup does not reach hostPath:
    the first init container chowns the directory (only it) to the pods' user, as root with CAP_CHOWN."""
    s = SpecialistSpec.model_validate({"model": {"source": "demo://tiny"}, "resources": {"cpu": "400m", "memory": "2Gi"}})
    pod = S.engine_deployment("algo", "ns", "uid-1", s, CACHE_CTX)["spec"]["template"]["spec"]
    owner = pod["initContainers"][0]
    assert owner["name"] == "model-cache-owner" and owner["image"] == CACHE_CTX.engine_image
    assert owner["volumeMounts"] == [{"name": "model-cache", "mountPath": S.MODEL_CACHE_MOUNT}]
    sc = owner["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]} and sc["readOnlyRootFilesystem"] is True
    uid = CACHE_CTX.run_as_user
    assert owner["command"][:2] == ["sh", "-c"] and f"chown {uid}:{uid} {S.MODEL_CACHE_MOUNT}" in owner["command"][2]
    assert "-R" not in owner["command"][2]   # the directory, never the entries other pods are reading
    # every other container, and the pod, still run as the engines' user
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert all("runAsUser" not in c["securityContext"] for c in [*pod["containers"], *pod["initContainers"][1:]])
    plain = S.engine_deployment("algo", "ns", "uid-1", s, CTX)["spec"]["template"]["spec"]
    assert "model-cache-owner" not in {c["name"] for c in plain["initContainers"]}


def test_a_scale_to_zero_specialist_probes_every_second_so_held_requests_wait_no_probe_period():
    base = {"model": {"source": "demo://tiny"}, "resources": {"cpu": "400m", "memory": "2Gi"}, "warmupTimeoutSeconds": 120}
    plain = S.engine_deployment("a", "ns", "u", SpecialistSpec.model_validate(base), CTX)
    s2z = S.engine_deployment("a", "ns", "u", SpecialistSpec.model_validate({**base, "scaleToZero": {"idleAfter": "5m"}}), CTX)
    [p], [z] = plain["spec"]["template"]["spec"]["containers"], s2z["spec"]["template"]["spec"]["containers"]
    assert (p["startupProbe"]["periodSeconds"], p["readinessProbe"]["periodSeconds"]) == (10, 5)
    assert (z["startupProbe"]["periodSeconds"], z["readinessProbe"]["periodSeconds"]) == (1, 1)
    for c in (p, z):   # the same warmup budget and the same failure window either way
        start, ready = c["startupProbe"], c["readinessProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] == 120
        assert ready["periodSeconds"] * ready["failureThreshold"] == 10
        assert start["timeoutSeconds"] <= start["periodSeconds"] or start["timeoutSeconds"] == 5


def test_operator_model_cache_flags():
    from consort_operator.main import parse_args

    off = parse_args([])
    assert off.model_cache_dir == "" and off.model_cache_size == 100 * 2**30
    on = parse_args(["--model-cache-dir", "/var/lib/consort/model-cache", "--model-cache-size", "20Gi"])
    assert (on.model_cache_dir, on.model_cache_size) == ("/var/lib/consort/model-cache", 20 * 2**30)
    for bad in (["--model-cache-dir", "var/cache"], ["--model-cache-dir", "/a/../etc"],
                ["--model-cache-size", "lots"], ["--model-cache-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_model_cache_is_not_mounted_for_a_spec_image_override():
    s = spec(model={"source": "demo://tiny"}, image="registry.internal/ml/engine:custom")
    pod = S.engine_deployment("x", "ns", "u", s, CACHE_CTX)["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"][:2] == ["consort", "demo-model"]
    assert "model-cache" not in {v["name"] for v in pod["volumes"]}
