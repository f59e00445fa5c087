"""When `pagedserve up` restarts a child that exited, and when it gives up: sans-IO, time passed in.

As compose's `restart: unless-stopped`, any exit is restarted, exit code 0 included: only stopping the
whole stack stops a child. The delay doubles from `first_delay` to `max_delay` while the child keeps
dying soon after it starts, and a run of `stable_after` seconds resets it (Docker resets after 10 s).
Unlike compose, it gives up, and the launcher stops the stack, when a child cannot start at all: it
exits before it was ever ready, or it needs more than `max_restarts` restarts within `window` seconds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_delay: float = 0.25
    max_delay: float = 8.0
    stable_after: float = 10.0
    max_restarts: int = 5
    window: float = 60.0

    def describe(self) -> str:
        return f"at most {self.max_restarts} restarts per {self.window:.0f} s"


@dataclass(frozen=True, slots=True)
class Restart:
    at: float  # when to start the child again
    delay: float
    recent: int  # restarts within the window, this one included


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


@dataclass(slots=True)
class ChildRestarts:
    """One child's history: when it last started, whether it was ever ready, its recent restarts."""
    policy: RestartPolicy
    started_at: float
    ever_ready: bool = False
    delay: float = 0.0
    restarts: deque[float] = field(default_factory=deque)

    def started(self, now: float) -> None:
        self.started_at = now

    def ready(self) -> None:
        self.ever_ready = True

    def exited(self, now: float) -> Restart | GiveUp:
        policy = self.policy
        if not self.ever_ready:
            return GiveUp("it exited before it was ever ready")
        while self.restarts and self.restarts[0] <= now - policy.window:
            self.restarts.popleft()
        if len(self.restarts) >= policy.max_restarts:
            return GiveUp(f"it exited {len(self.restarts) + 1} times within {policy.window:.0f} s "
                          f"({policy.describe()})")
        stable = now - self.started_at >= policy.stable_after
        self.delay = policy.first_delay if stable or not self.delay else min(policy.max_delay, self.delay * 2)
        self.restarts.append(now)
        return Restart(now + self.delay, self.delay, len(self.restarts))
