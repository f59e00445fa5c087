"""Cache snapshots for the dashboard (sans-IO): every worker's KV blocks as bytes, its queues, and its last
minutes of steps.

The scheduler service tells the monitor of each plan it sends (`planned`: O(1) plus two sums over the plan's
sequences) and calls `tick` on its housekeeping tick, which closes a history sample every HISTORY_INTERVAL_S and,
while a dashboard watches, builds a snapshot every SNAPSHOT_INTERVAL_S, or less often for caches of over
MAX_BLOCKS_PER_S / 2 blocks in all: building reads the id of every block a table holds and of every hashed
block, so the rate bound keeps it to a few percent of the scheduler's time (RESULTS.md: Scheduler overhead). `states` and
`ref_counts` take a byte per block, and the list of which requests hold which blocks stops at
MAX_HOLDER_ENTRIES, so a 100k-block cache's snapshot stays under a megabyte.
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from scheduler.cluster import Cluster
from scheduler.request import Status
from scheduler.worker_scheduler import WorkerScheduler
from shared.protocol import (
    BLOCK_CACHED, BLOCK_FREE, BLOCK_MOVING, BLOCK_NULL, BLOCK_SHARED, BLOCK_USED, CacheSnapshot, StepPlan,
    WorkerHistory, WorkerSnapshot,
)

SNAPSHOT_INTERVAL_S = 0.5
MAX_BLOCKS_PER_S = 100_000  # blocks snapshotted per second, all workers together
HISTORY_INTERVAL_S = 1.0
HISTORY_LEN = 300  # five minutes of samples
MAX_HOLDER_ENTRIES = 1 << 16  # (request, block) pairs per worker: 256 KiB of block ids
_NUM_NEW = attrgetter("num_new_tokens")


@dataclass(slots=True)
class _Steps:
    """Sums over the steps planned since the last history sample."""
    steps: int = 0
    seqs: int = 0
    tokens: int = 0
    sampled: int = 0


@dataclass(slots=True)
class _Worker:
    """What the monitor keeps of one worker scheduler (a new one, after a restart or a re-registration, starts
    afresh)."""
    ws: WorkerScheduler
    history: WorkerHistory = field(default_factory=WorkerHistory)
    steps: _Steps = field(default_factory=_Steps)
    moves: deque[tuple[int, list[int]]] = field(default_factory=deque)  # (step id, device blocks copied/swapped)
    prefix_seen: tuple[int, int] = (0, 0)  # (queries, hits) at the last sample


class CacheMonitor:
    def __init__(self) -> None:
        self.workers: dict[str, _Worker] = {}
        self.history_time: deque[float] = deque(maxlen=HISTORY_LEN)
        self.history_workers: deque[int] = deque(maxlen=HISTORY_LEN)
        self.last_sample: float | None = None
        self.next_snapshot = 0.0

    def planned(self, cluster: Cluster, plan: StepPlan) -> None:
        """A plan the service is sending (the worker scheduler has just put it in flight)."""
        ws = cluster.workers.get(plan.worker_id)
        if ws is None:
            return
        w = self._worker(ws)
        steps = w.steps
        steps.steps += 1
        steps.seqs += plan.num_sequences
        steps.tokens += sum(map(_NUM_NEW, plan.scheduled)) + len(plan.decodes.seq_ids)
        # (The service sends a plan and the lookahead behind it together: each counts its own flight's samples.)
        steps.sampled += next(f for f in ws.in_flight if f.step_id == plan.step_id).num_sampling()
        if plan.copies or plan.swap_in or plan.swap_out:
            first = ws.in_flight[0].step_id
            while w.moves and w.moves[0][0] < first:
                w.moves.popleft()
            w.moves.append((plan.step_id, [b for pair in plan.copies for b in pair] + [d for d, _ in plan.swap_out]
                            + [d for _, d in plan.swap_in]))

    def tick(self, cluster: Cluster, now: float, watched: bool) -> CacheSnapshot | None:
        """Take a history sample when one is due; a snapshot when a dashboard watches and one is due."""
        if self.last_sample is None or now - self.last_sample >= HISTORY_INTERVAL_S:
            self._sample(cluster, now)
        if not watched or now < self.next_snapshot:
            return None
        num_blocks = sum(ws.stats().num_blocks + 1 for ws in cluster.workers.values())  # + the null block
        self.next_snapshot = now + max(SNAPSHOT_INTERVAL_S, num_blocks / MAX_BLOCKS_PER_S)
        return self.snapshot(cluster, now)

    def snapshot(self, cluster: Cluster, now: float) -> CacheSnapshot:
        return CacheSnapshot(now, HISTORY_INTERVAL_S, [self._worker_snapshot(ws) for ws in cluster.workers.values()],
                             list(self.history_time), list(self.history_workers), len(cluster.unplaced),
                             cluster.tenant_stats())

    def _worker(self, ws: WorkerScheduler) -> _Worker:
        w = self.workers.get(ws.worker_id)
        if w is None or w.ws is not ws:
            w = self.workers[ws.worker_id] = _Worker(ws)
        return w

    def _sample(self, cluster: Cluster, now: float) -> None:
        self.last_sample = now
        self.history_time.append(now)
        self.history_workers.append(len(cluster.workers))
        self.workers = {wid: w for wid, w in self.workers.items() if cluster.workers.get(wid) is w.ws}
        for ws in cluster.workers.values():
            w = self._worker(ws)
            h, s, stats = w.history, w.steps, ws.stats()
            queries, hits = stats.prefix_queries, stats.prefix_hits
            for column, value in ((h.steps, s.steps), (h.seqs, s.seqs), (h.tokens, s.tokens),
                                  (h.sampled, s.sampled), (h.prefix_queries, queries - w.prefix_seen[0]),
                                  (h.prefix_hits, hits - w.prefix_seen[1]), (h.running, len(ws.running)),
                                  (h.waiting, len(ws.waiting)), (h.preempted, len(ws.preempted))):
                column.append(value)
                if len(column) > HISTORY_LEN:
                    del column[0]
            w.steps = _Steps()
            w.prefix_seen = (queries, hits)

    def _worker_snapshot(self, ws: WorkerScheduler) -> WorkerSnapshot:
        w = self._worker(ws)
        view, stats = ws.snapshot(), ws.stats()
        n = view.num_blocks
        # Every device table, running requests in order: a block's reference count is the number of tables
        # that hold it. numpy does the per-block work.
        spans: list[tuple[str, int, int, bool]] = []  # (rid, start, end in `ids`, several sequences)
        tables: list[int] = []
        for held in view.running:
            start = len(tables)
            tables += held.block_ids
            spans.append((held.rid, start, len(tables), held.several))
        ids = _ids(tables)
        refs = np.bincount(ids, minlength=n)
        states = np.where(refs == 0, BLOCK_FREE, np.where(refs == 1, BLOCK_USED, BLOCK_SHARED)).astype(np.uint8)
        cached = _ids(view.cached_block_ids)
        states[cached[refs[cached] == 0]] = BLOCK_CACHED
        if view.has_null_block:
            states[0] = BLOCK_NULL
        in_flight = {f.step_id for f in ws.in_flight}
        moving = [b for step_id, blocks in w.moves if step_id in in_flight for b in blocks]
        if moving:
            states[moving] |= BLOCK_MOVING
        rids, counts, held_ids, complete = _holders(ids, spans)
        return WorkerSnapshot(
            ws.worker_id, ws.reg.block_size, states.tobytes(), np.minimum(refs, 255).astype(np.uint8).tobytes(),
            len(ws.running), len(ws.waiting), len(ws.preempted),
            sum(rs.status is Status.SWAPPED for rs in ws.preempted), stats.running, stats.prefix_queries,
            stats.prefix_hits, view.num_swap_blocks, view.free_swap_blocks, rids, counts, held_ids, complete,
            _copy(w.history), stats.drafts, stats.draft_tokens, stats.accepted_tokens)


def _ids(block_ids: list[int]) -> np.ndarray:
    # Through an array is about three times faster than np.fromiter.
    return np.frombuffer(array("q", block_ids), np.int64)


def _holders(ids: np.ndarray, spans: list[tuple[str, int, int, bool]]) -> tuple[list[str], list[int], bytes, bool]:
    """Each running request and the distinct blocks its sequences hold (a table holds a block once; samples of
    one request share some), up to MAX_HOLDER_ENTRIES pairs; and whether all of them fit."""
    rids: list[str] = []
    counts: list[int] = []
    parts: list[np.ndarray] = []
    total = 0
    for rid, start, end, several in spans:
        held = np.unique(ids[start:end]) if several else ids[start:end]
        if total + len(held) > MAX_HOLDER_ENTRIES:
            break
        rids.append(rid)
        counts.append(len(held))
        parts.append(held)
        total += len(held)
    blocks = np.concatenate(parts).astype("<u4").tobytes() if parts else b""
    return rids, counts, blocks, len(rids) == len(spans)


def _copy(h: WorkerHistory) -> WorkerHistory:
    return WorkerHistory(*(list(getattr(h, name)) for name in WorkerHistory.__slots__))
