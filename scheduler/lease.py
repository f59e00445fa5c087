"""The scheduler's lease in Redis: one scheduler serves at a time; another stands by until the key expires."""
from __future__ import annotations

import asyncio
import logging

import redis.asyncio

from shared.bus import RECONNECT_ERRORS, Backoff, MasterMoved

log = logging.getLogger("scheduler")
# Renew the lease only while we still hold it (a plain SET could steal it back from a successor).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return false
"""


class Lease:
    def __init__(self, client: redis.asyncio.Redis, key: str, holder: str, ttl_ms: int) -> None:
        self.client = client
        self.key = key
        self.holder = holder
        self.ttl_ms = ttl_ms

    async def acquire(self, stop: asyncio.Event) -> None:
        """Wait until the lease is ours (or `stop` is set)."""
        backoff = Backoff(cap=1.0)
        waiting_logged = False
        while not stop.is_set():
            try:
                if await self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms):
                    return
            except RECONNECT_ERRORS as e:
                log.warning("Redis unreachable, retrying: %s", e)
            if not waiting_logged:
                log.info("another scheduler holds the lease; standing by")
                waiting_logged = True
            await asyncio.sleep(backoff.next())

    async def renew(self) -> bool:
        """Extend the lease; False if another scheduler holds it now."""
        return bool(await self.client.eval(_RENEW, 1, self.key, self.holder, self.ttl_ms))

    async def release(self) -> None:
        try:
            if await self.client.get(self.key) == self.holder.encode():
                await self.client.delete(self.key)
        except (*RECONNECT_ERRORS, MasterMoved):
            pass
