"""The engine thread's commands: a caller that got a command's answer sees stats at least that fresh."""
import asyncio
import contextlib
import time

from consort_engine.core.async_engine import AsyncEngine
from consort_engine.config import EngineConfig


class SlowStatsEngine:
    """Just enough engine for the loop; its stats take a while, as a real snapshot can on a busy box."""

    def __init__(self, config: EngineConfig) -> None:
        self.loaded: list[int] = []

    def stats(self) -> dict:
        time.sleep(0.05)
        return {"adapters": list(self.loaded)}

    def has_unfinished(self) -> bool:
        return False


@contextlib.asynccontextmanager
async def started(**kw):
    """An AsyncEngine on the running loop, once ready (or 10 s on), shut down afterwards."""
    eng = AsyncEngine(EngineConfig(model="unused"), **kw)
    eng.start()
    try:
        deadline = time.monotonic() + 10
        while not eng.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        yield eng
    finally:
        eng.shutdown()


def test_a_calls_answer_comes_after_the_stats_that_show_it():
    """A hot-loaded adapter answered "loaded" while /v1/status still showed it missing (the snapshot was
    refreshed after the answer); seen as a flake of the adapter hot-load test in CI."""
    async def run() -> list:
        async with started(engine_factory=SlowStatsEngine, warmup=False) as eng:
            seen = []
            for i in range(5):
                await eng.call(lambda e, i=i: e.loaded.append(i))
                seen.append(eng.stats()["adapters"])
            return seen

    assert asyncio.run(run()) == [list(range(i + 1)) for i in range(5)]


def test_the_servers_engine_freezes_the_heap_once_warm():
    """The server's one engine (freeze_heap, which `consort engine` sets) moves what is alive once warm out
    of the cyclic collector's sight, so a full collection no longer walks the model and torch mid-step;
    an engine without the flag (tests, a process that makes several) leaves the collector alone."""
    import gc

    class WarmEngine(SlowStatsEngine):
        def warmup(self) -> None:
            self.frozen_while_warming = gc.get_freeze_count()

    async def start(freeze: bool) -> tuple[int, int]:
        async with started(engine_factory=WarmEngine, freeze_heap=freeze) as eng:
            assert eng.ready
            return eng.engine.frozen_while_warming, gc.get_freeze_count()

    gc.unfreeze()
    try:
        assert asyncio.run(start(False)) == (0, 0)
        warming, ready = asyncio.run(start(True))
        assert warming == 0 and ready > 10_000      # the interpreter's, pytest's and torch's objects at least
    finally:
        gc.unfreeze()
