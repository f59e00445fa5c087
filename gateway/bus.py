"""The gateway's side of the Redis bus: submit requests, read their token streams, abort, read state, and
keep this gateway's heartbeat."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from gateway.records import CallRecord, ResponseRecord, request_id
from gateway.replication import ReplicaGate

from shared.bus import (
    BLOCK_MS, RECONNECT_ERRORS, Backoff, connect_async, decode_payload, failovers_followed_by, read_registry,
    registry_query, retry_async,
)
from shared.keys import CONTROL_MAXLEN, FIELD, Keys
from shared.protocol import Abort, Assignment, ProtocolError, Request, SchedulerStats, TokenOutput, decode, encode

log = logging.getLogger(__name__)
READ_COUNT = 256
FIELD_KEY = FIELD.encode()
T = TypeVar("T")
WAKE_MAXLEN = 100
WAKE_TTL_MS = 3_600_000  # a gateway that dies leaves its wake stream for an hour at most
# Aborts each request whose reader key still holds the token of the connection that gave it up: a client that
# reconnected meanwhile, to any gateway, has put another there. KEYS: control, then the readers; ARGV: token, maxlen,
# field, then each request's encoded Abort.
RELEASE = """
local aborted = 0
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[3], ARGV[i + 2])
    aborted = aborted + 1
  end
end
return aborted
"""


@dataclass(slots=True)
class Follower:
    """Where the entries of one followed `out:` stream go: `(tag, [TokenOutput | Assignment, ...])` into `queue`,
    one item per read of the stream, so its reader wakes once for all the entries a read brought."""
    queue: asyncio.Queue
    tag: int
    cursor: bytes = b"0-0"


@dataclass(frozen=True, slots=True)
class Resumable:
    """What a streamed call leaves in Redis so that any gateway can pick its stream up: the token of the connection
    that streams it now, and its record under its id (a stored response has its own); kept `ttl` seconds at most."""
    call_id: str
    record: CallRecord | None
    reader: str
    ttl: float


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response's record, kept `ttl` seconds, in a store of at most `bound` responses."""
    response_id: str
    record: ResponseRecord
    ttl: float
    bound: int


class Bus:
    """The gateway's bus. One task reads every followed token stream with one blocking XREAD (one Redis
    connection however many requests stream) and routes each entry to its request's queue; a submission
    also writes this gateway's wake stream, which that XREAD includes, so new streams join it at once.
    Everything else shares a pool of at most `max_connections`, where a burst waits for a free one. What a client
    is shown, and the writes it is told of, wait for the master's replicas (`gate`, gateway/replication.py)."""

    def __init__(self, url: str, max_connections: int, heartbeat_ttl: float, gate: ReplicaGate,
                 keys: Keys | None = None) -> None:
        self.keys = keys or Keys()
        self.heartbeat_ttl = heartbeat_ttl
        self.alive_ttl_ms = max(int(heartbeat_ttl * 1000), 1)
        self.gate = gate
        self.instance = uuid.uuid4().hex  # the requests' gateway_id; names this gateway's keys
        self.client = connect_async(url, max_connections=max_connections)
        # The router's one connection: its reads and the replicas' wait meet one master (gateway/replication.py),
        # and an XREAD reply is taken as Redis sends it (redis-py's parsing builds a dict per entry, then a list out
        # of the reply's map, on every token).
        self.reader = connect_async(url, blocking=True)
        self.read_connection = self.reader.connection_pool.make_connection()
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

    def failovers_followed(self) -> int:
        """Redis master moves (Sentinel failovers) this gateway's clients followed: the most either one saw."""
        return max(failovers_followed_by(self.client.connection_pool),
                   failovers_followed_by(self.reader.connection_pool))

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
            # the scheduler aborts what is left once the reconnect grace period is over
            await self.client.delete(self.wake_key, self.alive_key)
        except RECONNECT_ERRORS:
            pass
        await self.client.aclose()
        await self.read_connection.disconnect()
        await self.reader.aclose()

    async def _beat(self) -> None:
        while not self.closed.is_set():  # waits out Redis restarts
            await retry_async(lambda: self.client.set(self.alive_key, b"1", px=self.alive_ttl_ms),
                              "the gateway heartbeat", self.closed)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.closed.wait(), self.heartbeat_ttl / 4)

    async def _durably(self, write: Callable[[], Awaitable[T]]) -> T:
        """Run `write`, then wait until the replicas hold it; run it again if the master moved meanwhile, as the old
        one may have lost it (every write passed here can be made twice)."""
        if not self.gate.wanted:
            return await write()
        pool = self.client.connection_pool
        while True:
            moves = failovers_followed_by(pool)
            result = await write()
            await self._replicated_on_pool([])
            if failovers_followed_by(pool) == moves:
                return result
            log.info("the Redis master moved before its replicas held a write; writing it again")

    async def _replicated(self, conn, commands: list[tuple], reuse: bool = False) -> list:
        """The replies of `commands` on `conn`, once the master's replicas hold all they returned (and everything
        written before): gateway/replication.py. A broken connection raises; the caller reads again. With `reuse`
        (the router's steady state), the wait for as many replicas as the last ROLE named goes in the same round
        trip, unless the connection is new (then its master may be a new one, with replicas of its own)."""
        gate = self.gate
        if not gate.wanted:
            return await _run(conn, commands)
        ahead = min(gate.wanted, max(gate.replicas, 0)) if reuse and conn.is_connected else 0
        wait = [("SET", self.alive_key, b"1", "PX", self.alive_ttl_ms), ("WAIT", ahead, gate.timeout_ms)]
        replies = await _run(conn, [*commands, ("ROLE",), *(wait if ahead else ())])
        acks = replies[-1] if ahead else 0
        required = gate.required(replies[len(commands)])
        if required > ahead:  # the first read on this connection, or a replica more than the last ROLE named
            wait[-1] = ("WAIT", required, gate.timeout_ms)
            acks = (await _run(conn, wait[1:] if ahead else wait))[-1]
        if required:
            gate.waited(acks, required)
        return replies[:len(commands)]

    async def _replicated_on_pool(self, commands: list[tuple]) -> list:
        """`_replicated` on a connection of the shared pool."""
        pool = self.client.connection_pool
        conn = await pool.get_connection()
        try:
            return await self._replicated(conn, commands)
        finally:
            await pool.release(conn)

    def reader_token(self) -> str:
        """A token for one client connection of this gateway, for the reader keys of the requests it streams."""
        return self.keys.reader_token(self.instance, uuid.uuid4().hex)

    async def submit(self, requests: list[Request], resumable: Resumable | None = None,
                     stored: Stored | None = None) -> None:
        """Queue a call's requests (all of its prompts or none), with what makes its stream resumable and a stored
        response's record: a record never names requests that were not queued. Queued twice after a failover, a
        request runs once (the scheduler drops a second entry of a request it has)."""
        await self._durably(lambda: self._queue(requests, resumable, stored))
        if stored is not None:
            await self._bound_store(stored)

    async def _queue(self, requests: list[Request], resumable: Resumable | None, stored: Stored | None) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            for req in requests:
                pipe.xadd(self.keys.requests, {FIELD: encode(req)})
            if resumable is not None:
                ttl_ms = int(resumable.ttl * 1000)
                if resumable.record is not None:
                    key = self.keys.call(resumable.call_id)
                    pipe.hset(key, mapping=resumable.record.mapping())
                    pipe.pexpire(key, ttl_ms)
                for req in requests:
                    pipe.set(self.keys.reader(req.rid), resumable.reader, px=ttl_ms)
            if stored is not None:
                key = self.keys.response(stored.response_id)
                pipe.hset(key, mapping=stored.record.mapping())
                pipe.pexpire(key, int(stored.ttl * 1000))
                pipe.zadd(self.keys.responses, {stored.response_id: time.time()})  # finer than created's seconds
            pipe.xadd(self.wake_key, {FIELD: b""}, maxlen=WAKE_MAXLEN, approximate=True)
            pipe.pexpire(self.wake_key, WAKE_TTL_MS)
            await pipe.execute()

    async def load_call(self, call_id: str) -> CallRecord | None:
        raw = await self.client.hgetall(self.keys.call(call_id))
        try:
            return CallRecord.from_mapping(raw) if raw else None
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            log.warning("ignoring the malformed record of call %s: %s", call_id, e)
            return None

    async def _bound_store(self, stored: Stored) -> None:
        """Past the bound, the oldest stored responses go, with their streams (a running one aborted)."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.keys.responses, "-inf", f"({time.time() - stored.ttl}")  # expired already
            pipe.zcard(self.keys.responses)
            count = (await pipe.execute())[-1]
        if count <= stored.bound:
            return
        evicted = [i.decode() for i, _ in await self.client.zpopmin(self.keys.responses, count - stored.bound)]
        async with self.client.pipeline(transaction=False) as pipe:
            for response_id in evicted:
                self._forget(pipe, response_id, "evicted")
            await pipe.execute()
        log.info("the response store is full (%d); deleted the %d oldest", stored.bound, len(evicted))

    def _forget(self, pipe, response_id: str, reason: str) -> None:
        rid = request_id(response_id)
        pipe.delete(self.keys.response(response_id), self.keys.out(rid), self.keys.reader(rid))
        pipe.zrem(self.keys.responses, response_id)
        pipe.xadd(self.keys.control, {FIELD: encode(Abort(rid, reason))}, maxlen=CONTROL_MAXLEN, approximate=True)

    async def load_response(self, response_id: str) -> ResponseRecord | None:
        raw = await self.client.hgetall(self.keys.response(response_id))
        try:
            return ResponseRecord.from_mapping(raw) if raw else None
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            log.warning("ignoring the malformed record of response %s: %s", response_id, e)
            return None

    async def delete_response(self, response_id: str) -> None:
        """Forget a response (aborting its request, if it still runs)."""
        async def forget() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                self._forget(pipe, response_id, "deleted")
                await pipe.execute()
        await self._durably(forget)

    async def read_out(self, rid: str) -> list[TokenOutput | Assignment]:
        """A request's `out:` stream as it is now."""
        key = self.keys.out(rid)
        (reply,) = await self._replicated_on_pool([("XRANGE", key, "-", "+")])
        entries = [decode_payload(key, entry_id, _payload(fields), (TokenOutput, Assignment))
                   for entry_id, fields in reply]
        return [e for e in entries if e is not None]

    async def take_up(self, rids: list[str], reader: str) -> bool:
        """Make `reader` the connection that streams these requests now; False if any has no reader key left (its
        stream expired)."""
        async def take() -> bool:
            async with self.client.pipeline(transaction=True) as pipe:
                for rid in rids:
                    pipe.set(self.keys.reader(rid), reader, xx=True, keepttl=True)
                return all(await pipe.execute())
        return await self._durably(take)

    async def end_call(self, call_id: str, ttl: float) -> None:
        """A call answered whole keeps its record as long as its requests' streams are kept."""
        await self.client.pexpire(self.keys.call(call_id), int(ttl * 1000))

    async def abort(self, rids: list[str], reason: str) -> None:
        async def write() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for rid in rids:
                    pipe.xadd(self.keys.control, {FIELD: encode(Abort(rid, reason))}, maxlen=CONTROL_MAXLEN,
                              approximate=True)
                await pipe.execute()
        await self._durably(write)

    async def release(self, rids: list[str], reader: str, reason: str) -> int:
        """Abort those of `rids` that `reader` still streams (no client took them up since); how many."""
        keys = [self.keys.control] + [self.keys.reader(rid) for rid in rids]
        args = [reader, CONTROL_MAXLEN, FIELD] + [encode(Abort(rid, reason)) for rid in rids]
        return int(await self._durably(lambda: self.client.eval(RELEASE, len(keys), *keys, *args)))

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
                (reply,) = await self._replicated(self.read_connection, [
                    ("XREAD", "COUNT", READ_COUNT, "BLOCK", BLOCK_MS, "STREAMS", *streams, *streams.values())],
                    reuse=True)
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


async def _run(conn, commands: list[tuple]) -> list:
    """`commands` in one round trip on `conn`, their replies in order; on any failure the connection is closed (its
    replies may be half read) and the error raised."""
    try:
        await conn.send_packed_command(conn.pack_commands(commands))
        return [await conn.read_response() for _ in commands]
    except BaseException:
        await conn.disconnect()
        raise


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
