"""The gateway's side of the Redis bus: submit requests, read their token streams, abort, read state."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from shared.bus import BLOCK_MS, RECONNECT_ERRORS, Backoff, connect_async, decode_entry
from shared.keys import CONTROL_MAXLEN, FIELD, Keys
from shared.protocol import Abort, ProtocolError, Request, SchedulerStats, TokenOutput, decode, encode

log = logging.getLogger(__name__)
READ_COUNT = 256
MAX_STREAMED_REQUESTS = 10_000


class Bus:
    def __init__(self, url: str, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.client = connect_async(url)
        # One connection per request being streamed: redis-py's default pool of 100 would cap concurrency.
        self.reader = connect_async(url, blocking=True, max_connections=MAX_STREAMED_REQUESTS)

    async def close(self) -> None:
        await self.client.aclose()
        await self.reader.aclose()

    async def submit(self, requests: list[Request]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:  # all of a call's prompts or none
            for req in requests:
                pipe.xadd(self.keys.requests, {FIELD: encode(req)})
            await pipe.execute()

    async def abort(self, rids: list[str], reason: str) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xadd(self.keys.control, {FIELD: encode(Abort(rid, reason))}, maxlen=CONTROL_MAXLEN,
                          approximate=True)
            await pipe.execute()

    async def outputs(self, rid: str, done: asyncio.Event) -> AsyncIterator[TokenOutput]:
        """Every TokenOutput of `rid` from the start of its stream, until the scheduler's request-level end
        entry or until `done` is set; waits out Redis restarts. The loop ends by itself rather than by
        cancellation alone: redis-py can swallow a cancel, and a reader left behind would hold its
        connection forever."""
        key = self.keys.out(rid)
        cursor: bytes | str = "0-0"
        backoff = Backoff()
        while not done.is_set():
            try:
                reply = await self.reader.xread({key: cursor}, count=READ_COUNT, block=BLOCK_MS)
            except RECONNECT_ERRORS as e:
                delay = backoff.next()
                log.warning("reading %s failed (%s); retrying in %.2f s", key, e, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    cursor = entry_id
                    out = decode_entry(key, entry_id, fields, TokenOutput)
                    if out is not None:
                        yield out
                        if out.sample_index == -1:
                            return

    async def live_workers(self) -> tuple[list[str], int]:
        """(ids of workers whose heartbeat key exists, number of registered workers)."""
        registered = [w.decode() for w in await self.client.hkeys(self.keys.workers)]
        if not registered:
            return [], 0
        async with self.client.pipeline(transaction=False) as pipe:
            for worker_id in registered:
                pipe.exists(self.keys.heartbeat(worker_id))
            alive = await pipe.execute()
        return sorted(w for w, up in zip(registered, alive) if up), len(registered)

    async def stats(self) -> SchedulerStats | None:
        """The scheduler's latest snapshot, or None if there is none (or it is unreadable)."""
        raw = await self.client.get(self.keys.stats)
        if raw is None:
            return None
        try:
            return decode(raw, SchedulerStats)
        except ProtocolError as e:
            log.warning("ignoring a malformed scheduler stats snapshot: %s", e)
            return None
