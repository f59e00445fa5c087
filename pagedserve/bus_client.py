"""A client of the bus for tests and benchmarks: submit requests to a running stack, read their tokens.

It reads each request's `out:` stream as the gateway does, skipping indices already seen, and records
any index that came twice with different tokens.
"""
from __future__ import annotations

import time
import uuid

import redis

from shared.keys import FIELD, Keys
from shared.protocol import Request, SchedulerStats, TokenOutput, WorkerRegistration, decode, encode
from shared.sampling import SamplingParams


class BusClient:
    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.url = url
        self.redis = redis.Redis.from_url(url, socket_timeout=10)
        self.cursors: dict[str, bytes | str] = {}
        self.tokens: dict[str, dict[int, dict[int, int]]] = {}
        self.finish: dict[str, dict[int, str]] = {}
        self.errors: dict[str, str] = {}
        self.n: dict[str, int] = {}
        self.conflicts: list[str] = []

    def reconnect(self) -> None:
        self.redis = redis.Redis.from_url(self.url, socket_timeout=10)

    def submit(self, prompt: list[int], params: SamplingParams, model: str = "tiny") -> str:
        rid = uuid.uuid4().hex
        req = Request(rid, model, prompt, params, time.time())
        self.redis.xadd(self.keys.requests, {FIELD: encode(req)})
        self.cursors[rid] = "0-0"
        self.tokens[rid] = {i: {} for i in range(params.n)}
        self.finish[rid] = {}
        self.n[rid] = params.n
        return rid

    def done(self, rid: str) -> bool:
        return rid in self.errors or len(self.finish[rid]) == self.n[rid]

    def poll(self, block_ms: int = 200) -> None:
        pending = {self.keys.out(r): c for r, c in self.cursors.items() if not self.done(r)}
        if not pending:
            return
        for stream, entries in self.redis.xread(pending, block=block_ms) or []:
            for entry_id, fields in entries:
                out = decode(fields[FIELD.encode()], TokenOutput)
                self.cursors[out.rid] = entry_id
                if out.sample_index < 0:  # the scheduler ended the request
                    if out.finish_reason == "error":
                        self.errors[out.rid] = out.error or ""
                    for i in range(self.n[out.rid]):
                        self.finish[out.rid].setdefault(i, out.finish_reason or "abort")
                    continue
                seen = self.tokens[out.rid][out.sample_index]
                if seen.get(out.output_index, out.token_id) != out.token_id:
                    self.conflicts.append(f"{out.rid}[{out.sample_index}][{out.output_index}]")
                seen.setdefault(out.output_index, out.token_id)
                if out.finish_reason:
                    self.finish[out.rid][out.sample_index] = out.finish_reason

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
        """The sample's tokens; fails if an index is missing."""
        seen = self.tokens[rid][sample]
        assert sorted(seen) == list(range(len(seen))), f"missing output indices in {rid}[{sample}]"
        return [seen[i] for i in range(len(seen))]

    def generated_count(self, rids: list[str]) -> int:
        return sum(len(s) for r in rids for s in self.tokens[r].values())

    def workers(self) -> dict[str, WorkerRegistration]:
        raw = self.redis.hgetall(self.keys.workers)
        return {k.decode(): decode(v, WorkerRegistration) for k, v in raw.items()}

    def live_workers(self) -> list[str]:
        return sorted(w for w in self.workers() if self.redis.exists(self.keys.heartbeat(w)))

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
