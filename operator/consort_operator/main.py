"""`consort operator`: run the Kopf operator against the current kubeconfig (or in-cluster account)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
from typing import Any

from consort_common.help import HelpFormatter


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort operator", description=__doc__,
                                formatter_class=HelpFormatter)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch only this namespace (repeatable; globs allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster (what happens without --namespace)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig file; unset: the in-cluster account, else $KUBECONFIG or ~/.kube/config")
    p.add_argument("--engine-image", default=os.environ.get("CONSORT_ENGINE_IMAGE", "ghcr.io/consort-dev/consort-engine:0.1.0"),
                   help="image of the engine pods ($CONSORT_ENGINE_IMAGE)")
    p.add_argument("--router-image", default=os.environ.get("CONSORT_ROUTER_IMAGE", "ghcr.io/consort-dev/consort-router:0.1.0"),
                   help="image of the router pods ($CONSORT_ROUTER_IMAGE)")
    p.add_argument("--allowed-image", action="append",
                   default=[v for v in os.environ.get("CONSORT_ALLOWED_IMAGES", "").split(",") if v],
                   metavar="PREFIX",
                   help="image prefix (registry, registry/org or repository) a Specialist's or EnsembleRouter's "
                        "spec.image may use, repeatable; the --engine-image and --router-image repositories are "
                        "always allowed, '*' allows any image")
    p.add_argument("--allow-torch-classifier", action="store_true",
                   help="run EnsembleRouters with classifier.kind torch (TorchScript from a ConfigMap is code, "
                        "loaded into the pod that holds the API keys); refused otherwise")
    p.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"],
                   help="imagePullPolicy of the engine and router containers")
    p.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                   help="create a NetworkPolicy per Specialist admitting only routers and the operator")
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", "consort-system"),
                   help="namespace of the operator pods (admitted by the engine NetworkPolicy)")
    p.add_argument("--metrics-namespace-label", action="append", default=[], metavar="KEY=VALUE",
                   help="namespaces with this label may scrape engine /metrics through the NetworkPolicy")
    p.add_argument("--pod-address", default="pod-ip",
                   help="how to reach engine pods: pod-ip | none | file:PATH (JSON/YAML map pod -> host:port)")
    p.add_argument("--warm-signal", default="engine-or-pod-ready", choices=["engine", "pod-ready", "engine-or-pod-ready"],
                   help="what makes a replica warm: the engine's /ready, the pod's Ready condition, or the "
                        "engine when reachable and the pod's Ready condition otherwise")
    p.add_argument("--poll-seconds", type=float, default=2.0, help="engine poll interval while replicas are cold")
    p.add_argument("--idle-seconds", type=float, default=30.0, help="re-check interval when settled")
    p.add_argument("--resync-seconds", type=float, default=600.0, help="re-read owned objects this often")
    p.add_argument("--model-cache-dir", default="", type=node_dir,
                   help="a directory on every node (hostPath) caching hf:// downloads and demo:// builds for the "
                        "engine pods' init containers; '' (the default) turns the cache off")
    p.add_argument("--model-cache-size", default="100Gi", type=cache_size,
                   help="the node cache's bound (a Kubernetes quantity): least recently used entries go past it")
    p.add_argument("--credential-propagation-seconds", type=float, default=120.0,
                   help="a rotated engine credential is staged (engines accept it) this long before routers "
                        "send it: the kubelet's Secret sync time, with margin")
    # Not 8080: that is `consort up`'s router (and many other local servers); 8081 is the liveness endpoint.
    p.add_argument("--metrics-port", type=int, default=8082, help="Prometheus /metrics port (0 disables)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="bind address of /metrics")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                   help="Kopf liveness endpoint URL ('' disables)")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=None,
                   help="act only while holding a coordination.k8s.io Lease (default: on inside a cluster "
                        "unless --standalone or --peering is given; the chart passes it)")
    p.add_argument("--lease-name", default="consort-operator", help="the leader Lease's name")
    p.add_argument("--lease-namespace", default=None, help="the leader Lease's namespace (default: --operator-namespace)")
    p.add_argument("--lease-duration", type=float, default=15.0,
                   help="seconds a standby waits after the last renewal it saw before taking over")
    p.add_argument("--renew-deadline", type=float, default=10.0,
                   help="seconds without a renewal after which the leader exits (less than --lease-duration)")
    p.add_argument("--retry-period", type=float, default=2.0, help="seconds between renewals and between a standby's looks")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default=None,
                      help="Kopf peering instead of leader election (KopfPeering/ClusterKopfPeering must exist; "
                           "not safe through apiserver outages, see docs/operations.md)")
    peer.add_argument("--standalone", action="store_true", help="no Kopf peering (one replica, or with --leader-election)")
    p.add_argument("--priority", type=int, default=None,
                   help="Kopf peering priority with --peering; unset: random, so that of two replicas exactly one acts")
    p.add_argument("--log-level", default=os.environ.get("CONSORT_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR ($CONSORT_LOG_LEVEL)")
    return p.parse_args(argv)


def node_dir(value: str) -> str:
    if value and (not value.startswith("/") or "/../" in f"{value}/"):
        raise argparse.ArgumentTypeError(f"{value!r} is not an absolute path on the node")
    return value


def cache_size(value: str) -> int:
    from .api.base import quantity_value

    try:
        size = int(quantity_value(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not a quantity like 100Gi") from e
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be positive")
    return size


def _pairs(values: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for v in values:
        k, sep, val = v.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {v!r}")
        out.append((k, val))
    return tuple(out)


def in_cluster(args: argparse.Namespace) -> bool:
    from .kube import SA_TOKEN

    return not args.kubeconfig and bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(SA_TOKEN)


def leader_election_on(args: argparse.Namespace, in_cluster: bool) -> bool:
    """Explicit flag wins; by default a pod elects a leader unless told it is alone or peers through Kopf."""
    if args.leader_election is not None:
        if args.leader_election and args.peering:
            raise SystemExit("consort operator: --leader-election and --peering exclude each other")
        return args.leader_election
    return in_cluster and not args.standalone and not args.peering


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").setLevel(max(logging.INFO, logging.getLogger().level))
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)
        # Outside a cluster even when the service-account env happens to be set.
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    # Only now: kubernetes_asyncio reads $KUBECONFIG when first imported (kube.py imports it).
    electing = leader_election_on(args, in_cluster(args))

    import kopf

    from . import election, handlers, metrics
    from .resolver import from_flag
    from .resources.common import BuildContext

    rt = handlers.Runtime()
    rt.ctx = BuildContext(
        engine_image=args.engine_image, router_image=args.router_image, image_pull_policy=args.image_pull_policy,
        network_policy=args.network_policy, operator_namespace=args.operator_namespace,
        metrics_namespace_labels=_pairs(args.metrics_namespace_label),
        allowed_images=tuple(args.allowed_image), allow_torch_classifier=args.allow_torch_classifier,
        credential_propagation_seconds=args.credential_propagation_seconds,
        model_cache_dir=args.model_cache_dir, model_cache_bytes=args.model_cache_size)
    rt.resolver = from_flag(args.pod_address)
    rt.warm_signal = args.warm_signal
    rt.poll_seconds = args.poll_seconds
    rt.idle_seconds = args.idle_seconds
    rt.resync_seconds = args.resync_seconds
    if not electing:
        rt.peering_priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    if args.metrics_port:
        try:
            metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as e:   # most often: the port is taken
            print(f"consort operator: --metrics-port {args.metrics_port} on {args.metrics_host}: "
                  f"{e.strerror or e} (pick another port, or 0 to disable)", file=sys.stderr)
            return 1

    settings = kopf.OperatorSettings()
    if not electing and not args.standalone and not args.peering:
        settings.peering.name = "consort"    # used when the peering object exists; standalone otherwise

    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        elector = None
        if electing:
            elector = await start_election(args)
            health = await election.standby_health(args.liveness)
            try:
                held = await elector.acquire(stop)
            finally:
                if health is not None:
                    await health.cleanup()    # Kopf serves the same URL from here on
            if not held:
                await elector.kube.close()
                return
        if elector is not None:
            rt.write_guard = elector.check_leading
        renewing = asyncio.create_task(elector.keep()) if elector else None
        try:
            await kopf.operator(
                clusterwide=not args.namespace,
                namespaces=args.namespace or (),   # () with clusterwide: every namespace (None breaks Kopf)
                liveness_endpoint=args.liveness or None,
                standalone=args.standalone or electing,
                peering_name=None if electing else args.peering,
                priority=rt.peering_priority,
                settings=settings,
                memo=kopf.Memo(runtime=rt),   # handlers read it as memo.runtime: no module globals
                stop_flag=stop,
            )
        finally:
            if elector is not None and renewing is not None:
                renewing.cancel()
                await elector.release()       # Kopf has stopped: the standby may start now
                await elector.kube.close()

    if electing:
        coordination = f"leader election on Lease {args.lease_namespace or args.operator_namespace}/{args.lease_name}"
    elif args.standalone:
        coordination = "standalone"
    else:
        coordination = f"peering {args.peering or 'consort (if present)'} priority {rt.peering_priority}"
    print(f"consort operator: watching {', '.join(args.namespace) or 'all namespaces'}; "
          f"pod address {args.pod_address}; warm signal {args.warm_signal}; {coordination}",
          file=sys.stderr, flush=True)
    asyncio.run(run())
    return 0


async def start_election(args: argparse.Namespace) -> Any:
    from .election import Elector, identity
    from .kube import Kube, load_configuration
    from .lifecycle.leader import Timings

    try:
        timings = Timings(args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as e:
        raise SystemExit(f"consort operator: {e}") from None
    kube = Kube(await load_configuration())
    return Elector(kube, args.lease_namespace or args.operator_namespace, args.lease_name, identity(), timings)


if __name__ == "__main__":
    sys.exit(main())
