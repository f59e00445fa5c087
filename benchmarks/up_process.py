"""`pagedserve up` as a subprocess, as a user runs it: start it, wait for its one `ready:` line, find its children
by their `started NAME (pid N)` log lines (and signal one by name), its gateways by that line and the log's `other
gateways at` line, and its private Redis by the config file it names, stop it. Used by the soak and by the tests
that drive the one-command stack."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.launcher import gateway_name

UP = [sys.executable, "-m", "pagedserve", "up"]
START_TIMEOUT_S = 600.0


def up_env() -> dict[str, str]:
    """The environment for `pagedserve up` here: one compute thread per process unless told otherwise (the
    processes share the cores), and no Redis URL, so that it starts its own."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PAGEDSERVE_REDIS_URL", None)
    return env


def private_redis_url(log: str) -> str:
    """The URL, password included, of the redis-server that the `up` which wrote `log` started."""
    config = Path(re.search(r"its config \(mode 0600, with the password\) is (\S+?),", log).group(1))
    text = config.read_text()
    port = re.search(r"^port (\d+)$", text, re.M).group(1)
    password = re.search(r"^requirepass (\S+)$", text, re.M).group(1)
    return f"redis://:{password}@127.0.0.1:{port}/0"


@dataclass(slots=True)
class UpProcess:
    """A running `pagedserve up`; its stderr (the stack's logs) in `log_path`."""
    proc: subprocess.Popen
    log_path: Path
    lines: queue.Queue[str]  # stdout
    url: str = ""

    @classmethod
    def start(cls, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> "UpProcess":
        """Run `pagedserve up ARGS` (with `env` over up_env()) and return once it printed `ready:` (RuntimeError with
        its log otherwise)."""
        with open(log_path, "wb") as err:
            proc = subprocess.Popen([*UP, *args], stdout=subprocess.PIPE, stderr=err, env=up_env() | (env or {}),
                                    text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        up = cls(proc, log_path, lines)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                first = lines.get(timeout=0.1)
                break
            except queue.Empty:
                if proc.poll() is not None or time.monotonic() > deadline:
                    up.stop()
                    raise RuntimeError(f"`pagedserve up` did not get ready (exit {proc.poll()}):\n{up.log()[-4000:]}")
        if not first.startswith("ready: http://"):
            up.stop()
            raise RuntimeError(f"`pagedserve up` printed {first!r} instead of `ready:`:\n{up.log()[-4000:]}")
        up.url = first.removeprefix("ready: ").strip()
        return up

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        """Each child's latest pid, by name."""
        return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", self.log())}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal child `name` (SIGKILL: a fault the launcher restarts it from); the pid signalled, so that a caller
        can tell its restart by a new one."""
        pid = self.pids()[name]
        os.kill(pid, sig)
        return pid

    def gateways(self) -> dict[str, str]:
        """Each gateway's URL by child name (`gateway`, `gateway-1`, ...), the first being `url`."""
        others = re.search(r"other gateways at (.+)$", self.log(), re.M)
        urls = [self.url, *(others.group(1).split(", ") if others else [])]
        return {gateway_name(i): url for i, url in enumerate(urls)}

    def redis_url(self) -> str:
        return private_redis_url(self.log())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
