"""Service processes on a real Redis for the service tests, each with its own log file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Stack:
    """A scheduler and named workers as child processes, each with its own log file."""
    redis_url: str
    model_dir: Path
    log_dir: Path
    settings: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PAGEDSERVE_REDIS_URL=self.redis_url, PAGEDSERVE_MODEL=str(self.model_dir),
                   PAGEDSERVE_HEARTBEAT_TTL="1.5", PAGEDSERVE_LOG_LEVEL="info", OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.update({f"PAGEDSERVE_{k.upper()}": v for k, v in self.settings.items()})
        return env

    def _spawn(self, name: str, module: str, *args: str) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=self._env(),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_scheduler(self, name: str = "scheduler") -> None:
        self._spawn(name, "scheduler")

    def start_worker(self, worker_id: str) -> None:
        self._spawn(worker_id, "gpu_worker", "--worker-id", worker_id)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def assert_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"processes died: {dead}\n" + "\n".join(self.log(n)[-3000:] for n in dead)

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
