"""Leader election decisions (lifecycle/leader.py): free, expired, live, mine, clock skew, lost."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from consort_operator.lifecycle.leader import (State, Timings, decide, lease_spec, lost, observe, record_of,
                                               released_spec)

T = Timings(lease_duration=15, renew_deadline=10, retry_period=2)
ME, OTHER = "op-a_1234", "op-b_5678"
WALL = datetime(2026, 11, 26, 15, 0, 0, tzinfo=timezone.utc)


def lease(holder: str | None, renew: datetime = WALL, rv: str = "7", transitions: int = 3, duration: int = 15) -> dict:
    spec = {"leaseDurationSeconds": duration, "acquireTime": "2026-11-26T14:00:00.000000Z",
            "renewTime": renew.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), "leaseTransitions": transitions}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"metadata": {"name": "consort-operator", "resourceVersion": rv}, "spec": spec}


def look(obj: dict | None, now: float, state: State = State()) -> tuple[str, State]:
    rec = record_of(obj)
    state = observe(state, rec, now)
    return decide(rec, ME, now, state, T), state


def test_no_lease_or_a_released_one_is_acquired_at_once():
    assert look(None, 100.0)[0] == "acquire"
    assert look(lease(None), 100.0)[0] == "acquire"
    assert look(lease(""), 100.0)[0] == "acquire"


def test_live_lease_of_another_holder_is_waited_for_a_whole_duration_after_first_seen():
    action, st = look(lease(OTHER), 100.0)
    assert action == "wait"
    assert look(lease(OTHER), 114.9, st)[0] == "wait"
    assert look(lease(OTHER), 115.0, st)[0] == "acquire"


def test_a_renewal_restarts_the_wait():
    _, st = look(lease(OTHER, rv="7"), 100.0)
    action, st = look(lease(OTHER, renew=WALL + timedelta(seconds=2), rv="8"), 110.0, st)
    assert action == "wait" and st.observed_at == 110.0
    assert look(lease(OTHER, renew=WALL + timedelta(seconds=2), rv="8"), 124.0, st)[0] == "wait"
    assert look(lease(OTHER, renew=WALL + timedelta(seconds=2), rv="8"), 125.0, st)[0] == "acquire"


def test_clock_skew_cannot_shorten_the_wait():
    """The holder's renewTime an hour in the past (its clock behind ours) is still live: only the time
    since we saw the record change, on our clock, counts."""
    stale_looking = lease(OTHER, renew=datetime.now(timezone.utc) - timedelta(hours=1))
    action, st = look(stale_looking, 100.0)
    assert action == "wait"
    assert look(stale_looking, 110.0, st)[0] == "wait"
    # ...and a renewTime in the future (its clock ahead) does not lengthen it.
    future = lease(OTHER, renew=datetime.now(timezone.utc) + timedelta(hours=1))
    _, st = look(future, 100.0)
    assert look(future, 115.0, st)[0] == "acquire"


def test_the_holders_own_duration_is_respected():
    _, st = look(lease(OTHER, duration=30), 100.0)
    assert look(lease(OTHER, duration=30), 120.0, st)[0] == "wait"
    assert look(lease(OTHER, duration=30), 130.0, st)[0] == "acquire"


def test_my_own_lease_is_renewed_and_keeps_acquire_time_and_transitions():
    action, st = look(lease(ME), 100.0, State(renewed_at=99.0))
    assert action == "renew"
    spec = lease_spec(record_of(lease(ME)), ME, WALL, T)
    assert spec["acquireTime"] == "2026-11-26T14:00:00.000000Z" and spec["leaseTransitions"] == 3
    assert spec["renewTime"] == "2026-11-26T15:00:00.000000Z" and spec["leaseDurationSeconds"] == 15


def test_taking_over_counts_a_transition_and_starts_a_new_acquire_time():
    spec = lease_spec(record_of(lease(OTHER)), ME, WALL, T)
    assert spec["holderIdentity"] == ME and spec["leaseTransitions"] == 4
    assert spec["acquireTime"] == "2026-11-26T15:00:00.000000Z"
    assert lease_spec(None, ME, WALL, T)["leaseTransitions"] == 0


def test_renewal_failing_past_the_deadline_is_lost_whatever_the_lease_says():
    st = State(renewed_at=100.0)
    assert not lost(st, 109.9, T) and lost(st, 110.0, T)
    assert look(lease(ME), 109.9, st)[0] == "renew"
    assert look(lease(ME), 110.0, st)[0] == "lost"
    assert not lost(State(), 1e9, T), "a standby has nothing to lose"


def test_a_leader_that_finds_another_holder_has_lost():
    assert look(lease(OTHER), 101.0, State(renewed_at=100.0))[0] == "lost"


def test_deadline_expires_before_any_standby_may_acquire():
    """The leader's last write started at 100 and the standby saw its result no earlier: the leader is
    out at 110, the standby may act at 115 at the earliest."""
    leader = State(renewed_at=100.0)
    _, standby = look(lease(OTHER), 100.0)
    first_acquire = next(t / 10 for t in range(1000, 2000) if look(lease(OTHER), t / 10, standby)[0] == "acquire")
    first_lost = next(t / 10 for t in range(1000, 2000) if lost(leader, t / 10, T))
    assert first_lost + (T.lease_duration - T.renew_deadline) <= first_acquire


def test_released_lease_is_free_to_take():
    rec = record_of(lease(ME))
    spec = released_spec(rec, WALL)
    freed = {"metadata": {"resourceVersion": "9"}, "spec": {k: v for k, v in spec.items() if v is not None}}
    _, st = look(lease(OTHER), 100.0)
    assert decide(record_of(freed), OTHER, 100.5, observe(st, record_of(freed), 100.5), T) == "acquire"


@pytest.mark.parametrize("d,r,p", [(10, 10, 2), (15, 2, 2), (15, 10, 0), (10, 15, 2)])
def test_timings_must_be_ordered(d, r, p):
    with pytest.raises(ValueError):
        Timings(d, r, p)


# ---- the shell (election.py) against a fake apiserver: the writes the decisions turn into ----------

class FakeKube:
    """One Lease in memory with resourceVersions; `down` makes every call fail like an outage."""

    def __init__(self) -> None:
        self.obj: dict | None = None
        self.rv = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise OSError("connection refused")

    def _store(self, obj: dict) -> dict:
        import copy
        self.rv += 1
        self.obj = copy.deepcopy(obj)
        self.obj["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.obj)

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        self._check()
        return None if self.obj is None else dict(self.obj)

    async def create(self, obj: dict) -> dict:
        from consort_operator.kube import KubeError
        self._check()
        if self.obj is not None:
            raise KubeError(409, {"message": "exists"}, "create")
        return self._store(obj)

    async def replace(self, obj: dict) -> dict:
        from consort_operator.kube import KubeError
        self._check()
        if obj["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
            raise KubeError(409, {"message": "conflict"}, "update")
        return self._store(obj)


def elector(kube: FakeKube, me: str, clock: list[float], lost_calls: list[str]):
    from consort_operator.election import Elector
    return Elector(kube, "consort-system", "consort-operator", me, T, clock=lambda: clock[0],
                   on_lost=lost_calls.append)


def test_shell_two_candidates_one_leader_then_failover_and_outage():
    import asyncio
    kube, clock, lost_calls = FakeKube(), [100.0], []
    a, b = elector(kube, ME, clock, lost_calls), elector(kube, OTHER, clock, lost_calls)

    async def scenario() -> None:
        assert await a.step() == "acquire" and a.leading
        assert kube.obj["spec"]["holderIdentity"] == ME
        assert await b.step() == "wait" and not b.leading
        clock[0] = 102.0
        assert await a.step() == "renew"
        # a stale write (the resourceVersion b read before a renewed) is refused: 409, b stays standby
        stale = b._lease(lease_spec(b.record, OTHER, WALL, T), b.record)
        from consort_operator.kube import KubeError
        with pytest.raises(KubeError):
            await kube.replace(stale)
        # an outage: a cannot renew; it is lost at 112 (10 s after its last write), b cannot acquire
        kube.down = True
        clock[0] = 111.9
        assert await a.step() == "wait" and await b.step() == "wait"
        clock[0] = 112.0
        assert await a.step() == "lost"
        kube.down = False
        clock[0] = 113.0
        assert await b.step() == "wait", "b saw the renewal at 102 at the earliest... and must wait on its clock"
        clock[0] = 130.0
        assert await b.step() == "acquire" and kube.obj["spec"]["holderIdentity"] == OTHER
        assert kube.obj["spec"]["leaseTransitions"] == 1

    asyncio.run(scenario())


def test_shell_release_lets_the_standby_take_over_at_once():
    import asyncio
    kube, clock, lost_calls = FakeKube(), [100.0], []
    a, b = elector(kube, ME, clock, lost_calls), elector(kube, OTHER, clock, lost_calls)

    async def scenario() -> None:
        await a.step()
        assert await b.step() == "wait"
        await a.release()
        assert not a.leading and not kube.obj["spec"].get("holderIdentity")
        clock[0] = 101.0
        assert await b.step() == "acquire"

    asyncio.run(scenario())


def test_leader_election_default():
    from consort_operator.main import leader_election_on, parse_args
    assert leader_election_on(parse_args([]), in_cluster=True)
    assert not leader_election_on(parse_args([]), in_cluster=False)
    assert not leader_election_on(parse_args(["--standalone"]), in_cluster=True)
    assert not leader_election_on(parse_args(["--peering", "p"]), in_cluster=True)
    assert leader_election_on(parse_args(["--leader-election", "--standalone"]), in_cluster=False)
    assert not leader_election_on(parse_args(["--no-leader-election"]), in_cluster=True)
    with pytest.raises(SystemExit):
        leader_election_on(parse_args(["--leader-election", "--peering", "p"]), in_cluster=True)


def test_write_guard_refuses_writes_once_the_deadline_passed():
    """A leader paused past its deadline (GC, SIGSTOP) writes nothing when it wakes: the guard raises
    (and exits the process) before the request is sent; reads still pass."""
    import asyncio

    from consort_operator.kube import Kube
    fake, clock, lost_calls = FakeKube(), [100.0], []
    a = elector(fake, ME, clock, lost_calls)
    asyncio.run(a.step())
    a.check_leading()                      # within the deadline: allowed
    clock[0] = 110.0
    with pytest.raises(RuntimeError):
        a.check_leading()
    assert len(lost_calls) == 1 and "lost the leader Lease" in lost_calls[0]

    sent: list[str] = []

    class Api:
        async def call_api(self, path, method, **_):
            sent.append(method)
            return {}

    kube = Kube.__new__(Kube)
    kube.api, kube.write_guard = Api(), a.check_leading
    asyncio.run(kube.get("Lease", "ns", "x"))
    with pytest.raises(RuntimeError):
        asyncio.run(kube.apply({"kind": "Service", "metadata": {"namespace": "ns", "name": "x"}}))
    assert sent == ["GET"]
