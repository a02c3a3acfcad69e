"""`consort up -f PATH`: run the Specialists and the EnsembleRouter found in manifests as local processes.

The same manifests a cluster takes: each Specialist becomes one `consort engine` process on
127.0.0.1 (replicas are capped by --replicas, default 1: a laptop is not a GPU pool), the
EnsembleRouter becomes one `consort router` whose RouterConfig lists the engines by URL instead of by
Service. Model sources: `demo://NAME[?seed=N]` (written once by `consort demo-model` into the cache),
`file:///PATH`; `pvc://` and `hf://` only exist in a cluster. Each run generates an engine credential
(RUN_DIR/engine-credential, mode 0600): the engines require it and the router presents it, so an
engine port answers only its probes to anyone else on the host.

Every child runs in its own process group; Ctrl-C (SIGINT) or SIGTERM stops them all (SIGTERM to
each group, SIGKILL after a grace period) and `consort up` exits only when none is left.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from consort_common.demo_source import parse_demo_model
from consort_common.help import HelpFormatter
from pydantic import ValidationError

from .api.base import explain, quantity_value
from .api.router import EnsembleRouterSpec
from .api.specialist import SpecialistSpec
from .local_scale import local_scaler

CACHE = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort"))


class UpError(Exception):
    pass


# ---- manifests -----------------------------------------------------------------------------------

@dataclass
class Manifests:
    specialists: dict[str, tuple[dict[str, Any], SpecialistSpec]] = field(default_factory=dict)
    routers: dict[str, tuple[dict[str, Any], EnsembleRouterSpec]] = field(default_factory=dict)
    configmaps: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml", ".json")
                          and f.name not in ("kustomization.yaml", "kustomization.yml"))
        elif p.exists():
            out.append(p)
        else:
            raise UpError(f"{p}: no such file or directory")
    return out


def read_yaml(f: Path) -> list[Any]:
    """Every document of a YAML (or JSON) file; a syntax error is one line naming the file and line."""
    try:
        return list(yaml.safe_load_all(f.read_text()))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UpError(f"{f}{at}: not valid YAML: {' '.join(problem.split())}") from e


def load_manifests(paths: list[str]) -> Manifests:
    """Parse and validate (same pydantic models as the CRDs) every consort.dev object in the paths."""
    m = Manifests()
    for f in _files(paths):
        for doc in read_yaml(f):
            if not isinstance(doc, dict):
                continue
            kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
            where = f"{f}: {kind} {name}"
            try:
                if kind == "Specialist":
                    spec = SpecialistSpec.model_validate(doc.get("spec") or {})
                    if spec.fallback == name:
                        raise ValueError("spec.fallback must name another Specialist, not this one")
                    m.specialists[name] = (doc, spec)
                elif kind == "EnsembleRouter":
                    m.routers[name] = (doc, EnsembleRouterSpec.model_validate(doc.get("spec") or {}))
                elif kind == "ConfigMap":
                    m.configmaps[name] = doc
                else:
                    m.skipped.append(where)
            except ValidationError as e:
                model = SpecialistSpec if kind == "Specialist" else EnsembleRouterSpec
                raise UpError(f"{where}: {explain(e, model)}") from e
            except ValueError as e:
                raise UpError(f"{where}: {e}") from e
    if not m.specialists:
        raise UpError(f"no Specialist found in {', '.join(paths)}")
    if len(m.routers) > 1:
        raise UpError(f"found {len(m.routers)} EnsembleRouters ({', '.join(m.routers)}); local mode runs one")
    return m


def local_model_dir(source: str, cache: Path, log: Any) -> str:
    """A directory the local engine can load for a model source (writes demo models once)."""
    if source.startswith("file://"):
        return source[len("file://"):]
    if source.startswith("demo://"):
        demo = parse_demo_model(source)
        target = cache / "demo-models" / f"{demo.name}-{demo.seed}"
        if not (target / "config.json").exists() or not (target / "tokenizer.json").exists():
            log(f"writing demo model {source} into {target} (once; cached)")
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            proc = subprocess.run([sys.executable, "-m", "consort_common.cli", "demo-model", str(tmp),
                                   *demo.model_args()], capture_output=True, text=True)
            if proc.returncode != 0:
                raise UpError(f"consort demo-model failed:\n{proc.stderr[-2000:]}")
            if target.exists():
                import shutil

                shutil.rmtree(target)
            tmp.rename(target)
        return str(target)
    raise UpError(f"model source {source!r} is cluster-only; local mode takes demo:// and file:// sources")


# ---- plan ------------------------------------------------------------------------------------------

@dataclass
class Child:
    name: str                 # "engine algo" / "router cpp"
    argv: list[str]
    url: str                  # "" until an engine started on port 0 has printed its port
    log_path: Path
    specialist: str = ""
    popen: subprocess.Popen | None = None
    ready_at: float | None = None
    cpus: set[int] | None = None      # CPU affinity (consort up's plan_cpu)
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None   # a dead child waits for its backoff to end
    stopped: bool = False             # stopped by scale to zero (local_scale.py): not restarted by supervise

    def discover_url(self) -> str:
        """An engine started with --port 0 prints `listening on http://HOST:PORT`."""
        if not self.url:
            import re

            try:
                m = re.search(r"listening on (http://[0-9.]+:\d+)", self.log_path.read_text(errors="replace"))
            except OSError:
                m = None
            if m:
                self.url = m.group(1)
        return self.url


CONSORT = [sys.executable, "-m", "consort_common.cli"]


def write_engine_credential(run_dir: Path) -> Path:
    """A fresh random engine credential in a 0600 file of the run directory: every engine requires it
    and the router presents it, so other users and processes on the host cannot call an engine port."""
    path = run_dir / "engine-credential"
    path.unlink(missing_ok=True)    # a file left by another user or run keeps its mode: write a new one
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def plan_engines(m: Manifests, args: argparse.Namespace, run_dir: Path, log: Any,
                 credential: Path | None = None) -> list[Child]:
    """One `consort engine` per Specialist replica (ports from --engine-base-port; 0: the engines
    pick free ports themselves and print them, so two runs never race for a port), each requiring
    `credential` when given."""
    from .resources.specialist import engine_args

    engines: list[Child] = []
    port = args.engine_base_port
    replicas_of = {n: max(1, min(spec.replicas, args.replicas)) for n, (_, spec) in m.specialists.items()}
    cores = sorted(os.sched_getaffinity(0))
    router_cpu = next((quantity_value(r.resources.cpu) for _, r in m.routers.values()), 0.0)
    cpu = plan_cpu({f"{n}#{i}": quantity_value(spec.resources.cpu) for n, (_, spec) in m.specialists.items()
                    for i in range(replicas_of[n])}, cores, router_cpu)
    log("CPU plan on cores " + ",".join(map(str, cores)) + ": " + ", ".join(
        f"{n.removesuffix('#0')} {t} thread(s)" + (f" on {sorted(c)}" if c else "") for n, (t, c) in cpu.items()))
    for name, (_, spec) in sorted(m.specialists.items()):
        model_dir = local_model_dir(spec.model.source, args.cache, log)
        adapters = {}
        for a in spec.adapters or []:
            adapters[a.name] = local_model_dir(a.source, args.cache, log)
        replicas = replicas_of[name]
        for i in range(replicas):
            p = port
            port = port + 1 if port else 0
            threads, cpus = cpu[f"{name}#{i}"]
            argv = CONSORT + ["engine"] + engine_args(name, spec, model_dir, adapters, host="127.0.0.1", port=p,
                                                      device="cpu", threads=threads)
            if credential is not None:
                argv += ["--credential-file", str(credential)]
            child = Child(f"engine {name}" + (f"#{i}" if replicas > 1 else ""), argv,
                          f"http://127.0.0.1:{p}" if p else "", run_dir / "logs" / f"engine-{name}-{i}.log", name,
                          cpus=cpus)
            engines.append(child)
    return engines


def plan_router(m: Manifests, args: argparse.Namespace, run_dir: Path, engines: list[Child],
                credential: Path | None = None) -> Child:
    """One `consort router` whose RouterConfig (rendered by the operator's builder) lists the engines
    by URL instead of by Service."""
    from consort_router.config import ActivatorConfig, AuthConfig, SpecialistRoute, StoreConfig

    from .resources.router import Lane, router_config

    urls: dict[str, list[str]] = {}
    for e in engines:
        urls.setdefault(e.specialist, []).append(e.url)
    if m.routers:
        rname, (_, rspec) = next(iter(m.routers.items()))
    else:
        rname, rspec = "ensemble", EnsembleRouterSpec()
    selected = {n: s for n, (doc, s) in m.specialists.items()
                if rspec.specialist_selector.matches((doc.get("metadata") or {}).get("labels"))}
    if not selected:
        raise UpError(f"EnsembleRouter {rname} selects none of the Specialists ({', '.join(m.specialists)})")
    cfg = router_config(rname, rspec, [Lane(n, "local", s) for n, s in selected.items()])
    routes = [SpecialistRoute(name=r.name, replicas=urls[r.name], intents=r.intents, fallback=r.fallback,
                              adapter=r.adapter, revision=r.revision, scale_from_zero=r.scale_from_zero)
              for r in cfg.specialists]
    update: dict[str, Any] = {
        "specialists": routes,
        "activator": ActivatorConfig(kind="file", dir=str(run_dir / "wake")),   # local_scale.py watches it
        "store": StoreConfig(kind="file", path=str(run_dir / "breakers.json")),
        "auth": AuthConfig(api_keys_file=args.api_keys_file, protect_metrics=rspec.auth.protect_metrics,
                           protect_routing=rspec.auth.protect_routing,
                           engine_credential_file=str(credential) if credential else None),
        "calibration_log": str(run_dir / "calibration.jsonl"),
    }
    ref = rspec.classifier.examples_config_map_ref
    if ref is not None:
        cm = m.configmaps.get(ref.name)
        if cm is None or ref.key not in (cm.get("data") or {}):
            raise UpError(f"EnsembleRouter {rname}: ConfigMap {ref.name} key {ref.key} (classifier examples) "
                          "is not in the manifests")
        path = run_dir / "classifier-examples.jsonl"
        path.write_text(cm["data"][ref.key])
        update["classifier"] = cfg.classifier.model_copy(update={"examples_path": str(path)})
    cfg = cfg.model_copy(update=update)
    cfg = type(cfg).model_validate(cfg.model_dump())   # re-run its cross-checks
    config_path = run_dir / "router.yaml"
    config_path.write_text(cfg.dump_yaml())
    router = Child(f"router {rname}", CONSORT + ["router", "--config", str(config_path), "--host", args.host,
                                                  "--port", str(args.port)],
                   f"http://{args.host}:{args.port}", run_dir / "logs" / f"router-{rname}.log")
    return router


# ---- CPU placement (pure) --------------------------------------------------------------------------

def plan_cpu(requests: dict[str, float], cores: list[int], router_cpu: float) -> dict[str, tuple[int, set[int] | None]]:
    """Threads (and, where they fit side by side, a disjoint set of cores) per engine: the cores left
    after the router's request are shared out in proportion to the Specialists' `resources.cpu`
    (largest remainders; at least one thread each), so the engines together never run more threads
    than the box has cores unless there are more engines than cores. A lone Specialist gets the whole
    box; three 400m Specialists on 16 cores get 6, 5 and 5, not 1 each. Cores are pinned only when every engine
    gets its own: pinning two busy engines onto one core while the other idles is worse than letting
    the scheduler move them."""
    budget = max(1, round(len(cores) - router_cpu))
    names = sorted(requests)
    total = sum(requests.values())
    exact = {n: budget * (requests[n] / total if total > 0 else 1 / len(names)) for n in names}
    threads = {n: int(exact[n] + 1e-9) for n in names}
    by_remainder = sorted(names, key=lambda n: exact[n] - threads[n], reverse=True)
    for n in by_remainder[:budget - sum(threads.values())]:
        threads[n] += 1
    threads = {n: max(1, t) for n, t in threads.items()}
    if sum(threads.values()) > len(cores):
        return {n: (t, None) for n, t in threads.items()}
    plan, i = {}, 0
    for n, t in threads.items():
        plan[n] = (t, set(cores[i:i + t]))
        i += t
    return plan


# ---- supervision (pure) ----------------------------------------------------------------------------

RESTART_BASE_S = 1.0
RESTART_CAP_S = 30.0
RESTART_RESET_AFTER_S = 60.0


def restart_delay(restarts: int, up_for_s: float) -> float:
    """Seconds before restarting a child that died, as a kubelet backs off a crash-looping
    container: 1, 2, 4, ... capped at 30 s; a child that had run for a minute starts over at 1 s."""
    if up_for_s >= RESTART_RESET_AFTER_S:
        restarts = 0
    return min(RESTART_CAP_S, RESTART_BASE_S * 2 ** restarts)


def busy_port(host: str, port: int) -> bool:
    """Something listens on host:port. SO_REUSEADDR, as the engine and router servers bind: the
    TIME_WAIT sockets a previous run leaves for a minute must not read as a port in use."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# ---- processes -------------------------------------------------------------------------------------

def start(child: Child) -> None:
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(child.log_path, "ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cpus = child.cpus
    child.popen = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    child.started_at = time.monotonic()
    child.restart_at = None
    out.close()


def pin_port(child: Child) -> None:
    """After an engine started on port 0 printed its port, restarts must reuse it: the router's
    config lists the engines by URL."""
    port = child.url.rsplit(":", 1)[1]
    i = child.argv.index("--port")
    child.argv[i + 1] = port


def supervise(children: list[Child], log: Any, now: float) -> None:
    """Restart dead children with backoff; the log names the one that died and shows its own lines."""
    for c in children:
        if c.popen is None or c.popen.poll() is None or c.stopped:
            continue
        if c.restart_at is None:
            delay = restart_delay(c.restarts, now - c.started_at)
            if now - c.started_at >= RESTART_RESET_AFTER_S:
                c.restarts = 0
            c.restart_at = now + delay
            c.ready_at = None
            log(f"{c.name} (pid {c.popen.pid}) exited with code {c.popen.returncode}; restarting in {delay:.0f} s. "
                f"Its last lines ({c.log_path}):\n{tail(c.log_path, 15)}")
        elif now >= c.restart_at:
            c.restarts += 1
            start(c)
            log(f"{c.name}: restarted (pid {c.popen.pid}, restart {c.restarts})")
    for c in children:
        if c.popen is not None and c.popen.poll() is None and c.ready_at is None and c.restarts and c.url \
                and http_ok(f"{c.url}/ready"):
            c.ready_at = now
            log(f"{c.name}: warm again after {now - c.started_at:.1f} s")


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def stop_all(children: list[Child], grace: float = 10.0) -> None:
    live = [c for c in children if c.popen is not None and c.popen.poll() is None]
    for c in live:
        try:
            os.killpg(c.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for c in live:
        try:
            c.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(c.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            c.popen.wait(5)
    # Anything a child left in its group goes too.
    for c in children:
        if c.popen is not None:
            try:
                os.killpg(c.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Interrupted(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children: list[Child] = []
    try:
        m = load_manifests(args.file)
        run_dir = args.run_dir or (args.cache / "up" / time.strftime("%Y%m%d-%H%M%S"))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        log(f"{len(m.specialists)} Specialist(s): {', '.join(sorted(m.specialists))}; "
            f"EnsembleRouter: {', '.join(m.routers) or '(none: routing every Specialist)'}; logs in {run_dir}/logs")
        ports = [(args.host, args.port)] + ([("127.0.0.1", args.engine_base_port + i) for i in range(
            sum(max(1, min(spec.replicas, args.replicas)) for _, spec in m.specialists.values()))]
            if args.engine_base_port else [])
        for host, port in ports:
            if port and busy_port(host, port):
                raise UpError(f"port {port} on {host} is in use (is another `consort up` running?)")
        credential = write_engine_credential(run_dir)
        engines = plan_engines(m, args, run_dir, log, credential)
        children = list(engines)
        for c in engines:
            start(c)
        deadline = time.monotonic() + args.timeout
        for c in engines:
            while not c.discover_url():
                if c.popen.poll() is not None:
                    raise UpError(f"{c.name} exited with code {c.popen.returncode}; last lines of {c.log_path}:\n{tail(c.log_path)}")
                if time.monotonic() > deadline:
                    raise UpError(f"{c.name} did not start listening in {args.timeout:.0f} s")
                time.sleep(0.1)
            pin_port(c)
            log(f"{c.name}: pid {c.popen.pid}, {c.url}")
        router = plan_router(m, args, run_dir, engines, credential)
        children.append(router)
        pending = list(engines)
        router_started = False
        while True:
            for c in children:
                if c.popen is not None and c.popen.poll() is not None:
                    raise UpError(f"{c.name} exited with code {c.popen.returncode}; last lines of {c.log_path}:\n{tail(c.log_path)}")
            for c in list(pending):
                if http_ok(f"{c.url}/ready"):
                    c.ready_at = time.monotonic()
                    pending.remove(c)
                    log(f"{c.name}: warm")
            if not pending and not router_started:
                start(router)
                router_started = True
                log(f"{router.name}: pid {router.popen.pid}, {router.url}")
            if router_started and router.ready_at is None and http_ok(f"{router.url}/ready"):
                router.ready_at = time.monotonic()
                break
            if time.monotonic() > deadline:
                waiting = [c.name for c in pending] + ([] if router.ready_at else [router.name])
                raise UpError(f"not ready after {args.timeout:.0f} s: {', '.join(waiting)}")
            time.sleep(0.25)
        log(f"ready: {router.url}  (model {json.dumps(router.name.split(' ', 1)[1])} routes; a Specialist name pins)")
        print(f"\n  curl {router.url}/v1/completions -H 'content-type: application/json' \\\n"
              f"    -d '{{\"model\": \"{router.name.split(' ', 1)[1]}\", \"prompt\": \"template <typename T>\", \"max_tokens\": 16}}'\n"
              f"  curl {router.url}/v1/routing\n\nCtrl-C stops everything.", flush=True)
        # Serving: a child that dies is restarted with backoff, as a kubelet would; the router
        # notices a dead engine at its next poll and routes its lane to the fallback meanwhile.
        # Specialists with scaleToZero stop when idle and start when the router asks (local_scale.py).
        scaler = local_scaler(m.specialists, run_dir, credential, start, lambda url: http_ok(f"{url}/ready"))
        while True:
            supervise(children, log, time.monotonic())
            if scaler is not None:
                scaler.step(engines, time.monotonic(), log)
            time.sleep(0.25 if scaler is None else 0.05)
    except Interrupted as e:
        log(f"{e}: stopping {len([c for c in children if c.popen])} process(es)")
        return_code = 0
    except UpError as e:
        print(f"consort up: {e}", file=sys.stderr, flush=True)
        return_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log("stopped")
    return return_code


def keys_file(text: str) -> str:
    """argparse type: an API-key file that exists now (the router reads it as it changes and refuses
    every key while it is missing, so a mistyped path would start an ensemble that answers 401 to all)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file (one API key per line)")
    return str(Path(text).resolve())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consort up", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("-f", "--file", action="append", required=True, metavar="PATH",
                   help="manifest file or directory (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8080, help="router port")
    p.add_argument("--engine-base-port", type=int, default=8101, help="first engine port (0: any free ports)")
    p.add_argument("--replicas", type=int, default=1, help="cap on engine processes per Specialist")
    p.add_argument("--api-keys-file", default=None, type=keys_file, metavar="FILE",
                   help="enable router auth: clients send `Authorization: Bearer KEY` with a key from this file")
    p.add_argument("--cache", type=Path, default=CACHE, help="demo models and run directories")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="logs, router config, breaker state; unset: a new directory under --cache")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for everything to be ready")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
