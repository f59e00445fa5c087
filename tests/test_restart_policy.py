"""The restart policy of `pagedserve up`, with time passed in: delays, their reset, the cap, and giving up on a
child that never started."""
from __future__ import annotations

from pagedserve.restart_policy import ChildRestarts, GiveUp, Restart, RestartPolicy

POLICY = RestartPolicy(first_delay=0.25, max_delay=2.0, stable_after=10.0, max_restarts=5, window=60.0)


def ready_child(now: float = 0.0) -> ChildRestarts:
    child = ChildRestarts(POLICY, started_at=now)
    child.ready()
    return child


def crash_loop(child: ChildRestarts, now: float, run_s: float, times: int) -> list[Restart | GiveUp]:
    """The child exits `run_s` after each start, restarted when the policy says."""
    decisions = []
    for _ in range(times):
        now += run_s
        decision = child.exited(now)
        decisions.append(decision)
        if isinstance(decision, GiveUp):
            break
        now = decision.at
        child.started(now)
    return decisions


def test_a_child_that_exits_before_it_was_ever_ready_is_given_up_at_once():
    decision = ChildRestarts(POLICY, started_at=0.0).exited(3.0)
    assert isinstance(decision, GiveUp) and "before it was ever ready" in decision.reason


def test_quick_exits_double_the_delay_up_to_its_cap():
    decisions = crash_loop(ready_child(), now=0.0, run_s=1.0, times=5)
    assert [d.delay for d in decisions] == [0.25, 0.5, 1.0, 2.0, 2.0]
    assert [d.recent for d in decisions] == [1, 2, 3, 4, 5]


def test_a_restart_at_is_its_exit_time_plus_the_delay():
    decision = ready_child().exited(42.0)
    assert decision == Restart(at=42.25, delay=0.25, recent=1)


def test_a_run_longer_than_stable_after_resets_the_delay():
    child = ready_child()
    first, second = crash_loop(child, now=0.0, run_s=1.0, times=2)
    assert second.delay == 0.5
    child.started(second.at)
    third = child.exited(second.at + POLICY.stable_after)
    assert third.delay == POLICY.first_delay


def test_more_restarts_than_the_cap_within_the_window_give_up():
    decisions = crash_loop(ready_child(), now=0.0, run_s=1.0, times=10)
    assert len(decisions) == POLICY.max_restarts + 1
    assert isinstance(decisions[-1], GiveUp)
    assert "6 times within 60 s" in decisions[-1].reason and "at most 5 restarts per 60 s" in decisions[-1].reason


def test_restarts_older_than_the_window_no_longer_count():
    child = ready_child()
    # runs of 11 s: each restart comes after the first delay, the five at 11, 22.25, 33.5, 44.75 and 56 s
    decisions = crash_loop(child, now=0.0, run_s=11.0, times=POLICY.max_restarts)
    assert [d.delay for d in decisions] == [POLICY.first_delay] * POLICY.max_restarts
    child.started(decisions[-1].at)
    later = child.exited(72.0)  # the restart at 11 s has left the 60 s window
    assert isinstance(later, Restart) and later.recent == POLICY.max_restarts
