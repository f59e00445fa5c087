"""What the scheduler publishes about itself: the stats /metrics exports, every housekeeping tick, and, while a
dashboard watches, the cache snapshots it shows (scheduler/snapshot.py builds them, sans-IO)."""
from __future__ import annotations

import redis.asyncio

from scheduler.cluster import Cluster
from scheduler.snapshot import CacheMonitor
from shared.keys import Keys
from shared.protocol import StepPlan, encode

SNAPSHOT_TTL_MS = 5_000  # a dashboard shows no snapshot of a scheduler that stopped publishing


class Publisher:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self.monitor = CacheMonitor()
        self.watched = False  # whether a dashboard's watch key was alive at the last tick

    def planned(self, cluster: Cluster, plan: StepPlan) -> None:
        """A plan is going out: the monitor's history counts it."""
        self.monitor.planned(cluster, plan)

    async def publish(self, cluster: Cluster, now: float) -> None:
        """The stats and, while a dashboard watches (as of the last tick), the cache snapshot: both taken before
        anything else runs, so they agree."""
        snapshot = self.monitor.tick(cluster, now, self.watched)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.stats, encode(cluster.stats(now)))
            if snapshot is not None:
                pipe.set(self.keys.cache_snapshot, encode(snapshot), px=SNAPSHOT_TTL_MS)
            pipe.exists(self.keys.dashboard_watch)
            self.watched = bool((await pipe.execute())[-1])
