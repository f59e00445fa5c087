"""Redis connections for the services: the timeouts, retries and backoff every service uses.

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
from redis.backoff import ExponentialBackoff

from shared.keys import FIELD, Keys
from shared.protocol import Message, ProtocolError, decode

BLOCK_MS = 1000  # longest blocking read; services wake at least this often to check their state
_TIMEOUT = 5.0
POOL_WAIT_S = 20.0  # how long a command waits for a free connection of a bounded pool before it fails
RECONNECT_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
log = logging.getLogger(__name__)
T = TypeVar("T")


def _options(blocking: bool) -> dict:
    return dict(socket_timeout=_TIMEOUT + (BLOCK_MS / 1000 if blocking else 0), socket_connect_timeout=_TIMEOUT,
                health_check_interval=10, retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def connect(url: str, *, blocking: bool = False) -> redis.Redis:
    from redis.retry import Retry

    return redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), **_options(blocking))


def connect_async(url: str, *, blocking: bool = False, max_connections: int | None = None) -> redis.asyncio.Redis:
    from redis.asyncio.retry import Retry

    options = dict(retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), **_options(blocking))
    if max_connections is None:
        return redis.asyncio.Redis.from_url(url, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                                         **options)
    return redis.asyncio.Redis.from_pool(pool)


@dataclass(slots=True)
class Backoff:
    """Delays for reconnect loops: doubling from `base` up to `cap`, reset after a success."""
    base: float = 0.05
    cap: float = 2.0
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
