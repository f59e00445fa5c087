"""A real Redis for tests: `REDIS_URL`, else testcontainers if a Docker engine answers, else a local
`redis-server` binary on a free port. Servers this harness started can be stopped and restarted."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


class RedisUnavailable(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise RedisUnavailable(f"Redis at {url} did not answer within {timeout:.0f} s") from None
            time.sleep(0.05)


@dataclass(slots=True)
class LocalRedis:
    """A `redis-server` child process with AOF in its own directory, so a restart keeps the data."""
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    can_restart: bool = True

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisUnavailable("redis-server is not on the PATH")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(self.url)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


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
