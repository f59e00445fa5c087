"""What a per-worker scheduler reserves for a request beyond the blocks its tokens fill: `OnDemand` (the product:
nothing, blocks are allocated as tokens need them). Benchmarks pass contiguous-reservation baselines in its place
(benchmarks/baselines.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from scheduler.request import RequestState

if TYPE_CHECKING:  # the scheduler holds its reservation: a type only, never an import cycle at run time
    from scheduler.worker_scheduler import WorkerScheduler


class Reservation(Protocol):
    def admits(self, ws: WorkerScheduler, rs: RequestState, keep_free: int) -> bool:
        """Whether the request's reservation fits, leaving `keep_free` blocks free, before it is admitted."""

    def started(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """The request was admitted (waiting or recompute-preempted) and runs."""

    def forked(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """The request's samples forked from its first one (n > 1)."""


class OnDemand:
    """Nothing reserved: a sequence grows into new blocks as its tokens fill them."""

    def admits(self, ws: WorkerScheduler, rs: RequestState, keep_free: int) -> bool:
        return True

    def started(self, ws: WorkerScheduler, rs: RequestState) -> None:
        pass

    def forked(self, ws: WorkerScheduler, rs: RequestState) -> None:
        pass
