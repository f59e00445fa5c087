"""When a child of `pagedserve up` is ready, seen from the outside: redis-server answers PING, the scheduler holds its
lease, a worker's heartbeat is alive, a gateway answers /health."""
from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pagedserve.supervision import Child
from shared.keys import Keys


def _health(url: str) -> int | None:
    """The status /health answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


@dataclass(frozen=True, slots=True)
class Observed:
    """What one look at the stack saw."""
    ready: frozenset[str]  # names of the children that are ready
    serving: bool  # every gateway answered /health with 200 (it does once a worker is alive)


@dataclass(slots=True)
class Readiness:
    """Which children are ready, from the outside: redis-server answers PING, the scheduler holds its lease, a
    worker's heartbeat is alive, a gateway answers /health at its URL (`gateway_urls`, by child name)."""
    redis_url: str
    gateway_urls: dict[str, str]
    keys: Keys = field(default_factory=Keys)

    def check(self, children: list[Child]) -> Observed:
        import redis

        from shared.bus import connect

        ready: set[str] = set()
        on_redis = [c for c in children if c.spec.kind in ("redis", "scheduler", "worker")]
        try:
            client = connect(self.redis_url, timeout=1.0, retries=0)
            with client:
                pipe = client.pipeline(transaction=False)
                for child in on_redis:
                    if child.spec.kind == "redis":
                        pipe.ping()
                    elif child.spec.kind == "scheduler":
                        pipe.exists(self.keys.scheduler_lease)
                    else:
                        pipe.exists(self.keys.heartbeat(child.name))
                ready |= {c.name for c, ok in zip(on_redis, pipe.execute()) if ok}
        except (redis.RedisError, OSError):
            pass
        health = {c.name: _health(self.gateway_urls[c.name]) for c in children if c.spec.kind == "gateway"}
        ready |= {name for name, status in health.items() if status is not None}
        serving = set(health) == set(self.gateway_urls) and all(status == 200 for status in health.values())
        return Observed(frozenset(ready), serving)
