"""hack/controlplane.sh up|down|status|env: start, stop and inspect one local cluster."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import node as real
from .components import COMPONENTS, component_argv, default_nodes, node_manifest
from .layout import ClusterError, Layout, NotYet, Ports, State, choose_free_ports, wait_for
from .pki import make_pki, write_credentials
from .processes import (apiserver_ready, ca_context, cluster_pids, https_get, log_tail, real_node_elsewhere,
                        self_signed_context, start_process, stop_processes)

class Probe:
    """Checks one readiness condition and fails fast when the process it depends on died."""

    def __init__(self, layout: Layout, procs: dict[str, subprocess.Popen]):
        self.layout = layout
        self.procs = procs

    def alive(self, *names: str) -> None:
        for name in names:
            code = self.procs[name].poll()
            if code is not None:
                raise ClusterError(f"{name} exited with code {code} during start-up; last log lines "
                                   f"({self.layout.log(name)}):\n{log_tail(self.layout, name)}")

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.layout.binary("kubectl")), f"--kubeconfig={self.layout.kubeconfig}",
                               "--request-timeout=10s", *args], input=input, capture_output=True, text=True,
                              timeout=30)


def running_state(layout: Layout, real_node: bool = False) -> State | None:
    """The saved state when the whole cluster (with a real node when asked) is up and the
    apiserver is ready, else None."""
    state = State.load(layout.state_file)
    if state is None or not layout.kubeconfig.exists() or (real_node and not state.real_node):
        return None
    pids = cluster_pids(layout)
    wanted = COMPONENTS + (real.NODE_COMPONENTS if state.real_node else ())
    if any(name not in pids for name in wanted):
        return None
    return state if apiserver_ready(layout, state.ports) else None


def up(layout: Layout, gpu_nodes: int, cpu_nodes: int, timeout: float, real_node: bool = False,
       images: Path | None = None) -> int:
    t0 = time.monotonic()
    state = running_state(layout, real_node)
    if state is not None:
        print(f"cluster: already running (apiserver https://127.0.0.1:{state.ports.apiserver}"
              f"{', real node ' + real.NODE_NAME if state.real_node else ''})", file=sys.stderr)
        if state.real_node and images is not None:
            real.import_images(real.NodeLayout(layout), sorted(images.glob("*.tar")))
        print(layout.kubeconfig)
        return 0
    if real_node:
        real.preflight()
        if (other := real_node_elsewhere(layout)) is not None:
            raise ClusterError(f"a real node already runs from {other} (`make cluster-real`?); one per machine: "
                               f"use it (CONSORT_REAL_CLUSTER_DIR={other} for tests/e2e_real) or stop it "
                               f"(CONSORT_CLUSTER_DIR={other} hack/controlplane.sh down)")
    stale = stop_node(layout) + stop_processes(layout)
    if stale:
        print(f"cluster: stopped stale processes from an earlier run: {', '.join(stale)}", file=sys.stderr)
    if not layout.stages_file.exists():
        raise ClusterError(f"{layout.stages_file} is missing: run `make controlplane` (hack/controlplane.sh build)")
    for attempt in (1, 2):
        try:
            return start_cluster(layout, gpu_nodes, cpu_nodes, timeout, t0, real_node, images)
        except PortTaken as exc:
            stop_node(layout)
            stop_processes(layout)
            if attempt == 2:
                raise ClusterError(str(exc)) from None
            print(f"cluster: {exc}; retrying with new ports", file=sys.stderr)
        except (ClusterError, KeyboardInterrupt):
            # Never leave a half-started cluster running; its logs stay for the post-mortem.
            stop_node(layout)
            stop_processes(layout)
            raise
    return 1


class PortTaken(ClusterError):
    pass


def start_cluster(layout: Layout, gpu_nodes: int, cpu_nodes: int, timeout: float, t0: float,
                  real_node: bool = False, images: Path | None = None) -> int:
    if layout.root.exists():
        shutil.rmtree(layout.root)
    for d in (layout.root, layout.pki, layout.logs, layout.pids):
        d.mkdir(parents=True, exist_ok=True)
    layout.root.chmod(0o700)
    ports = Ports(*choose_free_ports(6))
    make_pki(layout.pki)
    write_credentials(layout, ports.apiserver)
    state = State(ports=ports, started_at=time.time())
    state.save(layout.state_file)
    procs: dict[str, subprocess.Popen] = {}
    probe = Probe(layout, procs)

    def launch(name: str, argv: list[str] | None = None) -> None:
        procs[name] = start_process(name, argv or component_argv(name, layout, ports), layout)

    def check_alive(*names: str) -> None:
        try:
            probe.alive(*names)
        except ClusterError as exc:
            if "address already in use" in str(exc):
                raise PortTaken(f"a port was taken between choosing and binding it ({exc.args[0].splitlines()[0]})")
            raise

    def etcd_healthy() -> bool:
        check_alive("etcd")
        status, body = https_get(f"https://127.0.0.1:{ports.etcd}/health", ca_context(layout, "apiserver-etcd-client"))
        return status == 200 and json.loads(body).get("health") == "true"

    launch("etcd")
    wait_for(etcd_healthy, timeout, f"etcd to report healthy on https://127.0.0.1:{ports.etcd}/health")
    launch("kube-apiserver")

    def apiserver_up() -> bool:
        check_alive("etcd", "kube-apiserver")
        return apiserver_ready(layout, ports)

    wait_for(apiserver_up, timeout, f"kube-apiserver /readyz on https://127.0.0.1:{ports.apiserver}")
    state.apiserver_ready_s = round(time.monotonic() - t0, 1)
    print(f"cluster: kube-apiserver ready after {state.apiserver_ready_s}s", file=sys.stderr)
    for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
        launch(name)
    nodes = default_nodes(gpu_nodes, cpu_nodes)
    if nodes:
        manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": [node_manifest(n) for n in nodes]})
        created = probe.kubectl("create", "-f", "-", input=manifest)
        if created.returncode != 0:
            raise ClusterError(f"creating kwok nodes failed: {created.stderr.strip()}")

    def component_healthy(name: str, port: int) -> Callable[[], bool]:
        def check() -> bool:
            check_alive(name)
            status, body = https_get(f"https://127.0.0.1:{port}/healthz", self_signed_context())
            return status == 200 and body.strip() == "ok"
        return check

    wait_for(component_healthy("kube-controller-manager", ports.controller_manager), timeout,
             f"kube-controller-manager /healthz on https://127.0.0.1:{ports.controller_manager}")
    wait_for(component_healthy("kube-scheduler", ports.scheduler), timeout,
             f"kube-scheduler /healthz on https://127.0.0.1:{ports.scheduler}")

    def nodes_ready() -> bool:
        check_alive(*COMPONENTS)
        out = probe.kubectl("get", "nodes", "-o", "json")
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        ready = {item["metadata"]["name"] for item in json.loads(out.stdout)["items"]
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in item["status"].get("conditions", []))}
        missing = sorted({n.name for n in nodes} - ready)
        if missing:
            raise NotYet(f"not Ready yet: {', '.join(missing)}")
        return True

    wait_for(nodes_ready, timeout, f"{len(nodes)} kwok nodes to be Ready (kwok log: {layout.log('kwok')})")

    def default_service_account() -> bool:
        check_alive("kube-controller-manager")
        out = probe.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name")
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        return True

    wait_for(default_service_account, timeout, "the default ServiceAccount (created by kube-controller-manager)")
    if real_node:
        start_node(layout, state, procs, probe, launch, check_alive, timeout, images)
    state.ready_s = round(time.monotonic() - t0, 1)
    state.save(layout.state_file)
    what = f"{len(nodes)} kwok nodes" + (f" + real node {real.NODE_NAME}" if real_node else "")
    print(f"cluster: up in {state.ready_s}s ({what} Ready; logs in {layout.logs}); kubeconfig:", file=sys.stderr)
    print(layout.kubeconfig)
    return 0


def start_node(layout: Layout, state: State, procs: dict[str, subprocess.Popen], probe: Probe,
               launch: Callable[..., None], check_alive: Callable[..., None], timeout: float,
               images: Path | None) -> None:
    """containerd -> images -> kubelet + kube-proxy + the apiserver relay -> node Ready."""
    node = real.NodeLayout(layout)
    state.real_node = True
    state.node_ports = dict(zip(("kubelet_healthz", "proxy_healthz", "proxy_metrics"), choose_free_ports(3)))
    state.save(layout.state_file)
    real.setup_network()
    real.write_configs(node, state.node_ports)
    launch("containerd", real.node_argv("containerd", node, state.ports.apiserver))

    def containerd_up() -> bool:
        check_alive("containerd")
        return real.ctr(node, "version", check=False, timeout=10).returncode == 0

    wait_for(containerd_up, timeout, f"containerd on {node.containerd_sock}")
    real.remove_containers(node)  # leftovers of an earlier cluster in the persistent store
    if images is not None:
        real.import_images(node, sorted(images.glob("*.tar")))
    slice_ = json.dumps(real.kubernetes_endpoints(state.ports.apiserver))
    applied = probe.kubectl("apply", "-f", "-", input=slice_)
    if applied.returncode != 0:
        raise ClusterError(f"writing the kubernetes EndpointSlice failed: {applied.stderr.strip()}")
    for name in ("apiserver-proxy", "kubelet", "kube-proxy"):
        launch(name, real.node_argv(name, node, state.ports.apiserver))

    def node_ready() -> bool:
        check_alive(*real.NODE_COMPONENTS)
        out = probe.kubectl("get", "node", real.NODE_NAME, "-o", "json")
        if out.returncode != 0:
            raise NotYet(out.stderr.strip())
        conditions = {c["type"]: c for c in json.loads(out.stdout)["status"].get("conditions", [])}
        ready = conditions.get("Ready", {})
        if ready.get("status") != "True":
            raise NotYet(f"Ready={ready.get('status')}: {ready.get('message', '')}")
        return True

    wait_for(node_ready, max(timeout, 120), f"node {real.NODE_NAME} Ready (kubelet log: {layout.log('kubelet')})")


def stop_node(layout: Layout) -> list[str]:
    """Stop the real node's pods before its processes: kubelet first (it would restart them),
    then every container, then containerd and the rest; unmount and delete what they left."""
    node = real.NodeLayout(layout)
    if not node.root.exists():
        return []
    pids = cluster_pids(layout)
    stopped = []
    if "kubelet" in pids:
        os.kill(pids["kubelet"], signal.SIGTERM)
        stopped.append("kubelet")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pids['kubelet']}").exists():
            time.sleep(0.1)
    if "containerd" in pids:
        real.remove_containers(node)
    stopped += stop_processes(layout, only=real.NODE_COMPONENTS)
    kube_proxy = layout.binary("kube-proxy")
    if kube_proxy.exists():
        subprocess.run([str(kube_proxy), "--cleanup"], capture_output=True, timeout=60)
    real.unmount_under(node.root)
    real.unmount_under(node.containerd_root)
    real.remove_pod_netns()
    real.teardown_network()
    return stopped


@contextlib.contextmanager
def state_lock(layout: Layout, timeout: float):
    """Serializes up/down on one state dir (the lock file sits beside it: `down` deletes the dir)."""
    layout.root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{layout.root}.lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {layout.root}.lock "
                                       "(another up/down on this cluster)") from None
                time.sleep(0.2)
        yield


def down(layout: Layout) -> int:
    stopped = stop_node(layout) + stop_processes(layout)
    if layout.root.exists():
        shutil.rmtree(layout.root)
    print(f"cluster: stopped {', '.join(stopped) if stopped else 'nothing (no cluster was running)'}; "
          f"removed {layout.root}", file=sys.stderr)
    return 0


def status(layout: Layout) -> int:
    pids = cluster_pids(layout)
    state = State.load(layout.state_file)
    names = COMPONENTS + (real.NODE_COMPONENTS if state is not None and state.real_node else ())
    for name in names:
        print(f"{name:24} {'running, pid ' + str(pids[name]) if name in pids else 'not running'}")
    ready = state is not None and layout.kubeconfig.exists() and apiserver_ready(layout, state.ports)
    print(f"{'apiserver':24} {'ready at https://127.0.0.1:' + str(state.ports.apiserver) if ready else 'not ready'}")
    if ready:
        print(f"{'kubeconfig':24} {layout.kubeconfig}")
    return 0 if ready and all(n in pids for n in names) else 1


def env(layout: Layout) -> int:
    print(f"export KUBECONFIG={layout.kubeconfig}")
    print(f"export PATH={layout.bin_dir}:$PATH")
    return 0


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))
    parser = argparse.ArgumentParser(prog="hack/controlplane.sh", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument("--bin-dir", type=Path, default=cache / "bin")
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("CONSORT_CLUSTER_DIR", cache / "cluster")),
                        help="state dir (env CONSORT_CLUSTER_DIR)")
    parser.add_argument("--gpu-nodes", type=int, default=2)
    parser.add_argument("--cpu-nodes", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed for each start-up wait")
    parser.add_argument("--real-node", action="store_true",
                        help=f"also run a real node ({real.NODE_NAME}: containerd, kubelet, kube-proxy; needs root)")
    parser.add_argument("--images", type=Path, help="import every oci-archive *.tar here into the real node")
    args = parser.parse_args(argv)
    layout = Layout(root=args.dir.expanduser().resolve(), bin_dir=args.bin_dir.expanduser().resolve())
    try:
        if args.command == "status":
            return status(layout)
        if args.command == "env":
            return env(layout)
        with state_lock(layout, timeout=args.timeout * 4):
            if args.command == "up":
                return up(layout, args.gpu_nodes, args.cpu_nodes, args.timeout, args.real_node, args.images)
            return down(layout)
    except ClusterError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
