"""Admission without I/O: a call's own prompts count before it is admitted, a call that could never fit is a
400 not a 429, under fair a tenant within its share joins a full queue, and the wait advised with a 429 follows how
fast the queue drains, spread by jitter."""
from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from gateway.admission import Admission
from gateway.errors import ApiError
from shared.drain import MAX_RETRY_S, Drain
from shared.protocol import SchedulerStats, TenantStats
from shared.tenants import Tenant


def admission(max_waiting: int = 1024, waiting: int = 0) -> Admission:
    return Admission(max_waiting, 1 << 20, waiting=waiting, drain=Drain(rng=random.Random(0)))


def status_of(action) -> int:
    try:
        action()
    except ApiError as e:
        return e.status
    return 200


def test_a_call_counts_its_own_prompts_before_it_is_admitted():
    a = admission(waiting=1000)
    assert status_of(lambda: a.admit(30, 0, 0.0)) == 429, "1,000 waiting + 30 > 1,024"
    assert a.waiting == 1000, "a refused call reserves nothing"
    assert status_of(lambda: a.admit(24, 0, 0.0)) == 200 and a.waiting == 1024
    assert status_of(lambda: a.admit(1, 0, 0.0)) == 429
    assert status_of(lambda: admission().admit(1, 1024, 0.0)) == 429, "the scheduler's own count counts too"


def test_under_fair_a_tenant_within_its_share_of_the_waiting_limit_joins_a_full_queue():
    """The scheduler's count: heavy holds 6 of the 8 places, light 2; light, of weight 3 in the 4 of the tenants
    waiting, may hold 6, heavy 2."""
    stats = SchedulerStats(0.0, 0, 8, 0, 0, tenants=[TenantStats("heavy", 6, 0, 0), TenantStats("light", 2, 0, 0, 3.0)])
    a = admission(max_waiting=8)
    light, heavy = Tenant("light", weight=3.0), Tenant("heavy")
    assert a.within_share(stats, light, 4) and not a.within_share(stats, light, 5)
    assert not a.within_share(stats, heavy, 1)
    assert a.within_share(stats, Tenant("new"), 1), "a tenant with nothing waiting: 8 x 1 / 5"
    assert not a.within_share(dataclasses.replace(stats, waiting=16), light, 1), "never past twice the limit"
    assert status_of(lambda: a.admit(4, 8, 0.0, in_share=True)) == 200 and a.waiting == 4
    assert status_of(lambda: a.admit(1, 8, 0.0)) == 429


def test_a_call_larger_than_the_queue_or_the_work_cap_is_a_400():
    assert status_of(lambda: admission(max_waiting=8).admit(9, 0, 0.0)) == 400
    assert status_of(lambda: admission().check_size(1 << 20)) == 200
    with pytest.raises(ApiError) as e:
        admission().check_size((1 << 20) + 1)
    assert e.value.status == 400 and "max_call_tokens" in e.value.message


def advised(a: Admission, excess: int, now: float, count: int = 200) -> list[float]:
    waits = []
    for _ in range(count):
        a.waiting = a.max_waiting + excess - 1
        with pytest.raises(ApiError) as e:
            a.admit(1, 0, now)
        ms = int(e.value.headers["retry-after-ms"])
        assert int(e.value.headers["Retry-After"]) == -(-ms // 1000)
        waits.append(ms / 1000)
    return waits


def test_the_advised_wait_follows_the_drain_rate_with_jitter():
    a = admission(max_waiting=10)
    for i in range(30):  # 10 requests/s got their first token over the last 3 s
        a.waiting += 1
        a.first_token(100.0 + i / 10)
    fast = advised(a, 20, 103.0)  # 20 to drain at 10/s: 2 s
    assert all(1.0 <= w <= 3.0 for w in fast) and 1.8 <= statistics.mean(fast) <= 2.2
    assert statistics.stdev(fast) > 0.4, "jitter spreads the retries"
    slow = advised(a, 20, 140.0)  # nothing left the queue in the last 30 s: the assumed 1/s
    assert all(10.0 <= w <= 30.0 for w in slow)
    assert max(advised(a, 10**6, 140.0)) <= 1.5 * MAX_RETRY_S <= 60, "within what the openai client honours"
