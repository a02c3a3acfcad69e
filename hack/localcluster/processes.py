"""Finding, starting, stopping and probing the cluster's processes."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .components import COMPONENTS
from .node import NODE_COMPONENTS

ALL_COMPONENTS = COMPONENTS + NODE_COMPONENTS
# argv[0] names of the processes: the apiserver proxy is a socat.
PROGRAMS = frozenset(ALL_COMPONENTS) | {"socat"}
from .layout import ClusterError, Layout, Ports

def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def belongs_to(pid: int, layout: Layout) -> bool:
    """True when pid is a live control-plane process of this state dir (pids get recycled)."""
    argv = cmdline(pid)
    if not argv or Path(argv[0]).name not in PROGRAMS:
        return False
    root = str(layout.root)
    # The dir itself or a path under it: /x/cluster must not claim /x/cluster-real's processes.
    return any(arg == root or arg.endswith("=" + root) or root + "/" in arg for arg in argv[1:])


def real_node_elsewhere(layout: Layout) -> Path | None:
    """The state dir of a real node that runs from another state dir, else None. There is one per
    machine: every cluster's containerd keeps its images in the cache's one store (and the node owns
    the bridge and its address), so a second containerd would wait forever on the first one's lock."""
    for entry in Path("/proc").iterdir():
        argv = cmdline(int(entry.name)) if entry.name.isdigit() else []
        if not argv or Path(argv[0]).name != "containerd" or "--config" not in argv[:-1]:
            continue
        config = Path(argv[argv.index("--config") + 1])
        if config.name == "containerd.toml" and config.parent.name == "node" and config.parent.parent != layout.root \
                and not is_zombie(int(entry.name)):
            return config.parent.parent
    return None


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cluster_pids(layout: Layout) -> dict[str, int]:
    """Live processes of this cluster, from pid files and from a /proc scan (lost pid files)."""
    found: dict[str, int] = {}
    for name in ALL_COMPONENTS:
        try:
            pid = int((layout.pids / f"{name}.pid").read_text())
        except (OSError, ValueError):
            continue
        if belongs_to(pid, layout) and not is_zombie(pid):
            found[name] = pid
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in found.values():
            pid = int(entry.name)
            if belongs_to(pid, layout) and not is_zombie(pid):
                found.setdefault(f"{Path(cmdline(pid)[0]).name}#{pid}", pid)
    return found


def stop_processes(layout: Layout, timeout: float = 15.0, only: tuple[str, ...] = ()) -> list[str]:
    """SIGTERM in reverse start order, then SIGKILL what is left after `timeout` (`only`: those names)."""
    pids = cluster_pids(layout)
    if only:
        pids = {name: pid for name, pid in pids.items() if name in only}
    rank = {name: i for i, name in enumerate(ALL_COMPONENTS)}
    order = sorted(pids, key=lambda n: -rank.get(n.split("#")[0], len(ALL_COMPONENTS)))
    for name in order:
        try:
            os.kill(pids[name], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(belongs_to(p, layout) and not is_zombie(p) for p in pids.values()):
        time.sleep(0.1)
    for name, pid in pids.items():
        if belongs_to(pid, layout) and not is_zombie(pid):
            print(f"cluster: {name} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; killing it", file=sys.stderr)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return order


def start_process(name: str, argv: list[str], layout: Layout) -> subprocess.Popen:
    if not Path(argv[0]).exists():
        raise ClusterError(f"{argv[0]} is missing: run `make controlplane` (hack/controlplane.sh build)")
    with layout.log(name).open("ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=layout.root)
    (layout.pids / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc


def log_tail(layout: Layout, name: str, lines: int = 15) -> str:
    try:
        return "\n".join(layout.log(name).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def https_get(url: str, context: ssl.SSLContext, token: str | None = None, timeout: float = 2.0) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=context, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def admin_token(layout: Layout) -> str:
    return json.loads(layout.kubeconfig.read_text())["users"][0]["user"]["token"]


def ca_context(layout: Layout, client_cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    if client_cert:
        context.load_cert_chain(str(layout.pki / f"{client_cert}.crt"), str(layout.pki / f"{client_cert}.key"))
    return context


def self_signed_context() -> ssl.SSLContext:
    # kube-controller-manager and kube-scheduler serve /healthz with an in-memory self-signed cert.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def apiserver_ready(layout: Layout, ports: Ports) -> bool:
    try:
        status, body = https_get(f"https://127.0.0.1:{ports.apiserver}/readyz", ca_context(layout), admin_token(layout))
    except (OSError, ValueError):
        return False
    return status == 200 and body.strip() == "ok"
