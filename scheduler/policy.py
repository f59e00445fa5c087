"""The scheduling policies (`settings.scheduling_policy`): the order in which a worker's scheduler admits its
preempted and waiting requests.

- `fcfs`: preempted requests first, then waiting ones, each in arrival order.
- `priority`: both together, by the request's priority (lower first), then arrival; requests carry that rank, so
  running ones are planned and preempted by it too, and a request that outranks the last running one preempts it
  to be admitted (scheduler/worker_scheduler.py).
- `fair`: each time the first request (preempted before waiting) of the tenant whose virtual token counter is least
  (scheduler/ledger.py; on a tie, the one running fewer sequences per weight), the counters read again after every
  admission. A request that does not fit preempts the worker's latest request of the tenant furthest over its
  weighted share of the cluster's sequences (every worker's `max_num_seqs`, split by weight among the tenants with
  requests), when its own tenant is within its share once seated: without that a light tenant's request waits for a
  heavy one to finish, however low its counter. Shares count every worker's sequences, as the counters do: a tenant
  whose requests happen to crowd one worker is not held to that worker's part of its share. Shares, not counters,
  decide it, and the victim's tenant was over its share, so it cannot preempt back: while weights and workers stay
  as they are, two tenants never preempt each other back and forth.
  Nor does the cache trade them back: the victim goes behind the request it made room for, so that growing, which
  preempts the last-ranked running request, takes the victim again if anything (scheduler/worker_scheduler.py).

A policy's `victim(ws, head)` names the running request to preempt so that `head`, one of the first
`heads_per_step` requests to admit, fits beside those before it, or None: then `head` waits, and those after it.
Under priority every request that outranks a running one makes room in the step it comes to (two urgent arrivals
within one step both start in the next); under fair the first alone, as shares move with every admission.
"""
from __future__ import annotations

import heapq
import sys
from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING, Iterator

from scheduler.ledger import Ledger
from scheduler.request import RequestState

if TYPE_CHECKING:  # a policy reads its scheduler's queues: a type only, never an import cycle at run time
    from scheduler.worker_scheduler import WorkerScheduler

RANK = attrgetter("rank")


class Fcfs:
    heads_per_step = 1

    def order(self, ws: WorkerScheduler) -> Iterator[RequestState]:
        yield from list(ws.preempted)
        yield from list(ws.waiting)

    def victim(self, ws: WorkerScheduler, head: RequestState) -> RequestState | None:
        return None


class Priority:
    heads_per_step = sys.maxsize

    def order(self, ws: WorkerScheduler) -> Iterator[RequestState]:
        yield from heapq.merge(list(ws.preempted), list(ws.waiting), key=RANK)

    def victim(self, ws: WorkerScheduler, head: RequestState) -> RequestState | None:
        last = ws.running[-1]
        return last if last.rank[0] > head.rank[0] else None


class Fair:
    heads_per_step = 1

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def order(self, ws: WorkerScheduler) -> Iterator[RequestState]:
        by_tenant: dict[str, deque[RequestState]] = {}
        for rs in (*ws.preempted, *ws.waiting):
            by_tenant.setdefault(rs.tenant, deque()).append(rs)
        counter, use = self.ledger.counter, self.ledger.seat_use
        while by_tenant:
            # A tenant back from idle starts level with the busy ones: the one using less of its share goes first.
            name = min(by_tenant, key=lambda t: (counter(t), use(t), by_tenant[t][0].rank))
            queue = by_tenant[name]
            yield queue.popleft()
            if not queue:
                del by_tenant[name]

    def victim(self, ws: WorkerScheduler, head: RequestState) -> RequestState | None:
        ledger = self.ledger
        share = ledger.seat_share()
        if ledger.seat_use(head.tenant, len(head.live_samples)) > share:
            return None  # seated, its tenant would be over its share too
        over = [rs for rs in ws.running if ledger.seat_use(rs.tenant) > share]
        return max(over, key=lambda rs: (ledger.seat_use(rs.tenant), rs.rank), default=None)


def policy_for(name: str, ledger: Ledger) -> Fcfs | Priority | Fair:
    if name == "priority":
        return Priority()
    if name == "fair":
        return Fair(ledger)
    return Fcfs()
