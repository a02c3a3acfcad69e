"""`consort up`'s pure decisions: restart backoff."""
from consort_operator.local import RESTART_CAP_S, restart_delay


def test_restart_backoff_doubles_caps_and_resets_after_a_good_run():
    assert [restart_delay(n, up_for_s=1) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(6, up_for_s=120) == 1     # it ran for two minutes: a fresh failure
    assert max(restart_delay(n, 0) for n in range(50)) == RESTART_CAP_S
