"""Where the services' Redis is: one server (`redis://`, `rediss://`, `unix://`, as redis-py reads them), or the
master that Redis Sentinel names, followed across a failover.

    redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB][?sentinel_password=...]

PASSWORD is the master's (and its replicas'); Sentinels that require one of their own take `sentinel_password`.
A client made from a Sentinel target asks the Sentinels for the master on every new connection, so after a
failover its next command reaches the new master without a restart.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


class RedisTargetError(ValueError):
    """A Redis URL pagedserve cannot use; the message says why (and never holds the password)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    sentinels: tuple[Endpoint, ...]
    master: str
    db: int = 0
    password: str | None = None
    sentinel_password: str | None = None


def sentinel_target(url: str) -> SentinelTarget | None:
    """The Sentinel target `url` names, or None for a plain Redis URL."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    password = unquote(userinfo.partition(":")[2]) if userinfo else None
    sentinels = tuple(_endpoint(h) for h in hosts.split(",") if h)
    if not sentinels:
        raise RedisTargetError(f"{SENTINEL_SCHEME}:// URL names no Sentinel (HOST:PORT[,HOST:PORT...])")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise RedisTargetError(f"{SENTINEL_SCHEME}:// URL needs /MASTER or /MASTER/DB after the Sentinels")
    db = path[1] if len(path) == 2 else "0"
    if not db.isdigit():
        raise RedisTargetError(f"{SENTINEL_SCHEME}:// URL: the database must be a number, got {db!r}")
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise RedisTargetError(f"{SENTINEL_SCHEME}:// URL: unknown option(s) {', '.join(sorted(unknown))}; "
                               "the one option is sentinel_password")
    sentinel_password = query.get("sentinel_password", [None])[-1]
    return SentinelTarget(sentinels, unquote(path[0]), int(db), password or None, sentinel_password)


def _endpoint(text: str) -> Endpoint:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", str(DEFAULT_SENTINEL_PORT))
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisTargetError(f"{SENTINEL_SCHEME}:// URL: {text!r} is not HOST:PORT")
    return Endpoint(host, int(port))
