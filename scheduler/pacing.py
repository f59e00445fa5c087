"""How far ahead of its worker a per-worker scheduler plans: one plan in flight (`Synchronous`), or one more planned
while the worker computes it (`Lookahead`, async scheduling).

A lookahead plans as if each sequence sampled in the step in flight had its coming token already: one placeholder
each, whose id the worker fills in itself (it runs plans in order, and results come back in order, so blocks freed
meanwhile are reused only by later plans). A sequence counts the tokens its plans in flight sample whatever the
pacing (`SeqState.num_placeholders`: with one plan in flight, there are none when the next is made), and each plan
takes it to its `RequestState.target`. A lookahead preempts no running request to grow another: short of blocks,
it ends there, and the worker's pipeline drains before the full step that makes room. Admission's preemption for a
request that outranks a running one (scheduler/policy.py) it makes by recompute, the victim's token in flight
counting when it comes back (scheduler/worker_scheduler.py); where that cannot be (swap), the pipeline drains too.
Nor is a plan made behind one in which a sequence checks a draft (speculative decoding): how many tokens that
sequence ends the step with is known only from its result.

Requests that arrive after the lookahead went out join it (StepPlan.joins): a plan of their admissions alone, which
the worker runs in the same step if it has not begun the lookahead yet, so that an urgent request waits at most the
step in flight; joins count as no step of their own here.

Given a clock (the scheduler service's), a lookahead is planned late: shortly before the step in flight is due to
end, so that requests arriving meanwhile join the very next step instead of the one after it. How long a step takes
is learnt from the worker's last steps (`StepTimes`); with no clock (the in-process engine), or before a step has been
timed, it is planned at once.
"""
from __future__ import annotations

from collections import deque

# The lookahead goes out this share of a step before the step is due to end: room for planning it, the bus and a
# busy loop. A worker kept waiting for one adds its wait to that lead for the next WAITS_KEPT steps.
LEAD_SHARE = 0.25
STEPS_TIMED = 8  # the estimate is the shortest of the last steps: a step planned too early costs only latency
WAITS_KEPT = 64


class Synchronous:
    """One plan in flight: the next is planned once its result is in."""

    def may_plan(self, num_in_flight: int, drafting: bool, now: float | None = None) -> bool:
        """Whether a plan may be made now (`drafting`: the last plan in flight lets a sequence check a draft;
        `now`: the caller's clock, if it has one)."""
        return num_in_flight == 0

    def due(self, num_in_flight: int, drafting: bool) -> float | None:
        """When a plan not allowed now falls due by the clock alone (None: not by the clock)."""
        return None

    def may_join(self, num_in_flight: int, now: float | None) -> bool:
        """Whether requests that came after the last plan may join it (shared/protocol.py: StepPlan.joins): a
        lookahead the worker may not have begun yet."""
        return False

    def planned(self, now: float | None, behind: bool) -> bool:
        """A plan was made (`behind`: another is in flight). Whether it is a lookahead, whose wait the worker
        reports comes from planning it late."""
        return behind

    def step_ended(self, now: float | None, late: float, next_in_flight: bool) -> None:
        """The oldest step's result came in; it was a lookahead the worker had waited `late` seconds for
        (`next_in_flight`: the worker computes the plan after it now)."""

    def may_make_room(self, num_in_flight: int) -> bool:
        """The step needs a preemption (a running request's chunks do not fit, or admission's victim cannot leave while
        a step computes its tokens): may it preempt (True), or must it end here?"""
        return True


class Lookahead:
    """At most one plan ahead of the one the worker computes, its sequences counting their tokens in flight."""

    def __init__(self) -> None:
        self.draining = False  # short of blocks while a plan was in flight: the next plan waits for the pipeline
        self.times = StepTimes()

    def may_plan(self, num_in_flight: int, drafting: bool, now: float | None = None) -> bool:
        if not num_in_flight:
            self.draining = False
            return True
        if not self._may_look_ahead(num_in_flight, drafting):
            return False
        self.times.held = now is not None and now < self.times.lookahead_due()
        return not self.times.held

    def due(self, num_in_flight: int, drafting: bool) -> float | None:
        return self.times.lookahead_due() if self._may_look_ahead(num_in_flight, drafting) else None

    def may_join(self, num_in_flight: int, now: float | None) -> bool:
        # (Without a clock, the in-process engine, the worker has begun each plan by the time the next is made.)
        return now is not None and num_in_flight == 2

    def _may_look_ahead(self, num_in_flight: int, drafting: bool) -> bool:
        return num_in_flight == 1 and not self.draining and not drafting

    def planned(self, now: float | None, behind: bool) -> bool:
        if behind:
            return True
        late = self.times.missed_at is not None  # the lookahead the clock held, planned after the step ended
        self.times.began(now)
        return late

    def step_ended(self, now: float | None, late: float, next_in_flight: bool) -> None:
        self.times.ended(now, late)
        if next_in_flight:
            self.times.began(now)

    def may_make_room(self, num_in_flight: int) -> bool:
        if not num_in_flight:
            return True
        self.draining = True
        return False


class StepTimes:
    """How long a worker's steps take, on the scheduler's clock, and so when the lookahead behind the step in flight
    falls due."""

    def __init__(self) -> None:
        self.began_at: float | None = None  # when the step in flight began (None: no clock, or not timed)
        self.lengths: deque[float] = deque(maxlen=STEPS_TIMED)
        self.waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self.held = False  # the clock held back the lookahead behind the step in flight
        self.missed_at: float | None = None  # ...and the step ended first, at this time: the next plan is that one

    def began(self, now: float | None) -> None:
        """A step began: now, or, for a lookahead planned after the step before it ended, when that one ended (the
        worker's wait for it is taken off at its result)."""
        self.began_at = self.missed_at if self.missed_at is not None else now
        self.missed_at = None

    def ended(self, now: float | None, late: float) -> None:
        """A step's result came in at `now`: its length is the time since it began, less the `late` seconds the
        worker then waited for its plan (a lookahead made too late)."""
        self.waits.append(late)
        if now is not None and self.began_at is not None:
            self.lengths.append(now - self.began_at - late)
        self.began_at = None
        self.missed_at = now if self.held else None
        self.held = False

    def lookahead_due(self) -> float:
        """When the lookahead behind the step in flight falls due: the step's expected end less a lead (at once
        while the step is untimed)."""
        if self.began_at is None or not self.lengths:
            return float("-inf")
        length = min(self.lengths)
        return self.began_at + length - LEAD_SHARE * length - max(self.waits, default=0.0)
