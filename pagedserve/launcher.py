"""`pagedserve up`: a whole local stack as child processes of one command.

Starts a private redis-server (AOF on, in a temporary directory) unless a Redis URL is given, then
the scheduler, N workers and the gateway (`python -m <service>`, settings passed as PAGEDSERVE_*
variables), prints `ready: http://HOST:PORT` on stdout once /health answers 200, and stops everything
on Ctrl-C or SIGTERM. Logs go to stderr. Any child that dies takes the stack down with a message naming
it, except a worker that exits cleanly (a deliberate scale-down): the rest keeps serving, and /health
turns 503 once no worker is left.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.model_dir import ModelDirError, default_model_dir, resolve_model_dir, served_model_name
from shared.settings import ENV_PREFIX, Settings

POLL_S = 0.2
STOP_TIMEOUT_S = 15.0
REDIS_START_TIMEOUT_S = 15.0
REDIS_MISSING = (
    "redis-server was not found on the PATH. Install it (Debian/Ubuntu: sudo apt-get install redis-server; "
    "Fedora: sudo dnf install redis; macOS: brew install redis; conda: conda install -c conda-forge redis-server) "
    "or point pagedserve at a running Redis with --redis-url redis://HOST:PORT/0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedserve up`: its own two plus every setting."""
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")
    parser.add_argument("--redis-port", type=int, default=0,
                        help="port of the local redis-server (default: a free one; unused with --redis-url)")
    Settings.add_arguments(parser)


def settings_for_up(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Settings from flags and environment; an empty redis_url (none given either way) means 'start one'."""
    environ = dict(os.environ) if environ is None else environ
    settings = Settings.from_args(args, environ)
    if getattr(args, "redis_url", None) is None and ENV_PREFIX + "REDIS_URL" not in environ:
        settings = settings.replace(redis_url="")
    return settings


def main(args: argparse.Namespace) -> int:
    return up(settings_for_up(args), args.workers, args.redis_port)


def say(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def settings_env(settings: Settings) -> dict[str, str]:
    env = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        env[ENV_PREFIX + f.name.upper()] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher itself dies without stopping us (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen
    is_worker: bool = False


@dataclass(slots=True)
class Stack:
    """The services as child processes, by name. Their output goes to stderr, or with `log_dir` to one
    file per child (`<name>.log`, appended across restarts under the same name)."""
    settings: Settings
    log_dir: Path | None = None
    children: dict[str, Child] = field(default_factory=dict)
    redis: subprocess.Popen | None = None
    redis_dir: Path | None = None
    stopping: bool = False
    scheduler_module: str = "scheduler"  # benchmarks run baselines' schedulers in the same stack

    def spawn(self, name: str, module: str, env: dict[str, str] | None = None, is_worker: bool = False) -> None:
        """Start `python -m module` with the settings as PAGEDSERVE_* variables (plus `env`)."""
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **settings_env(self.settings)) | (env or {})
        out = sys.stderr if self.log_dir is None else open(self.log_dir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen([sys.executable, "-m", module], env=full_env, stdin=subprocess.DEVNULL,
                                    stdout=out.fileno(), stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        finally:
            if out is not sys.stderr:
                out.close()
        self.children[name] = Child(name, proc, is_worker)
        say(f"started {name} (pid {proc.pid})")

    def start_scheduler(self, name: str = "scheduler") -> None:
        self.spawn(name, self.scheduler_module)

    def start_worker(self, worker_id: str) -> None:
        self.spawn(worker_id, "gpu_worker", {ENV_PREFIX + "WORKER_ID": worker_id}, is_worker=True)

    def start_services(self, workers: int, gateway: bool = True) -> None:
        self.start_scheduler()
        for i in range(workers):
            self.start_worker(f"worker-{i}")
        if gateway:
            self.spawn("gateway", "gateway")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one child and wait for it to exit (a fault, or with SIGTERM a deliberate stop)."""
        child = self.children.pop(name)
        child.proc.send_signal(sig)
        child.proc.wait(STOP_TIMEOUT_S)

    def log(self, name: str) -> str:
        assert self.log_dir is not None, "only a stack with log_dir keeps its children's output"
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def start_redis(self, port: int) -> str | None:
        """Start the private redis-server; its URL, or None after saying why it could not start."""
        binary = shutil.which("redis-server")
        if binary is None:
            say(REDIS_MISSING)
            return None
        port = port or free_port()
        self.redis_dir = Path(tempfile.mkdtemp(prefix="pagedserve-redis-"))
        log = open(self.redis_dir / "redis.log", "wb")
        self.redis = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.redis_dir),
             "--appendonly", "yes", "--save", "", "--protected-mode", "no"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        log.close()
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while not _redis_answers(url):
            if self.redis.poll() is not None or time.monotonic() > deadline:
                tail = (self.redis_dir / "redis.log").read_text(errors="replace")[-800:]
                say(f"redis-server did not start on port {port}:\n{tail}")
                return None
            time.sleep(0.05)
        say(f"started redis-server (pid {self.redis.pid}) on port {port}, AOF in {self.redis_dir}")
        return url

    def check_children(self) -> Child | None:
        """The first child that died, or None; a worker that exited cleanly is let go."""
        for child in list(self.children.values()):
            code = child.proc.poll()
            if code is None:
                continue
            if child.is_worker and code == 0:
                del self.children[child.name]
                left = sum(c.is_worker for c in self.children.values())
                say(f"{child.name} stopped; {left} worker(s) left")
                continue
            return child
        return None

    def assert_alive(self) -> None:
        """Fail with the child's last output if one has died (tests and benchmarks call this while waiting)."""
        dead = self.check_children()
        if dead is not None:
            tail = self.log(dead.name)[-3000:] if self.log_dir is not None else "(its output went to stderr)"
            raise AssertionError(f"{dead.name} died (exit code {dead.proc.returncode}):\n{tail}")

    def stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children.values():
            try:
                code = child.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop within {STOP_TIMEOUT_S:.0f} s; killing it")
                child.proc.kill()
                code = child.proc.wait()
            say(f"{child.name} stopped (exit code {code})")
        if self.redis is not None and self.redis.poll() is None:
            self.redis.terminate()
            try:
                self.redis.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.redis.kill()
                self.redis.wait()
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def ensure_model(settings: Settings) -> Settings:
    """Without --model: the built-in tiny model, written to the cache folder on first use."""
    if settings.model:
        return settings
    path = default_model_dir()
    if not (path / "config.json").is_file():
        from pagedserve.tiny_model import write_tiny_model

        say(f"writing the built-in tiny model to {path} (first use)")
        write_tiny_model(path)
    return settings.replace(model=str(path))


def up(settings: Settings, workers: int, redis_port: int = 0, scheduler_module: str = "scheduler") -> int:
    """Run the stack until Ctrl-C/SIGTERM (0) or until a child dies (1); 2 for bad arguments."""
    if workers < 1:
        say(f"--workers must be at least 1; got {workers}")
        return 2
    try:
        settings = ensure_model(settings)
        resolve_model_dir(settings.model)
    except ModelDirError as e:
        say(str(e))
        return 2
    stack = Stack(settings, scheduler_module=scheduler_module)

    def request_stop(signum: int, _frame: object) -> None:
        stack.stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(stack, workers, redis_port)
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(stack: Stack, workers: int, redis_port: int) -> int:
    settings = stack.settings
    if not settings.redis_url:
        url = stack.start_redis(redis_port)
        if url is None:
            return 1
        stack.settings = settings = settings.replace(redis_url=url)
    elif not _redis_answers(settings.redis_url):
        say(f"no Redis answers at {settings.redis_url}; start one or drop --redis-url to let pagedserve start it")
        return 1
    stack.start_services(workers)
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    probe = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else host
    public, local = f"http://{host}:{settings.port}", f"http://{probe}:{settings.port}"
    ready = False
    while not stack.stopping:
        dead = stack.check_children()
        if dead is not None or (stack.redis is not None and stack.redis.poll() is not None):
            name, code = (dead.name, dead.proc.returncode) if dead else ("redis-server", stack.redis.returncode)
            say(f"{name} exited unexpectedly (exit code {code}); stopping the stack")
            return 1
        if not ready and _healthy(local):
            ready = True
            print(f"ready: {public}", flush=True)
            name = served_model_name(resolve_model_dir(settings.model), settings.served_model_name)
            say(f"try: curl -s {public}/v1/completions -H 'Content-Type: application/json' "
                f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        time.sleep(POLL_S)
    say("stopping")
    return 0
