"""Admission (sans-IO): how much one call may ask for, who may join the requests waiting for their first
token, and how long those turned away should wait before they retry.

A call is admitted whole or not at all, and its own prompts count against the waiting limit before it is
admitted, so one large call cannot fill the queue for everyone. Under the fair policy a tenant within its share of
the queue joins it even when it is full, so that one tenant's backlog cannot fill it for everyone either
(shared/tenants.py). The wait advised with a 429 is the time the queue needs to drain far enough for the call
(shared/drain.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import bad_request, rate_limited
from shared.drain import Drain
from shared.protocol import SchedulerStats
from shared.tenants import Tenant, under_share


@dataclass(slots=True)
class Admission:
    max_waiting: int  # requests (one per prompt) that may wait for their first token at once
    max_call_tokens: int  # work one call may queue: prompts x n x (prompt tokens + max_tokens)
    waiting: int = 0  # requests admitted here that have not had their first token yet
    drain: Drain = field(default_factory=Drain)  # when recent ones got it

    def check_size(self, work: int) -> None:
        if work > self.max_call_tokens:
            raise bad_request(f"this call asks for {work} tokens of work (prompts x n x (prompt tokens + "
                              f"max_tokens)), over the limit of {self.max_call_tokens} per call "
                              "(max_call_tokens); send fewer prompts, a smaller n or max_tokens",
                              code="call_too_large")

    def admit(self, count: int, waiting_elsewhere: int, now: float, in_share: bool = False) -> None:
        """Reserve `count` places, or raise: 400 for a call that could never fit, 429 (with the wait to advise)
        while the queue is too full for it, unless its tenant is `in_share` (the fair policy: within its share of
        the queue; shared/tenants.py). `waiting_elsewhere` is the scheduler's own count, when fresh."""
        if count > self.max_waiting:
            raise bad_request(f"this call has {count} prompts; at most {self.max_waiting} requests may wait at "
                              "once (max_waiting_requests); split it", param="prompt", code="call_too_large")
        waiting = max(self.waiting, waiting_elsewhere)
        excess = waiting + count - self.max_waiting
        if excess > 0 and not in_share:
            raise rate_limited(f"{waiting} requests are waiting, the limit is {self.max_waiting}",
                               self.drain.retry_after(excess, now))
        self.waiting += count

    def within_share(self, stats: SchedulerStats, tenant: Tenant, count: int) -> bool:
        """Whether the tenant's requests waiting (the scheduler's count), `count` more included, stay within its
        share of the waiting limit under the fair policy (the scheduler's ledger, which has the last word, applies
        the same rule)."""
        held = next((t.waiting for t in stats.tenants if t.tenant == tenant.name), 0)
        weights = tenant.weight + sum(t.weight for t in stats.tenants if t.waiting and t.tenant != tenant.name)
        total = max(self.waiting, stats.waiting)
        return under_share(self.max_waiting, total, held, count, tenant.weight, weights)

    def first_token(self, now: float) -> None:
        """One admitted request got its first token: it leaves the queue."""
        self.waiting -= 1
        self.drain.left(now)

    def release(self, count: int) -> None:
        """Admitted requests that end without a first token (failed, aborted) give back their places."""
        self.waiting -= count
