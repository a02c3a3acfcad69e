"""`consort up`'s pure decisions: restart backoff, CPU placement."""
from consort_operator.local import RESTART_CAP_S, restart_delay


def test_restart_backoff_doubles_caps_and_resets_after_a_good_run():
    assert [restart_delay(n, up_for_s=1) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(6, up_for_s=120) == 1     # it ran for two minutes: a fresh failure
    assert max(restart_delay(n, 0) for n in range(50)) == RESTART_CAP_S


def test_cpu_plan_gives_each_engine_its_share_and_pins_only_when_each_gets_its_own_cores():
    from consort_operator.api.base import quantity_value
    from consort_operator.local import plan_cpu

    assert quantity_value("400m") == 0.4 and quantity_value(2) == 2.0 and quantity_value("2Gi") == 2 ** 31
    # this machine: 2 cores, three 400m engines and a 200m router -> one thread each, unpinned
    three = plan_cpu({"algo": 0.4, "stl": 0.4, "template": 0.4}, [0, 1], 0.2)
    assert three == {"algo": (1, None), "stl": (1, None), "template": (1, None)}
    # enough cores: the cores left after the router shared out by request, each engine on its own
    roomy = plan_cpu({"a": 2, "b": 1.5, "c": 0.5}, list(range(8)), 1.0)
    assert {n: t for n, (t, _) in roomy.items()} == {"a": 3, "b": 3, "c": 1}    # 7 cores: 3.5, 2.6, 0.9
    sets = [c for _, c in roomy.values()]
    assert all(sets) and sum(len(c) for c in sets) == len(set().union(*sets)) == 7
    # a bigger box is used, not left idle: three 400m engines on 16 cores share them, pinned apart
    # (a 200m router does not hold back a whole core)
    big = plan_cpu({"algo": 0.4, "stl": 0.4, "template": 0.4}, list(range(16)), 0.2)
    assert [t for t, _ in big.values()] == [6, 5, 5] and len(set().union(*(c for _, c in big.values()))) == 16
    # a lone Specialist gets the whole box
    assert plan_cpu({"algo": 0.4}, [0, 1], 0.2) == {"algo": (2, {0, 1})}
    # over-asked: scaled down in proportion, at least one each; more engines than cores: unpinned
    tight = plan_cpu({"a": 8, "b": 8}, list(range(4)), 0.0)
    assert {n: t for n, (t, _) in tight.items()} == {"a": 2, "b": 2}
    many = plan_cpu({f"e{i}": 1 for i in range(5)}, [0, 1, 2], 0.0)
    assert all(p == (1, None) for p in many.values())
    # requests of zero share equally
    assert [t for t, _ in plan_cpu({"a": 0, "b": 0}, list(range(4)), 0.0).values()] == [2, 2]


def test_busy_port_ignores_time_wait_left_by_a_previous_run_but_sees_a_listener():
    """After a run that served traffic the port holds TIME_WAIT sockets for a minute and nothing
    listens: a new `consort up` may bind it (its servers set SO_REUSEADDR), so it is not busy."""
    import socket

    from consort_operator.local import busy_port

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as aiohttp's servers bind
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    assert busy_port("127.0.0.1", port), "a listening socket must read as busy"
    listener.close()
    served.close()     # the side that closes first keeps the port in TIME_WAIT
    client.close()
    states = open("/proc/net/tcp").read().split("\n")[1:]
    time_wait = [ln for ln in states if ln.split() and ln.split()[1].endswith(f":{port:04X}") and ln.split()[3] == "06"]
    assert time_wait, f"no TIME_WAIT socket on port {port}: the test set-up did not create one"
    assert not busy_port("127.0.0.1", port), "TIME_WAIT alone read as a port in use"
