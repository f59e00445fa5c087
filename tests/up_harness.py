"""`pagedserve up` as a subprocess for tests: start it, wait for its one `ready:` line, find its children by
their `started NAME (pid N)` lines and its private Redis by the config file it names, stop it."""
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

UP = [sys.executable, "-m", "pagedserve", "up"]
START_TIMEOUT_S = 600


def up_env() -> dict[str, str]:
    """The environment for `pagedserve up` in tests: one compute thread per process, no Redis URL (so that it
    starts its own)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_REDIS_URL", None)
    return env


def run_up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pagedserve up ARGS` to its end (for the cases where it stops by itself), with `env` over up_env()."""
    return subprocess.run([*UP, *args], capture_output=True, text=True, timeout=300, env=up_env() | (env or {}))


def private_redis_url(log: str) -> str:
    """The URL, password included, of the redis-server that the `up` which wrote `log` started."""
    config = Path(re.search(r"its config \(mode 0600, with the password\) is (\S+?),", log).group(1))
    text = config.read_text()
    port = re.search(r"^port (\d+)$", text, re.M).group(1)
    password = re.search(r"^requirepass (\S+)$", text, re.M).group(1)
    return f"redis://:{password}@127.0.0.1:{port}/0"


@dataclass(slots=True)
class Up:
    proc: subprocess.Popen
    log_path: Path
    lines: queue.Queue[str]  # stdout
    url: str = ""

    @classmethod
    def start(cls, args: list[str], log_path: Path) -> "Up":
        """Run `pagedserve up ARGS` and return once it printed `ready:` (fails with its log otherwise)."""
        with open(log_path, "wb") as err:
            proc = subprocess.Popen([*UP, *args], stdout=subprocess.PIPE, stderr=err, env=up_env(), text=True)
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
                    raise AssertionError(f"`pagedserve up` did not get ready (exit {proc.poll()}):\n{up.log()[-4000:]}")
        assert first.startswith("ready: http://"), first
        up.url = first.removeprefix("ready: ").strip()
        return up

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        """Each child's latest pid, by name."""
        return {name: int(pid) for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", self.log())}

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
