"""Fixtures for the engine server tests: a tiny demo checkpoint and one shared `consort engine` process."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/: `import procs`
import procs  # noqa: E402

MAX_MODEL_LEN = 512          # small context: "prompt longer than the context" is cheap to build
SHARED_NUM_BLOCKS = 256      # 4,096 KV slots for the shared engine
SHARED_SLO_ARGS = ("--slo-ttft-ms", "600000", "--slo-itl-ms", "600000")   # generous: every request meets them


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    from consort_engine.demo_model import write_demo_model
    return write_demo_model(tmp_path_factory.mktemp("engine-demo-model") / "demo", max_pos=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def engine(demo_model: Path, engine_logs: Path):
    """One `consort engine` shared by the tests that leave it idle and all-free when they finish."""
    eng = procs.start_engine(demo_model, engine_logs, "--num-blocks", str(SHARED_NUM_BLOCKS), *SHARED_SLO_ARGS,
                             name="spec")
    yield eng
    code = eng.stop()
    assert code == 0, f"engine exited with {code} on SIGTERM\n{eng.proc.tail()}"


@pytest.fixture(scope="session")
def client(engine):
    import openai
    c = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()
