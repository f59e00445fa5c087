"""A real Redis for tests: `REDIS_URL`, else testcontainers if a Docker engine answers, else a local
`redis-server` binary on a free port (benchmarks/redis_servers.py, with the Sentinel topology). Servers this harness
started can be stopped and restarted."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.redis_servers import LocalRedis, RedisUnavailable, SentinelTopology, wait_ready
from pagedserve.ports import free_port

__all__ = ["LocalRedis", "RedisUnavailable", "SentinelTopology", "free_port", "open_server", "wait_ready"]


@dataclass(slots=True)
class ContainerRedis:
    """Redis in a container (testcontainers), bound to a fixed host port so a restart keeps the URL."""
    container: object
    port: int
    can_restart: bool = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.container.get_wrapped_container().start()
        wait_ready(self.url)

    def stop(self) -> None:
        self.container.get_wrapped_container().stop()

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass(slots=True)
class ExternalRedis:
    """A server named by REDIS_URL: used as it is, never stopped."""
    url: str
    can_restart: bool = False

    def start(self) -> None:
        wait_ready(self.url)

    def stop(self) -> None:
        raise RedisUnavailable("the REDIS_URL server is not ours to stop")

    def restart(self) -> None:
        self.stop()


def docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:  # no client config, no socket, engine down: all mean "no Docker here"
        return False


def start_container() -> ContainerRedis:
    from testcontainers.redis import RedisContainer

    port = free_port()
    container = RedisContainer().with_bind_ports(6379, port).with_command("redis-server --appendonly yes")
    container.start()
    server = ContainerRedis(container, port)
    wait_ready(server.url)
    return server


def open_server(workdir: Path) -> LocalRedis | ContainerRedis | ExternalRedis:
    """The test server: REDIS_URL, else testcontainers, else a local binary; raises RedisUnavailable with the
    reason if none works."""
    if os.environ.get("REDIS_URL"):
        server = ExternalRedis(os.environ["REDIS_URL"])
        server.start()
        return server
    if docker_answers():
        return start_container()
    server = LocalRedis(workdir)
    server.start()
    return server
