"""The processes of a local stack: how each child starts (and starts again), is signalled, reaped and stopped, and
the lines the launcher says about them on stderr."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_worker.cpu_setup import format_cores, stack_placement
from shared.settings import ENV_PREFIX, Settings

STOP_TIMEOUT_S = 15.0


def say(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def settings_env(settings: Settings) -> dict[str, str]:
    env = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        env[ENV_PREFIX + f.name.upper()] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher itself dies without stopping us (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class ChildSpec:
    """How to start one child, the first time and each restart."""
    name: str
    kind: str  # "redis", "scheduler", "worker" or "gateway": how to tell that it is ready
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None  # appended to across restarts; None = our stderr


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    started_at: float  # time.monotonic()

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(slots=True)
class Stack:
    """The stack's processes by name. Services' output goes to stderr, or with `log_dir` to one file per
    child (`<name>.log`, appended across restarts under the same name); redis-server's to its directory."""
    settings: Settings
    log_dir: Path | None = None
    children: dict[str, Child] = field(default_factory=dict)
    redis_dir: Path | None = None
    stopping: bool = False
    scheduler_module: str = "scheduler"  # benchmarks run baselines' schedulers in the same stack

    def spawn(self, spec: ChildSpec) -> Child:
        out = sys.stderr if spec.log_path is None else open(spec.log_path, "ab")
        try:
            proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=out.fileno(),
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        finally:
            if out is not sys.stderr:
                out.close()
        child = self.children[spec.name] = Child(spec, proc, time.monotonic())
        say(f"started {spec.name} (pid {proc.pid})")
        return child

    def service(self, name: str, kind: str, module: str, env: dict[str, str] | None = None) -> ChildSpec:
        """`python -m module` with the settings as PAGEDSERVE_* variables (plus `env`)."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **settings_env(self.settings)) | (env or {})
        log_path = None if self.log_dir is None else self.log_dir / f"{name}.log"
        return ChildSpec(name, kind, [sys.executable, "-m", module], full_env, log_path)

    def start_scheduler(self, name: str = "scheduler") -> None:
        self.spawn(self.service(name, "scheduler", self.scheduler_module))

    def start_worker(self, worker_id: str, index: int, workers: int) -> None:
        """Start worker `index` of the `workers` this machine runs (its share of the cores depends on both)."""
        env = {ENV_PREFIX + "WORKER_ID": worker_id}
        if self.settings.compute_threads == 0 and not self.settings.cpu_cores:  # each its share of the cores
            place = stack_placement(index, workers)
            env |= {ENV_PREFIX + "COMPUTE_THREADS": str(place.threads),
                    ENV_PREFIX + "CPU_CORES": format_cores(place.cores)}
        self.spawn(self.service(worker_id, "worker", "gpu_worker", env))

    def start_services(self, workers: int, gateway_ports: dict[str, int]) -> None:
        """The scheduler, `workers` workers and a gateway per name in `gateway_ports`, listening on its port."""
        self.start_scheduler()
        for i in range(workers):
            self.start_worker(f"worker-{i}", i, workers)
        for name, port in gateway_ports.items():
            self.spawn(self.service(name, "gateway", "gateway", {ENV_PREFIX + "PORT": str(port)}))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one child and wait for it to exit (a fault, or with SIGTERM a deliberate stop)."""
        child = self.children.pop(name)
        child.proc.send_signal(sig)
        child.proc.wait(STOP_TIMEOUT_S)

    def log(self, name: str) -> str:
        assert self.log_dir is not None, "only a stack with log_dir keeps its children's output"
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def reap(self) -> list[Child]:
        """The children that have exited, taken out of `children`."""
        dead = [c for c in self.children.values() if c.proc.poll() is not None]
        for child in dead:
            del self.children[child.name]
        return dead

    def assert_alive(self) -> None:
        """Fail with the child's last output if one has exited (tests and benchmarks call this while waiting)."""
        for child in self.reap():
            tail = self.log(child.name)[-3000:] if self.log_dir is not None else "(its output went to stderr)"
            raise AssertionError(f"{child.name} died (exit code {child.proc.returncode}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM to every service, then to redis-server once they have stopped; SIGKILL after a timeout."""
        services = [c for c in self.children.values() if c.spec.kind != "redis"]
        _terminate(services)
        _terminate([c for c in self.children.values() if c.spec.kind == "redis"])
        self.children.clear()
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)


def _terminate(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        try:
            code = child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            say(f"{child.name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it")
            child.proc.kill()
            code = child.proc.wait()
        say(f"{child.name} stopped (exit code {code})")
