"""A client of the bus for tests and benchmarks: submit requests to a running stack, read their tokens.

It folds each request's `out:` stream by the same rules as the gateway (shared/out_stream.py), and
records any index that came twice with different tokens.
"""
from __future__ import annotations

import time
import uuid

import redis

from shared.bus import read_registry, registry_query
from shared.keys import FIELD, Keys
from shared.out_stream import OutOfOrder, OutputFold
from shared.protocol import Assignment, Request, SchedulerStats, TokenOutput, WorkerRegistration, decode, encode
from shared.sampling import SamplingParams
from shared.tenants import Tenant


class BusClient:
    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.url = url
        self.redis = redis.Redis.from_url(url, socket_timeout=10)
        self.cursors: dict[str, bytes | str] = {}
        self.folds: dict[str, OutputFold] = {}
        self.refused: list[str] = []  # entries the stream's rules refused, with why

    def reconnect(self) -> None:
        self.redis = redis.Redis.from_url(self.url, socket_timeout=10)

    def submit(self, prompt: list[int], params: SamplingParams, model: str = "tiny", gateway_id: str = "",
               tenant: Tenant = Tenant(), priority: int = 0) -> str:
        rid = uuid.uuid4().hex
        req = Request(rid, model, prompt, params, time.time(), gateway_id, tenant=tenant, priority=priority)
        self.redis.xadd(self.keys.requests, {FIELD: encode(req)})
        self.cursors[rid] = "0-0"
        self.folds[rid] = OutputFold(params.n, params.max_tokens)
        return rid

    def done(self, rid: str) -> bool:
        fold = self.folds[rid]
        return fold.ended or all(r is not None for r in fold.finish_reasons)

    @property
    def errors(self) -> dict[str, str]:
        return {rid: f.end.error or "" for rid, f in self.folds.items()
                if f.end is not None and f.end.finish_reason == "error"}

    @property
    def conflicts(self) -> list[str]:
        """Output indices that came twice with different tokens."""
        return [f"{rid}[{s}][{i}]" for rid, f in self.folds.items() for s, i in f.conflicts]

    def poll(self, block_ms: int = 200) -> None:
        pending = {self.keys.out(r): c for r, c in self.cursors.items() if not self.done(r)}
        if not pending:
            return
        for stream, entries in self.redis.xread(pending, block=block_ms) or []:
            for entry_id, fields in entries:
                out = decode(fields[FIELD.encode()], (TokenOutput, Assignment))
                self.cursors[out.rid] = entry_id
                try:
                    self.folds[out.rid].apply(out)
                except OutOfOrder as e:
                    self.refused.append(f"{out.rid}: {e}")

    def wait(self, rids: list[str], timeout: float = 120.0, stack=None) -> None:
        """Poll until every request ended; `stack.assert_alive()` (if given) fails fast on a dead process."""
        deadline = time.monotonic() + timeout
        while not all(self.done(r) for r in rids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(not self.done(r) for r in rids)} of {len(rids)} requests unfinished")
            if stack is not None:
                stack.assert_alive()
            try:
                self.poll()
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.2)
                self.reconnect()

    def output(self, rid: str, sample: int = 0) -> list[int]:
        return list(self.folds[rid].tokens[sample])

    def generated_count(self, rids: list[str]) -> int:
        return sum(len(s) for r in rids for s in self.folds[r].tokens)

    def workers(self) -> dict[str, tuple[WorkerRegistration, bool]]:
        """Every registered worker: its registration, and whether its heartbeat is alive."""
        return {w: (decode(payload, WorkerRegistration), alive)
                for w, payload, alive in read_registry(self.redis.eval(*registry_query(self.keys)))}

    def live_workers(self) -> list[str]:
        return sorted(w for w, (_, alive) in self.workers().items() if alive)

    def stats(self) -> SchedulerStats | None:
        raw = self.redis.get(self.keys.stats)
        return decode(raw, SchedulerStats) if raw else None

    def settled_stats(self, timeout: float = 30.0) -> SchedulerStats:
        """The first snapshot published after this call with nothing running or waiting: the one read right
        after a request ends may predate it, since the scheduler publishes stats on its housekeeping tick."""
        since = time.time()
        found: list[SchedulerStats] = []

        def settled() -> bool:
            s = self.stats()
            if s is not None and s.time > since and s.running == 0 and s.waiting == 0:
                found.append(s)
            return bool(found)
        self.wait_for(settled, "stats to settle", timeout)
        return found[0]

    def wait_for(self, predicate, what: str, timeout: float = 90.0, stack=None) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if stack is not None:
                stack.assert_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)
