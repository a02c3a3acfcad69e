"""Fixtures for the router integration tests: real `consort engine` processes (tiny demo model, one per
specialist) and real `consort router` processes on 127.0.0.1, driven by the `openai` client."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/: `import procs`
import procs  # noqa: E402

MAX_MODEL_LEN = 512
NUM_BLOCKS = 128
SPECIALISTS = ("Template", "Algo", "STL")
EXAMPLES = Path(__file__).resolve().parents[3] / "router-image" / "consort_router" / "examples" / "cpp_routing.jsonl"


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per specialist (different seeds, one shared tokenizer), so specialists disagree."""
    from consort_engine.demo_model import train_tokenizer, write_demo_model
    root = tmp_path_factory.mktemp("router-demo-models")
    tok = train_tokenizer(4096, limit_bytes=4_000_000)
    return {n: write_demo_model(root / n, max_pos=MAX_MODEL_LEN, seed=i, tokenizer=tok)
            for i, n in enumerate(SPECIALISTS)}


@pytest.fixture(scope="session")
def demo_model(demo_models) -> Path:
    return demo_models["Algo"]


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="session")
def engines(demo_models, logs) -> dict[str, procs.Engine]:
    """One shared engine per specialist (Template, Algo, STL), started in parallel."""
    started = {n: procs.start_engine(demo_models[n], logs, "--num-blocks", str(NUM_BLOCKS), name=n,
                                     wait_ready=False) for n in SPECIALISTS}
    try:
        for e in started.values():
            procs.wait_http(e.url + "/ready", e.proc, timeout=240)
        yield started
    finally:
        for e in started.values():
            e.stop()


@dataclass
class RouterProc:
    proc: procs.Proc
    port: int
    config_path: Path
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, key: str | None = None) -> tuple[int, dict | str]:
        import httpx
        h = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(self.url + path, headers=h, timeout=10)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def routing(self, key: str | None = None) -> dict:
        code, body = self.get("/v1/routing", key)
        assert code == 200, body
        return body

    def post(self, path: str, body: dict, key: str | None = None):
        import httpx
        h = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=h, timeout=60)

    def client(self, key: str = "unused"):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> int | None:
        return self.proc.stop()


def router_config(engines: dict[str, procs.Engine], **over) -> dict:
    """A router config over the shared engines: Template serves `templates`, Algo `codegen` (fallback STL),
    STL `review`; SFINAE/build detectors; the built-in classifier on the shipped labeled set."""
    specs = {
        "Template": {"intents": ["templates"], "fallback": "STL"},
        "Algo": {"intents": ["codegen"], "fallback": "STL"},
        "STL": {"intents": ["review"]},
    }
    cfg = {
        "ensemble": "cpp",
        "specialists": [{"name": n, "replicas": [engines[n].url], **specs[n]} for n in engines],
        "detectors": [{"name": "sfinae", "specialist": "Template", "builtin": "sfinae_templates", "min_matches": 3}],
        "classifier": {"examples_path": str(EXAMPLES)},
        "shadow": {"default_threshold": 0.0},
        "breaker": {"fresh_samples": 0},
        "verifier": {"sample_rate": 0.0},
        "polling": {"interval_s": 0.2},
        "reload_interval_s": 0.2,
        "calibration_log": "calibration.jsonl",
        "store": {"path": "breakers.json"},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def start_router(workdir: Path, config: dict, logs: Path, *, wait_ready: bool = True, port: int | None = None,
                 name: str = "router") -> RouterProc:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "router.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = port or procs.free_port()
    p = procs.start_process([procs.CONSORT, "router", "--config", str(path), "--port", str(port)],
                            f"{name}-{port}", logs)
    r = RouterProc(p, port, path, workdir)
    try:
        procs.wait_http(r.url + ("/ready" if wait_ready else "/health"), p, timeout=60)
    except BaseException:
        p.stop()
        raise
    return r


@pytest.fixture
def make_router(tmp_path, logs):
    made: list[RouterProc] = []

    def make(config: dict, **kw) -> RouterProc:
        r = start_router(kw.pop("workdir", tmp_path / f"r{len(made)}"), config, logs, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        code = r.stop()
        assert code == 0, f"router exited with {code}\n{r.proc.tail()}"


def wait_engine_idle(engine: procs.Engine, timeout: float = 20.0) -> dict:
    def idle():
        s = engine.status()
        return s if (s["running"], s["waiting"], s["kv_free_blocks"]) == (0, 0, s["kv_total_blocks"]) else None
    return procs.wait_until(idle, timeout, what=f"engine {engine.name} idle with all KV blocks free")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    return procs.wait_until(pred, timeout, interval=0.05, what=what)


def now() -> float:
    return time.monotonic()
