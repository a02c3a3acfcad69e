"""Real-process helpers for integration tests: free ports, `consort` subprocesses, bounded readiness waits.

Every wait is bounded; on failure the error carries the tail of the process log. Shared by the
engine and router integration tests (import as `procs` once tests/ is on sys.path; the
conftest.py of each integration folder puts it there).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CONSORT = str(Path(sys.executable).with_name("consort"))
REPO = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A child process whose stdout+stderr go to `log_path`."""
    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen
    started: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def start_process(args: list[str], name: str, log_dir: Path, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=full_env, cwd=cwd)
    return Proc(name=name, args=args, log_path=log_path, popen=popen)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict | str]:
    """GET without third-party clients: (status, JSON body or text). Connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_http(url: str, proc: Proc | None = None, timeout: float = 120.0, expect: int = 200,
              interval: float = 0.05) -> float:
    """Poll `url` until it answers `expect`; returns seconds waited. Fails fast if `proc` exits."""
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} while waiting for {url}\n"
                               f"--- log tail ---\n{proc.tail()}")
        try:
            status, body = http_get(url, timeout=2.0)
            if status == expect:
                return time.monotonic() - t0
            last = f"{status} {body}"
        except OSError as e:
            last = repr(e)
        time.sleep(interval)
    tail = f"\n--- log tail ---\n{proc.tail()}" if proc is not None else ""
    raise TimeoutError(f"{url} did not answer {expect} within {timeout:.0f} s (last: {last}){tail}")


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll predicate() until it returns a truthy value (returned); TimeoutError after `timeout`."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout:.1f} s (last: {last!r})")


@dataclass
class Engine:
    """A running `consort engine` process."""
    proc: Proc
    host: str
    port: int
    name: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def status(self) -> dict:
        code, body = http_get(self.url + "/v1/status")
        assert code == 200, body
        return body

    def generated_tokens(self) -> float:
        """The engine's `vllm:generation_tokens_total`, summed over models: counts decode work done."""
        code, text = http_get(self.url + "/metrics")
        assert code == 200, text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in str(text).splitlines()
                   if ln.startswith("vllm:generation_tokens_total"))

    def stop(self) -> int | None:
        return self.proc.stop()


def start_engine(model_dir: str | Path, log_dir: Path, *extra: str, name: str = "spec",
                 port: int | None = None, wait_ready: bool = True, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> Engine:
    """Launch `consort engine` on 127.0.0.1; by default waits for /ready 200 (bounded)."""
    port = port or free_port()
    args = [CONSORT, "engine", "--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1",
            "--name", name, *extra]
    proc = start_process(args, f"engine-{name}-{port}", log_dir, env=env)
    engine = Engine(proc=proc, host="127.0.0.1", port=port, name=name)
    if wait_ready:
        try:
            wait_http(engine.url + "/ready", proc, timeout=timeout)
        except BaseException:
            proc.stop()
            raise
    return engine


def write_lora_adapter(model_dir: Path, out: Path, rank: int = 4, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter for a checkpoint, hybrids too (the one `demo://lora` writes)."""
    from consort_engine.demo_model import write_demo_adapter
    return write_demo_adapter(model_dir, out, rank=rank, seed=seed)


def manifest_dir(tmp_path: Path, text: str) -> Path:
    """A directory holding one manifest file with `text`, for `consort up -f`."""
    d = tmp_path / "manifests"
    d.mkdir()
    (d / "manifests.yaml").write_text(text)
    return d


@contextlib.contextmanager
def consort_up(tmp_path: Path, port: int, timeout: float = 150.0, manifests: Path = REPO / "examples" / "local"):
    """`consort up -f examples/local` (or `manifests`) with its router on `port` and engines on free
    ports, once its log says ready: (process, log path); killed after."""
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([CONSORT, "up", "-f", str(manifests), "--port", str(port),
                                 "--engine-base-port", "0", "--run-dir", str(tmp_path / "run")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while "ready:" not in log_path.read_text():
            assert proc.poll() is None, f"consort up exited {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"not ready in {timeout:.0f} s:\n{log_path.read_text()}"
            time.sleep(0.5)
        yield proc, log_path
    finally:
        # SIGINT: consort up stops its engines and router (each in its own session, so killing
        # consort up alone would leave them running); SIGKILL only if it does not exit.
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
