"""The gateway's side of the Redis bus: submit requests, read their token streams, abort, read state, and
keep this gateway's heartbeat."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import TypeVar

from shared.bus import (
    BLOCK_MS, RECONNECT_ERRORS, Backoff, connect_async, decode_payload, read_registry, registry_query, retry_async,
)
from shared.keys import CONTROL_MAXLEN, FIELD, Keys
from shared.protocol import Abort, Assignment, ProtocolError, Request, SchedulerStats, TokenOutput, decode, encode

log = logging.getLogger(__name__)
READ_COUNT = 256
FIELD_KEY = FIELD.encode()
T = TypeVar("T")
WAKE_MAXLEN = 100
WAKE_TTL_MS = 3_600_000  # a gateway that dies leaves its wake stream for an hour at most


@dataclass(slots=True)
class Follower:
    """Where the entries of one followed `out:` stream go: `(tag, [TokenOutput | Assignment, ...])` into `queue`,
    one item per read of the stream, so its reader wakes once for all the entries a read brought."""
    queue: asyncio.Queue
    tag: int
    cursor: bytes = b"0-0"


class Bus:
    """The gateway's bus. One task reads every followed token stream with one blocking XREAD (one Redis
    connection however many requests stream) and routes each entry to its request's queue; a submission
    also writes this gateway's wake stream, which that XREAD includes, so new streams join it at once.
    Everything else shares a pool of at most `max_connections`, where a burst waits for a free one."""

    def __init__(self, url: str, max_connections: int, heartbeat_ttl: float, keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.heartbeat_ttl = heartbeat_ttl
        self.instance = uuid.uuid4().hex  # the requests' gateway_id; names this gateway's keys
        self.client = connect_async(url, max_connections=max_connections)
        self.reader = connect_async(url, blocking=True)
        # The XREAD reply as Redis sends it: redis-py's parsing builds a dict per entry, then a list out of the
        # reply's map, on every token.
        self.reader.set_response_callback("XREAD", lambda reply, **_: reply)
        # Stream names as bytes, as XREAD replies give them: nothing to encode or decode per read.
        self.wake_key = self.keys.gateway_wake(self.instance).encode()
        self.alive_key = self.keys.gateway_alive(self.instance)
        self.wake_cursor = b"0-0"
        self.followed: dict[bytes, Follower] = {}
        self.followed_changed = asyncio.Event()
        self.router: asyncio.Task | None = None
        self.heartbeat: asyncio.Task | None = None
        # Set by `close`: the loops end on it even where a Redis call they were in swallowed their cancellation
        # (redis-py's does now and then), which would otherwise keep them, and the gateway's shutdown, going.
        self.closed = asyncio.Event()

    def start(self) -> None:
        """Start this gateway's heartbeat: refreshed every heartbeat_ttl/4 until `close`. While the key exists,
        the scheduler keeps the requests whose gateway_id is this instance."""
        self.heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        self.closed.set()
        self.followed_changed.set()
        for task in (self.router, self.heartbeat):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        try:
            await self.client.delete(self.wake_key, self.alive_key)  # the scheduler aborts what is left at once
        except RECONNECT_ERRORS:
            pass
        await self.client.aclose()
        await self.reader.aclose()

    async def _beat(self) -> None:
        ttl_ms = max(int(self.heartbeat_ttl * 1000), 1)
        while not self.closed.is_set():  # waits out Redis restarts
            await retry_async(lambda: self.client.set(self.alive_key, b"1", px=ttl_ms), "the gateway heartbeat",
                              self.closed)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.closed.wait(), self.heartbeat_ttl / 4)

    async def submit(self, requests: list[Request]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:  # all of a call's prompts or none
            for req in requests:
                pipe.xadd(self.keys.requests, {FIELD: encode(req)})
            pipe.xadd(self.wake_key, {FIELD: b""}, maxlen=WAKE_MAXLEN, approximate=True)
            pipe.pexpire(self.wake_key, WAKE_TTL_MS)
            await pipe.execute()

    async def abort(self, rids: list[str], reason: str) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xadd(self.keys.control, {FIELD: encode(Abort(rid, reason))}, maxlen=CONTROL_MAXLEN,
                          approximate=True)
            await pipe.execute()

    def follow(self, rid: str, queue: asyncio.Queue, tag: int) -> None:
        """Route every entry of `rid`'s stream, from its start, into `queue` as `(tag, entries)`, until
        the scheduler's request-level end entry (the last one routed) or `unfollow`. Follow before submitting,
        so that the submission's wake reaches a read that includes the stream."""
        self.followed[self.keys.out(rid).encode()] = Follower(queue, tag)
        self.followed_changed.set()
        if self.router is None or self.router.done():
            self.router = asyncio.get_running_loop().create_task(self._route())

    def unfollow(self, rids: list[str]) -> None:
        for rid in rids:
            self.followed.pop(self.keys.out(rid).encode(), None)

    async def _route(self) -> None:
        """Read all followed streams until the gateway closes; waits out Redis restarts. Anything else fails
        the requests followed now (their handlers answer 500); the next `follow` starts a new router."""
        try:
            await self._route_forever()
        except Exception as e:
            log.exception("the token stream router failed")
            for follower in self.followed.values():
                follower.queue.put_nowait((follower.tag, e))
            self.followed.clear()

    async def _route_forever(self) -> None:
        backoff = Backoff()
        while not self.closed.is_set():
            if not self.followed:
                self.followed_changed.clear()
                await self.followed_changed.wait()
                continue
            streams = {self.wake_key: self.wake_cursor} | {k: f.cursor for k, f in self.followed.items()}
            try:
                reply = await self.reader.xread(streams, count=READ_COUNT, block=BLOCK_MS)
            except RECONNECT_ERRORS as e:
                delay = backoff.next()
                log.warning("reading token streams failed (%s); retrying in %.2f s", e, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            # RESP3 (redis-py's default) sends a map of stream to entries, RESP2 a list of [stream, entries].
            for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
                if key == self.wake_key:
                    self.wake_cursor = entries[-1][0]
                    continue
                follower = self.followed.get(key)
                if follower is None:
                    continue
                follower.cursor = entries[-1][0]
                outs = []
                for entry_id, fields in entries:
                    out = decode_payload(key, entry_id, _payload(fields), (TokenOutput, Assignment))
                    if out is None:
                        continue
                    outs.append(out)
                    if isinstance(out, TokenOutput) and out.sample_index == -1:
                        del self.followed[key]
                        break
                if outs:
                    follower.queue.put_nowait((follower.tag, outs))

    async def live_workers(self) -> tuple[list[str], int]:
        """(ids of workers whose heartbeat key exists, number of registered workers)."""
        registry = read_registry(await self.client.eval(*registry_query(self.keys)))
        return sorted(w for w, _, alive in registry if alive), len(registry)

    async def stats(self) -> SchedulerStats | None:
        """The scheduler's latest snapshot, or None if there is none (or it is unreadable)."""
        return decode_or_none(await self.client.get(self.keys.stats), SchedulerStats, "scheduler stats snapshot")

    async def dashboard_state(self, watch_ttl_ms: int) -> tuple[bytes | None, list[str]]:
        """In one round trip: keep the dashboard's watch key alive (the scheduler publishes cache snapshots while
        it lives); the latest encoded cache snapshot, or None; the ids of workers whose heartbeat key exists."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.dashboard_watch, b"1", px=watch_ttl_ms)
            pipe.get(self.keys.cache_snapshot)
            pipe.eval(*registry_query(self.keys))
            _, raw, registry = await pipe.execute()
        return raw, sorted(w for w, _, alive in read_registry(registry) if alive)


def _payload(fields: list | None) -> bytes | None:
    """The FIELD value of an entry's raw `[field, value, ...]` list; None if it has none."""
    for i in range(0, len(fields or ()) - 1, 2):
        if fields[i] == FIELD_KEY:
            return fields[i + 1]
    return None


def decode_or_none(raw: bytes | None, cls: type[T], what: str) -> T | None:
    """A snapshot the scheduler keeps in Redis, or None if there is none (or it is unreadable: logged)."""
    if raw is None:
        return None
    try:
        return decode(raw, cls)
    except ProtocolError as e:
        log.warning("ignoring a malformed %s: %s", what, e)
        return None
