"""The activator's queue (consort_router/activator.py): arrival order, per-lane bound, deadline,
hold timeout -> typed 503 with a computed Retry-After, drain on the first warm replica. Real asyncio,
a fake clock only where a test needs time to pass without waiting."""
from __future__ import annotations

import asyncio

import pytest

from consort_router.activator import Activator, retry_after_s
from consort_router.api import ApiError
from consort_router.config import ScaleFromZero
from consort_router.metrics import RouterMetrics


class Lane:
    """A lane that turns warm when told; counts the wake-ups it was asked for."""

    def __init__(self) -> None:
        self.warm = False
        self.wakes: list[str] = []

    async def wake(self, lane: str) -> None:
        self.wakes.append(lane)

    def is_warm(self, lane: str) -> bool:
        return self.warm


def sample(m: RouterMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_retry_after_is_the_rest_of_the_expected_cold_start():
    assert retry_after_s([], None, 100.0, 60.0) == 60.0                 # nothing seen yet: the hold timeout
    assert retry_after_s([4.0, 6.0, 5.0], 100.0, 102.0, 60.0) == 3.0    # median 5 s, 2 s gone
    assert retry_after_s([4.0], 100.0, 130.0, 60.0) == 1.0              # overdue: at least 1 s


def test_held_requests_are_released_in_arrival_order_when_the_lane_turns_warm():
    async def main() -> None:
        lane, m = Lane(), RouterMetrics()
        act = Activator(lane.wake, lane.is_warm, m)
        policy = ScaleFromZero(max_held=10, hold_timeout_s=10)
        order: list[int] = []

        async def request(i: int) -> None:
            await act.hold("algo", policy, deadline=float("inf"))
            order.append(i)

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(request(i)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert act.held("algo") == 6 and order == []
        assert lane.wakes == ["algo"]           # one ask per cold start, not one per request
        assert sample(m, "consort_router_held_requests", specialist="algo") == 6
        lane.warm = True
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert order == list(range(6))
        assert act.held("algo") == 0
        assert sample(m, "consort_router_cold_starts_total", specialist="algo") == 1
        assert sample(m, "consort_router_hold_seconds_count", specialist="algo", outcome="warm") == 6
        assert len(act.lanes["algo"].starts) == 1 and act.lanes["algo"].starts[0] > 0.1
        await act.close()

    asyncio.run(main())


def test_queue_bound_per_lane_refuses_typed_with_retry_after():
    async def main() -> None:
        lane = Lane()
        act = Activator(lane.wake, lane.is_warm, RouterMetrics())
        policy = ScaleFromZero(max_held=2, hold_timeout_s=30)
        held = [asyncio.create_task(act.hold("algo", policy, float("inf"))) for _ in range(2)]
        other = asyncio.create_task(act.hold("debug", policy, float("inf")))   # another lane: its own bound
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await act.hold("algo", policy, float("inf"))
        assert e.value.status == 503 and e.value.code == "cold_start_queue_full"
        assert 1 <= int(e.value.headers()["Retry-After"]) <= 30
        assert act.held("debug") == 1
        lane.warm = True
        await asyncio.wait_for(asyncio.gather(*held, other), 2)
        await act.close()

    asyncio.run(main())


def test_timeout_and_the_requests_own_deadline_answer_503_cold_start_timeout():
    async def main() -> None:
        lane = Lane()
        m = RouterMetrics()
        act = Activator(lane.wake, lane.is_warm, m)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ApiError) as e:
            await act.hold("algo", ScaleFromZero(hold_timeout_s=0.2), float("inf"))
        assert e.value.status == 503 and e.value.code == "cold_start_timeout"
        assert e.value.headers()["Retry-After"] == "1"      # 0.2 s expected, 0.2 s gone: at least 1 s
        assert 0.15 < loop.time() - t0 < 1.0
        # The request's own deadline is shorter than the hold timeout: it wins.
        t0 = act.clock()
        with pytest.raises(ApiError) as e:
            await act.hold("algo", ScaleFromZero(hold_timeout_s=30), deadline=t0 + 0.1)
        assert e.value.code == "cold_start_timeout" and act.clock() - t0 < 1.0
        assert 1 <= int(e.value.headers()["Retry-After"]) <= 30
        assert act.held("algo") == 0
        assert sample(m, "consort_router_hold_seconds_count", specialist="algo", outcome="timeout") == 2
        await act.close()

    asyncio.run(main())


def test_a_failed_ask_is_retried_while_requests_wait(monkeypatch):
    async def main() -> None:
        monkeypatch.setattr("consort_router.activator.REWAKE_S", 0.05)
        calls: list[str] = []
        warm = asyncio.Event()

        async def wake(lane: str) -> None:
            calls.append(lane)
            if len(calls) < 3:
                raise RuntimeError("apiserver away")
            warm.set()

        act = Activator(wake, lambda _lane: warm.is_set(), RouterMetrics())
        await asyncio.wait_for(act.hold("algo", ScaleFromZero(hold_timeout_s=5), float("inf")), 3)
        assert len(calls) == 3
        await act.close()

    asyncio.run(main())


def test_a_lane_that_is_warm_again_starts_a_new_cold_start_next_time():
    async def main() -> None:
        lane, m = Lane(), RouterMetrics()
        act = Activator(lane.wake, lane.is_warm, m)
        policy = ScaleFromZero(hold_timeout_s=5)
        for _ in range(2):
            lane.warm = False
            task = asyncio.create_task(act.hold("algo", policy, float("inf")))
            await asyncio.sleep(0.1)
            lane.warm = True
            await asyncio.wait_for(task, 2)
        assert lane.wakes == ["algo", "algo"]
        assert sample(m, "consort_router_cold_starts_total", specialist="algo") == 2
        await act.close()

    asyncio.run(main())
