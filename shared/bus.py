"""Redis connections for the services: the timeouts, retries and backoff every service uses, to one server or to
the master Redis Sentinel names (shared/redis_target.py), followed across a failover and logged when it moves.

A failover can lose the writes the old master had not passed on, so a client whose state rests on what it wrote
(the scheduler's) is `fenced`: after a move its commands fail with MasterMoved, unsent, until it acknowledges the
move (`acknowledge_move`), having rebuilt that state from what the new master holds.

Blocking stream reads get their own client whose socket timeout outlasts the block time: redis-py 8
defaults `socket_timeout` to 5 s, which would cut a longer XREAD short. A client given `max_connections`
opens at most that many and makes a command wait for a free one, where redis-py's default pool fails
("Too many connections") under a burst.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.backoff import ExponentialBackoff

from shared.keys import FIELD, Keys
from shared.protocol import Message, ProtocolError, decode
from shared.redis_target import SentinelTarget, sentinel_target

BLOCK_MS = 1000  # longest blocking read; services wake at least this often to check their state
_TIMEOUT = 5.0
POOL_WAIT_S = 20.0  # how long a command waits for a free connection of a bounded pool before it fails
RECONNECT_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
log = logging.getLogger(__name__)
T = TypeVar("T")


def _options(blocking: bool, timeout: float = _TIMEOUT) -> dict:
    return dict(socket_timeout=timeout + (BLOCK_MS / 1000 if blocking else 0), socket_connect_timeout=timeout,
                health_check_interval=10, retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def connect(url: str, *, blocking: bool = False, timeout: float = _TIMEOUT, retries: int = 3) -> redis.Redis:
    """A client of the Redis `url` names: one server, or the master a `redis+sentinel://` URL's Sentinels name
    (a probe passes a short `timeout` and no `retries`)."""
    from redis.retry import Retry

    options = dict(retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries), **_options(blocking, timeout))
    target = sentinel_target(url)
    if target is None:
        return redis.Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    return Sentinel(_addresses(target), sentinel_kwargs=_sentinel_options(target)).master_for(
        target.master, connection_class=_FollowingConnection, password=target.password, db=target.db, **options)


class MasterMoved(redis.RedisError):
    """A fenced client's command, not sent: the master moved since the client last acknowledged a move."""


def connect_async(url: str, *, blocking: bool = False, max_connections: int | None = None,
                  fenced: bool = False) -> redis.asyncio.Redis:
    """As `connect`, for asyncio; `max_connections` bounds a single server's pool (a Sentinel target's pool is
    redis-py's own, which has no waiting bound); a `fenced` client stops at a failover (see MasterMoved)."""
    from redis.asyncio.retry import Retry

    options = dict(retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), **_options(blocking))
    target = sentinel_target(url)
    if target is not None:
        from redis.asyncio.sentinel import Sentinel

        client = Sentinel(_addresses(target), sentinel_kwargs=_sentinel_options(target)).master_for(
            target.master, connection_class=_FollowingAsyncConnection, password=target.password, db=target.db,
            **options)
        client.connection_pool.fenced = fenced
        return client
    if max_connections is None:
        return redis.asyncio.Redis.from_url(url, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                         **options)
    return redis.asyncio.Redis.from_pool(pool)


def _addresses(target: SentinelTarget) -> list[tuple[str, int]]:
    return [(e.host, e.port) for e in target.sentinels]


def _sentinel_options(target: SentinelTarget) -> dict:
    return dict(socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT, password=target.sentinel_password)


def _said_master(pool, address: tuple[str, int]) -> None:
    """Log the master the Sentinels name when it is not the one the client connected to before: a failover."""
    before = getattr(pool, "followed_master", None)  # on redis-py's pool (or its proxy): one per client
    if address != before:
        if before is not None:
            log.warning("Redis master %s moved from %s:%s to %s:%s (a Sentinel failover); following it",
                        pool.service_name, *before, *address)
            pool.failovers = failovers_followed_by(pool) + 1
            pool.move_unacknowledged = getattr(pool, "fenced", False)
        pool.followed_master = address


def failovers_followed_by(pool) -> int:
    """How often the clients of this connection pool have followed the master to a new address (0 for one server)."""
    return getattr(pool, "failovers", 0)


def acknowledge_move(client: redis.asyncio.Redis) -> bool:
    """Let a fenced client's commands through again, to the master it follows now; whether a move was pending."""
    pool = client.connection_pool
    pending = getattr(pool, "move_unacknowledged", False)
    pool.move_unacknowledged = False
    return pending


class _FollowingConnection(redis.sentinel.SentinelManagedConnection):
    def connect_to(self, address):
        super().connect_to(address)
        _said_master(self.connection_pool, address)

    def send_packed_command(self, command, check_health=True):
        # A connection the caller holds (the worker's plan reader and step publisher) connects on its first send,
        # and redis-py's send connects to the default host, not the master: ask the Sentinels first.
        if self._sock is None:
            self.connect()
        super().send_packed_command(command, check_health)


class _FollowingAsyncConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    async def connect_to(self, address):
        await super().connect_to(address)
        _said_master(self.connection_pool, address)

    async def send_packed_command(self, command, check_health=True):
        if not self.is_connected:  # connected first, so that a move it finds stops this very command
            await self.connect()
        if getattr(self.connection_pool, "move_unacknowledged", False):
            raise MasterMoved(f"the Redis master moved to {self.host}:{self.port}; not acknowledged yet")
        await super().send_packed_command(command, check_health)


@dataclass(slots=True)
class Backoff:
    """Delays for reconnect loops: doubling from `base` up to `cap`, reset after a success."""
    base: float = 0.05
    cap: float = 0.5  # a Sentinel failover or a Redis restart is taken up within half a second of its end
    current: float = 0.0

    def next(self) -> float:
        self.current = min(self.cap, self.current * 2 if self.current else self.base)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


def retry(action: Callable[[], T], what: str, stop: threading.Event | None = None) -> T | None:
    """Run `action` until Redis lets it through, backing off between tries; None if `stop` is set by then. A
    refused password is raised at once: waiting will not mend it."""
    backoff = Backoff()
    while True:
        try:
            return action()
        except redis.AuthenticationError:
            raise
        except RECONNECT_ERRORS as e:
            if stop is not None and stop.is_set():
                return None
            log.warning("%s failed, retrying: %s", what, e)
            time.sleep(backoff.next())


async def retry_async(action: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event | None = None) -> T | None:
    """`retry` for coroutines."""
    backoff = Backoff()
    while True:
        try:
            return await action()
        except redis.AuthenticationError:
            raise
        except RECONNECT_ERRORS as e:
            if stop is not None and stop.is_set():
                return None
            log.warning("%s failed, retrying: %s", what, e)
            await asyncio.sleep(backoff.next())


def decode_entry(stream: str, entry_id: bytes | str, fields: dict, expected: type | tuple[type, ...]) -> Message | None:
    """The message of one stream entry, or None (logged) when it is malformed: services never crash on input."""
    return decode_payload(stream, entry_id, fields.get(FIELD.encode(), fields.get(FIELD)), expected)


def decode_payload(stream: bytes | str, entry_id: bytes | str, payload: bytes | None,
                   expected: type | tuple[type, ...]) -> Message | None:
    """`decode_entry` for an entry's FIELD value (None: the entry has none)."""
    try:
        if payload is None:
            raise ProtocolError(f"entry has no {FIELD!r} field")
        return decode(payload, expected)
    except ProtocolError as e:
        log.warning("dropped malformed entry %s on %s: %s", _text(entry_id), _text(stream), e)
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Every registration with whether its worker's heartbeat key exists, in one round trip.
_REGISTRY = """
local out = {}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  out[#out + 1] = fields[i]
  out[#out + 1] = fields[i + 1]
  out[#out + 1] = redis.call('EXISTS', ARGV[1] .. fields[i])
end
return out
"""


def registry_query(keys: Keys) -> tuple:
    """The arguments of `client.eval` that reads the worker registry (sync and asyncio clients alike)."""
    return _REGISTRY, 1, keys.workers, keys.heartbeat("")


def read_registry(reply: list) -> list[tuple[str, bytes, bool]]:
    """(worker id, its encoded WorkerRegistration, whether its heartbeat is alive) from `registry_query`'s reply."""
    return [(_text(reply[i]), reply[i + 1], bool(reply[i + 2])) for i in range(0, len(reply), 3)]
