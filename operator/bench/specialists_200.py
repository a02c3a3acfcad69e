#!/usr/bin/env python3
"""Benchmark (a script with a report, not a test): N Specialists applied at once on kwok.

Measures the time from one `kubectl apply` of N Specialists (one GPU each) until every one is
Ready, the operator's resident memory (peak and at the end), and how hard it works: reconcile passes
and status patches per Specialist (its own metrics), cross-checked against the apiserver's watch of
the Specialists (every MODIFIED event is one write: the status patches and Kopf's finalizer). Goals
at N=1000: all Ready <= 120 s after the apply starts, <= 4 passes and <= 3 status patches per
Specialist, operator RSS <= 300 MB.

    .venv/bin/python operator/bench/specialists_200.py -n 1000         # private cluster, N/8 GPU nodes
    .venv/bin/python operator/bench/specialists_200.py --kubeconfig K  # an existing (kwok) cluster
    .venv/bin/python operator/bench/specialists_200.py -n 1000 --floor # no operator: the control plane's floor

The operator runs as a real subprocess (`consort operator --namespace consort-bench`) with the warm
signal falling back to pod readiness (kwok pods are Ready at once; their IPs are never contacted).
The manifest goes in with one `kubectl apply --server-side` (what a user applying many objects runs;
`--apply client-side` for a GET and a create per object). Besides the goals it reports where the work
goes: CPU seconds of each control-plane process, the operator and kubectl during the apply and after
it, and the apiserver's own request counts (apiserver_request_total) per Specialist.

Report (AMD EPYC, 2 cores, no avx512f, no amx_tile; the control plane, kubectl and the operator on
the same 2 cores, shared with other work). With no operator running, 200 Specialists apply in 2.4 s
(server-side, 2.2 CPU s in all); the CRD's CEL rules cost about 0.6 ms of apiserver CPU per object.
In the benchmark the apply is slow because it competes with everything it sets off (the operator's
writes, the Deployment, ReplicaSet, scheduler, kwok and PodDisruptionBudget work): about 40 apiserver
requests and 0.3 CPU s per Specialist. N = 200, each run on its own control plane:

| N = 200                           | read first, client-side | read first, server-side | create first, server-side |
|-----------------------------------|-------------------------|-------------------------|---------------------------|
| load average during the run       | 22 to 27                | 23                      | 31 to 37                  |
| apiserver requests per Specialist | 56.8                    | 51.9                    | 43.6                      |
| CPU per Specialist, all processes | 435 ms                  | 425 ms                  | 318 ms                    |
| kubectl apply / all Ready         | 168.4 s / 180.7 s       | 153.5 s / 176.2 s       | 109.3 s / 123.4 s         |
| passes / status patches per Spec. | 2.61 / 2.61             | 3.08 / 3.08             | 3.07 / 3.07               |
| operator RSS peak                 | 133 MB                  | 131 MB                  | 142 MB                    |

"Create first": a new Specialist's children are created with a create-only server-side apply (409
when one exists, then read) instead of a GET each first. The N = 1000 figures: docs/operations.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))
BIN = CACHE / "bin"
CONSORT = str(Path(sys.executable).with_name("consort"))
NS = "consort-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


class Kubectl:
    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        self.exe = str(BIN / "kubectl") if (BIN / "kubectl").exists() else "kubectl"

    def __call__(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        p = subprocess.run([self.exe, f"--kubeconfig={self.kubeconfig}", *args], input=input, capture_output=True,
                           text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout


def specialists(n: int) -> str:
    docs = []
    for i in range(n):
        docs.append(json.dumps({
            "apiVersion": "consort.dev/v1alpha1", "kind": "Specialist",
            "metadata": {"name": f"s{i:03d}", "labels": {"consort.dev/ensemble": "bench"}},
            "spec": {"model": {"source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct"}, "replicas": 1, "minReady": 1,
                     "resources": {"gpus": 1, "cpu": "1", "memory": "8Gi"},
                     "kv": {"blockSize": 8 if i % 4 == 0 else 16},
                     "speculative": {"mode": "ngram" if i % 2 else "off"},
                     "intents": [f"intent-{i:03d}"]},
        }))
    return "\n---\n".join(docs)


def floor_manifests(n: int, parts: int) -> list[str]:
    """--floor: the Specialists and the children the operator would write for them (rendered by its own
    builders, without ownerReferences: no owner uid exists yet), split in `parts` for parallel applies.
    What the control plane does for them is the floor under any operator's all-Ready time."""
    sys.path.insert(0, str(REPO / "operator"))
    from consort_operator.api.specialist import SpecialistSpec
    from consort_operator.resources.common import BuildContext
    from consort_operator.resources.specialist import specialist_children

    out: list[list[str]] = [[] for _ in range(parts)]
    for i, doc in enumerate(json.loads("[" + specialists(n).replace("\n---\n", ",") + "]")):
        name = doc["metadata"]["name"]
        docs = [doc] + specialist_children(name, NS, "floor", SpecialistSpec.model_validate(doc["spec"]), BuildContext())
        for d in docs[1:]:
            d["metadata"].pop("ownerReferences", None)
        out[i % parts] += [json.dumps(d) for d in docs]
    return ["\n---\n".join(docs) for docs in out]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_line(before: dict[str, float], after: dict[str, float], n: int) -> str:
    """CPU seconds each process spent between two snapshots, and ms per Specialist in all."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    total = sum(spent.values())
    parts = ", ".join(f"{name} {sec:.1f}" for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]) if sec >= 0.05)
    return f"{total:.1f} CPU s ({1000 * total / n:.0f} ms per Specialist): {parts}"


def apiserver_requests(kubectl: "Kubectl") -> dict[str, float]:
    """The apiserver's own request counters (apiserver_request_total), summed by verb and resource."""
    out: dict[str, float] = {}
    for line in kubectl("get", "--raw", "/metrics").splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if labels.get("verb") == "WATCH":
            continue
        what = labels.get("resource", "") + ("/" + labels["subresource"] if labels.get("subresource") else "")
        key = f"{labels.get('verb')} {what}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def requests_line(before: dict[str, float], after: dict[str, float], n: int, top: int = 8) -> str:
    diff = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}
    total = sum(diff.values())
    parts = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top])
    return f"{total / n:.1f} per Specialist ({total:.0f}): {parts}"


def machine() -> str:
    """CPU model, cores, the avx512f/amx_tile flags and the load average: the context of every figure."""
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown CPU":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512f", "amx_tile"))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return f"{model}, {os.cpu_count()} cores, {have}; load average {load}"


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def install_crds(kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/specialists.consort.dev", "--timeout=60s")
    kubectl("create", "namespace", NS, check=False)


def cluster_down(cluster_dir: Path) -> None:
    subprocess.run([str(REPO / "hack" / "controlplane.sh"), "down"], capture_output=True, timeout=120,
                   env={**os.environ, "CONSORT_CLUSTER_DIR": str(cluster_dir)})


def floor_run(args: argparse.Namespace, kubectl: Kubectl, cluster_dir: Path | None) -> int:
    """--floor: the Specialists and their children applied directly, no operator, until every Deployment
    is available; CPU and apiserver requests as in the operator run."""
    try:
        install_crds(kubectl)
        manifests = floor_manifests(args.count, 4)
        pids = {f.stem: int(f.read_text()) for f in sorted((cluster_dir / "pids").glob("*.pid"))} if cluster_dir else {}
        requests0, cpu0, t0 = apiserver_requests(kubectl), cpu_snapshot(pids), time.monotonic()
        procs = [subprocess.Popen([kubectl.exe, f"--kubeconfig={args.kubeconfig}", "apply", "--server-side",
                                   "--force-conflicts", "-n", NS, "-f", "-"], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, text=True) for _ in manifests]
        for p, m in zip(procs, manifests):
            p.stdin.write(m)
            p.stdin.close()
        if any(p.wait(args.timeout) for p in procs):
            raise RuntimeError("a kubectl apply failed")
        t_applied, cpu1, requests1 = time.monotonic() - t0, cpu_snapshot(pids), apiserver_requests(kubectl)
        ready_s = None
        while time.monotonic() - t0 < args.timeout:
            items = json.loads(kubectl("get", "deployments", "-n", NS, "-o", "json"))["items"]
            available = sum(1 for d in items if ((d.get("status") or {}).get("availableReplicas") or 0) >= 1)
            print(f"[{time.monotonic() - t0:6.1f}s] deployments {len(items)}/{args.count}, available {available}", flush=True)
            if available >= args.count:
                ready_s = time.monotonic() - t0
                break
            time.sleep(1.0)
        n = args.count
        print("\n=== control plane floor (no operator) ===")
        print(f"machine                     : {machine()}")
        print(f"objects applied             : {n} Specialists and their children in 4 parallel kubectl applies,"
              f" {t_applied:.1f} s")
        print(f"CPU during the apply        : {cpu_line(cpu0, cpu1, n)}")
        print(f"CPU to all available        : {cpu_line(cpu0, cpu_snapshot(pids), n)}")
        print(f"apiserver requests, all     : {requests_line(requests0, apiserver_requests(kubectl), n, top=14)}")
        print(f"all Deployments available   : {'%.1f s' % ready_s if ready_s else 'NOT REACHED'}")
        return 0
    finally:
        if cluster_dir is not None:
            cluster_down(cluster_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("-n", "--count", type=int, default=200)
    ap.add_argument("--kubeconfig", help="use this cluster (else start a private one with enough kwok GPU nodes)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--with-router", action="store_true", help="also apply an EnsembleRouter selecting all of them")
    ap.add_argument("--apply", choices=("server-side", "client-side"), default="server-side",
                    help="how kubectl applies the manifest (default: server-side)")
    ap.add_argument("--floor", action="store_true",
                    help="no operator: apply the Specialists and the children it would write (4 kubectl applies "
                         "in parallel) and time until every Deployment is available: the control plane's floor")
    args = ap.parse_args(argv)

    cluster_dir = None
    if args.kubeconfig is None:
        cluster_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=CACHE / "test-clusters" if (CACHE / "test-clusters").exists() else None))
        gpu_nodes = (args.count + 7) // 8
        print(f"starting a private control plane with {gpu_nodes} kwok GPU nodes in {cluster_dir} ...", flush=True)
        up = subprocess.run([str(REPO / "hack" / "controlplane.sh"), "up", "--gpu-nodes", str(gpu_nodes)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "CONSORT_CLUSTER_DIR": str(cluster_dir)})
        if up.returncode != 0:
            print(up.stderr[-3000:], file=sys.stderr)
            return 1
        args.kubeconfig = up.stdout.strip().splitlines()[-1]
    kubectl = Kubectl(args.kubeconfig)
    op = None
    if args.floor:
        return floor_run(args, kubectl, cluster_dir)
    try:
        install_crds(kubectl)
        metrics_port, live_port = free_port(), free_port()
        log = open(Path(tempfile.gettempdir()) / "consort-bench-operator.log", "wb")
        op = subprocess.Popen([CONSORT, "operator", "--kubeconfig", args.kubeconfig, "--namespace", NS, "--standalone",
                               "--warm-signal", "engine-or-pod-ready", "--pod-address", "none",
                               "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
                               "--liveness", f"http://127.0.0.1:{live_port}/healthz", "--log-level", "WARNING"],
                              stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{live_port}/healthz", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or op.poll() is not None:
                    raise RuntimeError(f"operator did not come up (log: {log.name})")
                time.sleep(0.3)
        rss_idle = rss_mb(op.pid)
        peak = [rss_idle]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], rss_mb(op.pid))
                except OSError:
                    return
                stop.wait(0.5)

        threading.Thread(target=sample, daemon=True).start()
        manifest = specialists(args.count)
        if args.with_router:
            manifest += "\n---\n" + json.dumps({"apiVersion": "consort.dev/v1alpha1", "kind": "EnsembleRouter",
                                                 "metadata": {"name": "bench"},
                                                 "spec": {"specialistSelector": {"matchLabels": {"consort.dev/ensemble": "bench"}}}})
        # An independent count of the writes to the Specialists: the apiserver's own watch (every
        # MODIFIED event is one write that changed the object: Kopf's finalizer and our status patches).
        watch_out = open(Path(tempfile.gettempdir()) / f"consort-bench-watch-{os.getpid()}.txt", "w+")
        watch = subprocess.Popen([kubectl.exe, f"--kubeconfig={args.kubeconfig}", "get", "specialists", "-n", NS,
                                  "--watch", "--output-watch-events", "--no-headers",
                                  "-o", "custom-columns=TYPE:.type,NAME:.object.metadata.name"],
                                 stdout=watch_out, stderr=subprocess.DEVNULL, text=True)
        pids = {"operator": op.pid}
        if cluster_dir is not None:
            pids |= {f.stem: int(f.read_text()) for f in sorted((cluster_dir / "pids").glob("*.pid"))}
        load_start = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        requests0 = apiserver_requests(kubectl)
        cpu0 = cpu_snapshot(pids)
        kubectl_cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        side = ["--server-side", "--force-conflicts"] if args.apply == "server-side" else []
        kubectl("apply", *side, "-n", NS, "-f", "-", input=manifest, timeout=args.timeout)
        t_applied = time.monotonic() - t0
        kubectl_cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu1 = cpu_snapshot(pids) | {"kubectl apply": kubectl_cpu1.ru_utime + kubectl_cpu1.ru_stime
                                     - kubectl_cpu0.ru_utime - kubectl_cpu0.ru_stime}
        requests1 = apiserver_requests(kubectl)
        marks: dict[str, float] = {}
        last = ""
        while True:
            items = json.loads(kubectl("get", "specialists", "-n", NS, "-o", "json"))["items"]
            phases: dict[str, int] = {}
            for it in items:
                p = (it.get("status") or {}).get("phase") or "(none)"
                phases[p] = phases.get(p, 0) + 1
            deps = len(kubectl("get", "deployments", "-n", NS, "-o", "name").split())
            now = time.monotonic() - t0
            if deps >= args.count and "deployments" not in marks:
                marks["deployments"] = now
            if phases.get("Ready", 0) >= args.count / 2 and "half" not in marks:
                marks["half"] = now
            line = f"[{now:6.1f}s] deployments {deps}/{args.count}; phases {json.dumps(phases, sort_keys=True)}"
            if line.split("] ", 1)[1] != last:
                print(line, flush=True)
                last = line.split("] ", 1)[1]
            if phases.get("Ready", 0) == args.count:
                marks["ready"] = now
                break
            if now > args.timeout:
                print(f"timed out after {args.timeout:.0f} s", flush=True)
                break
            time.sleep(1.0)
        time.sleep(2)
        cpu2 = cpu_snapshot(pids)
        requests2 = apiserver_requests(kubectl)
        m = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        stop.set()
        watch.terminate()
        watch.wait(10)
        watch_out.seek(0)
        modified = sum(1 for line in watch_out if line.startswith("MODIFIED"))
        watch_out.close()
        os.unlink(watch_out.name)
        rss_end = rss_mb(op.pid)
        hwm = rss_mb(op.pid, "VmHWM")
        reconciles = metric_sum(m, "consort_operator_reconcile_total")
        errors = metric_sum(m, "consort_operator_reconcile_errors_total")
        writes = metric_sum(m, "consort_operator_child_writes_total")
        status_writes = metric_sum(m, "consort_operator_status_writes_total")
        unchanged = metric_sum(m, "consort_operator_wakeups_unchanged_total")
        dur_sum = metric_sum(m, "consort_operator_reconcile_duration_seconds_sum")
        dur_count = metric_sum(m, "consort_operator_reconcile_duration_seconds_count")
        ready_s = marks.get("ready")
        print("\n=== consort operator benchmark ===")
        print(f"machine                     : {machine()} (at the end; {load_start} at the start)")
        n = args.count
        print(f"specialists applied at once : {n} (kubectl apply --{args.apply} took {t_applied:.1f} s,"
              f" {1000 * t_applied / n:.0f} ms per Specialist)")
        print(f"CPU during the apply        : {cpu_line(cpu0, cpu1, n)}")
        print(f"CPU after it, to all Ready  : {cpu_line(cpu1, cpu2, n)}")
        print(f"apiserver requests, apply   : {requests_line(requests0, requests1, n)}")
        print(f"apiserver requests, all     : {requests_line(requests0, requests2, n)}")
        print(f"all Deployments created     : {marks.get('deployments', float('nan')):.1f} s")
        print(f"half Ready                  : {marks.get('half', float('nan')):.1f} s")
        print(f"all Ready                   : {'%.1f s' % ready_s if ready_s else 'NOT REACHED'}  (goal <= 120 s)")
        print(f"operator RSS                : idle {rss_idle:.0f} MB, peak {max(peak[0], hwm):.0f} MB, end {rss_end:.0f} MB  (goal <= 300 MB)")
        print(f"reconcile passes            : {reconciles:.0f} ({errors:.0f} errors), {reconciles / n:.2f} per Specialist"
              f" (goal <= 4), mean {1000 * dur_sum / max(dur_count, 1):.1f} ms;"
              f" {unchanged:.0f} wake-ups found nothing changed (no pass)")
        print(f"API writes                  : {writes:.0f} owned objects, {status_writes:.0f} status patches,"
              f" {status_writes / n:.2f} per Specialist (goal <= 3)")
        print(f"Specialist writes (watch)   : {modified} MODIFIED events, {modified / n:.2f} per Specialist"
              f" (status patches + Kopf's finalizer)")
        ok = (ready_s is not None and ready_s <= 120 and max(peak[0], hwm) <= 300 and reconciles / n <= 4
              and status_writes / n <= 3 and modified <= status_writes + n)
        print(f"verdict                     : {'PASS' if ok else 'MISS'}")
        return 0
    finally:
        if op is not None and op.poll() is None:
            op.send_signal(signal.SIGTERM)
            try:
                op.wait(30)
            except subprocess.TimeoutExpired:
                op.kill()
        if cluster_dir is not None:
            cluster_down(cluster_dir)
        else:
            kubectl("delete", "namespace", NS, "--wait=false", check=False)


if __name__ == "__main__":
    sys.exit(main())
