"""Admission (sans-IO): how much one call may ask for, who may join the requests waiting for their first
token, and how long those turned away should wait before they retry.

A call is admitted whole or not at all, and its own prompts count against the waiting limit before it is
admitted, so one large call cannot fill the queue for everyone. The wait advised with a 429 is the time the
queue needs to drain far enough for the call, at the rate requests left it lately, spread by jitter so the
clients turned away together do not all come back together.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from gateway.errors import ApiError, bad_request

RATE_WINDOW_S = 30.0  # departures older than this no longer count towards the rate
ASSUMED_RATE = 1.0  # requests/s before any has left the queue
MIN_RETRY_S = 0.5
MAX_RETRY_S = 40.0  # x1.5 jitter stays within the 60 s the openai client honours
JITTER = (0.5, 1.5)


@dataclass(slots=True)
class Admission:
    max_waiting: int  # requests (one per prompt) that may wait for their first token at once
    max_call_tokens: int  # work one call may queue: prompts x n x (prompt tokens + max_tokens)
    waiting: int = 0  # requests admitted here that have not had their first token yet
    departures: deque[float] = field(default_factory=deque)  # when recent ones got it
    rng: random.Random = field(default_factory=random.Random)

    def check_size(self, work: int) -> None:
        if work > self.max_call_tokens:
            raise bad_request(f"this call asks for {work} tokens of work (prompts x n x (prompt tokens + "
                              f"max_tokens)), over the limit of {self.max_call_tokens} per call "
                              "(max_call_tokens); send fewer prompts, a smaller n or max_tokens",
                              code="call_too_large")

    def admit(self, count: int, waiting_elsewhere: int, now: float) -> None:
        """Reserve `count` places, or raise: 400 for a call that could never fit, 429 (with the wait to advise)
        while the queue is too full for it. `waiting_elsewhere` is the scheduler's own count, when fresh."""
        if count > self.max_waiting:
            raise bad_request(f"this call has {count} prompts; at most {self.max_waiting} requests may wait at "
                              "once (max_waiting_requests); split it", param="prompt", code="call_too_large")
        waiting = max(self.waiting, waiting_elsewhere)
        excess = waiting + count - self.max_waiting
        if excess > 0:
            wait_ms = round(self.retry_after(excess, now) * 1000)
            # whole seconds from the same milliseconds, rounded up: the two headers never disagree
            raise ApiError(429, f"{waiting} requests are waiting, the limit is {self.max_waiting}; retry in "
                           f"{wait_ms / 1000:.1f} s", type="rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)})
        self.waiting += count

    def first_token(self, now: float) -> None:
        """One admitted request got its first token: it leaves the queue."""
        self.waiting -= 1
        self.departures.append(now)
        self._forget(now)

    def release(self, count: int) -> None:
        """Admitted requests that end without a first token (failed, aborted) give back their places."""
        self.waiting -= count

    def retry_after(self, excess: int, now: float) -> float:
        """Seconds for `excess` requests to leave the queue at the recent rate, bounded, with jitter."""
        self._forget(now)
        if self.departures:
            rate = len(self.departures) / max(now - self.departures[0], 1.0)
        else:
            rate = ASSUMED_RATE
        base = min(max(excess / rate, MIN_RETRY_S), MAX_RETRY_S)
        return base * self.rng.uniform(*JITTER)

    def _forget(self, now: float) -> None:
        while self.departures and self.departures[0] < now - RATE_WINDOW_S:
            self.departures.popleft()
