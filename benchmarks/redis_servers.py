"""Local Redis servers as child processes, for tests and benchmarks: one `redis-server` with AOF in its own directory
(a restart keeps the data), and a Sentinel topology (a master, its replica and three Sentinels) to fail over."""
from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pagedserve.ports import free_port


class RedisUnavailable(RuntimeError):
    pass


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
    appendfsync: str = "always"  # the tests' choice; `pagedserve up` and compose keep Redis's everysec

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
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--protected-mode", "no"],
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
class SentinelTopology:
    """A master, its replica and three Sentinels (`redis-server --sentinel`) watching it as `master_name`, each a
    local child process; quick to fail over (a master silent for `down_after_ms` is down)."""
    workdir: Path
    master_name: str = "pagedserve"
    down_after_ms: int = 500
    appendfsync: str = "always"
    servers: list[LocalRedis] = field(default_factory=list)
    sentinels: list[subprocess.Popen] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def start(self) -> None:
        master = LocalRedis(self.workdir / "master", appendfsync=self.appendfsync)
        master.start()
        replica = LocalRedis(self.workdir / "replica", appendfsync=self.appendfsync)
        replica.start()
        redis.Redis(port=replica.port).replicaof("127.0.0.1", master.port)
        self.servers = [master, replica]
        for i in range(3):
            port = free_port()
            config = self.workdir / f"sentinel-{i}.conf"  # a Sentinel rewrites its config as it learns
            config.write_text(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.workdir}\n"
                              f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} 2\n"
                              f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                              f"sentinel failover-timeout {self.master_name} 5000\n")
            self.sentinels.append(subprocess.Popen([shutil.which("redis-server"), str(config), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.sentinel_ports.append(port)
        deadline = time.monotonic() + 20
        while self.master_port() != master.port or not self._replica_in_sync(replica):
            if time.monotonic() > deadline:
                raise RedisUnavailable("the Sentinels did not see the master and its replica within 20 s")
            time.sleep(0.1)

    def master_port(self) -> int | None:
        """The master's port as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                found = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(self.master_name)
            except redis.RedisError:
                continue
            if found:
                return int(found[1])
        return None

    def _replica_in_sync(self, replica: LocalRedis) -> bool:
        info = redis.Redis(port=replica.port, socket_timeout=1).info("replication")
        return info.get("master_link_status") == "up"

    def server(self, port: int) -> LocalRedis:
        return next(s for s in self.servers if s.port == port)

    def kill_master(self) -> int:
        """SIGKILL the current master; its port."""
        port = self.master_port()
        server = self.server(port)
        server.proc.kill()
        server.proc.wait()
        return port

    def replica(self) -> LocalRedis:
        """The running server that is not the master."""
        master = self.master_port()
        return next(s for s in self.servers if s.port != master and s.proc is not None and s.proc.poll() is None)

    def pause_replica(self) -> LocalRedis:
        """SIGSTOP the replica: it takes no more of the master's writes (nor answers anyone) until `resume`."""
        replica = self.replica()
        replica.proc.send_signal(signal.SIGSTOP)
        return replica

    @staticmethod
    def resume(server: LocalRedis) -> None:
        server.proc.send_signal(signal.SIGCONT)

    def clog_replication(self, nbytes: int = 32 << 20) -> None:
        """With the replica paused, fill the link to it past what the kernel's socket buffers hold: the master's
        writes after this stay in its own memory, and die with it (a paused replica would otherwise find them in
        its socket buffer when it resumes)."""
        master = redis.Redis(port=self.master_port())
        master.set("clog", b"x" * nbytes)
        master.delete("clog")

    def bring_back(self, port: int, timeout: float = 30.0) -> None:
        """Restart the server that listened on `port` (its AOF kept) and wait until it replicates the master the
        Sentinels made meanwhile, as they reconfigure a returning old master."""
        server = self.server(port)
        server.start()
        deadline = time.monotonic() + timeout
        while not self._replica_in_sync(server):
            if time.monotonic() > deadline:
                raise AssertionError(f"the server on port {port} did not rejoin as a replica within {timeout:.0f} s")
            time.sleep(0.1)

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a master other than `old_port`; its port."""
        deadline = time.monotonic() + timeout
        while (port := self.master_port()) in (None, old_port):
            if time.monotonic() > deadline:
                raise AssertionError(f"no failover from port {old_port} within {timeout:.0f} s")
            time.sleep(0.1)
        return port

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.terminate()
        for proc in self.sentinels:
            proc.wait(10)
        for server in self.servers:
            server.stop()
