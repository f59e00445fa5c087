"""How fast requests leave a queue lately, and so how long those turned away should wait before they retry.

The wait is the time the queue needs to drain far enough, at the rate requests left it lately, spread by jitter
so that the clients turned away together do not all come back together. The gateway keeps one for its waiting
places, the scheduler one per tenant.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 30.0  # departures older than this no longer count towards the rate
ASSUMED_RATE = 1.0  # requests/s before any has left the queue
MIN_RETRY_S = 0.5
MAX_RETRY_S = 40.0  # x1.5 jitter stays within the 60 s the openai client honours
JITTER = (0.5, 1.5)


@dataclass(slots=True)
class Drain:
    departures: deque[float] = field(default_factory=deque)  # when recent requests left the queue
    rng: random.Random = field(default_factory=random.Random)

    def left(self, now: float) -> None:
        """One request left the queue."""
        self.departures.append(now)
        self._forget(now)

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
