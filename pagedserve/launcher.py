"""`pagedserve up`: a whole local stack as child processes of one command, kept running.

It refuses to start (exit 2) when a gateway's port is taken. Unless a Redis URL is given it starts a
private redis-server: AOF on, in a private directory, protected mode on and a generated password that
goes in a config file (mode 0600) there, never on a command line (`ps` shows those). The services get
the password inside PAGEDSERVE_REDIS_URL in their environment. Then the scheduler, N workers and M
gateways, gateway i on port + i (`python -m <service>`, settings as PAGEDSERVE_* variables). `ready:
http://HOST:PORT` (the first gateway) goes to stdout once every child is ready: every gateway answers
/health with 200 and all N workers have a live heartbeat; the log names the other gateways' URLs. A
child that exits is restarted as `restart_policy` says (redis-server on the same port,
directory and config, so its AOF keeps the data); the stack stops on Ctrl-C or SIGTERM (exit 0) or when
a child cannot start at all (exit 1). Logs go to stderr, one line per start and per exit; no password.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import re
import secrets
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

from gpu_worker.cpu_setup import format_cores, stack_placement
from gpu_worker.cost_model import ProfileError, get_profile
from pagedserve.restart_policy import ChildRestarts, GiveUp, RestartPolicy
from shared.keys import Keys
from shared.model_dir import ModelDirError, choose_model
from shared.settings import ENV_PREFIX, Settings

POLL_S = 0.2
STOP_TIMEOUT_S = 15.0
REDIS_START_TIMEOUT_S = 15.0
REDIS = "redis-server"
REDIS_MISSING = (
    "redis-server was not found on the PATH. Install it (Debian/Ubuntu: sudo apt-get install redis-server; "
    "Fedora: sudo dnf install redis; macOS: brew install redis; conda: conda install -c conda-forge redis-server) "
    "or point pagedserve at a running Redis with --redis-url redis://HOST:PORT/0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedserve up`: its own three plus every setting."""
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")
    parser.add_argument("--gateways", type=int, default=1,
                        help="number of gateway processes, gateway i on --port + i (default 1)")
    parser.add_argument("--redis-port", type=int, default=0,
                        help="port of the local redis-server (default: a free one; unused with --redis-url)")
    Settings.add_arguments(parser)


@dataclass(frozen=True, slots=True)
class Topology:
    """What `up` runs beside its settings, from its own flags: how many workers and gateways, and its Redis port."""
    workers: int = 1
    gateways: int = 1
    redis_port: int = 0  # 0: a free one

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topology:
        return cls(workers=args.workers, gateways=args.gateways, redis_port=args.redis_port)

    def problem(self, port: int) -> str | None:
        """Why this topology cannot run with the first gateway on `port` (said before exit 2), or None."""
        if self.workers < 1:
            return f"--workers must be at least 1; got {self.workers}"
        if self.gateways < 1:
            return f"--gateways must be at least 1; got {self.gateways}"
        if port + self.gateways - 1 > 65535:
            return f"--gateways {self.gateways} from --port {port} needs ports past 65535"
        return None

    def gateway_ports(self, port: int) -> dict[str, int]:
        """Each gateway's child name and port: gateway i listens on `port` + i."""
        return {gateway_name(i): port + i for i in range(self.gateways)}


def gateway_name(index: int) -> str:
    """The child name of gateway `index`; the first keeps the name that a one-gateway stack's logs have always had."""
    return "gateway" if index == 0 else f"gateway-{index}"


def settings_for_up(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Settings from flags and environment; an empty redis_url (none given either way) means 'start one'."""
    environ = dict(os.environ) if environ is None else environ
    settings = Settings.from_args(args, environ)
    if getattr(args, "redis_url", None) is None and ENV_PREFIX + "REDIS_URL" not in environ:
        settings = settings.replace(redis_url="")
    return settings


def main(args: argparse.Namespace) -> int:
    settings = settings_for_up(args)
    # What the launcher's own modules log (a GGUF conversion, say) reads as its other lines do.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pagedserve: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    return up(settings, Topology.from_args(args))


def say(message: str) -> None:
    print(f"pagedserve: {message}", file=sys.stderr, flush=True)


def redact(url: str) -> str:
    """`url` with its password, if any, replaced by `***`: for messages."""
    return re.sub(r"^([\w+]+://[^/@]*?:)[^/@]*@", r"\1***@", url)


def settings_env(settings: Settings) -> dict[str, str]:
    env = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        env[ENV_PREFIX + f.name.upper()] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return env


def http_url(host: str, port: int) -> str:
    """The URL of a server on host:port, an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (binding as aiohttp does), or None when it could."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"{host} does not resolve: {e}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            # SO_REUSEADDR as the servers set it: a connection of an earlier server lingering in TIME_WAIT
            # does not stop them, while a listening socket does.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                return f"{address[0]} port {port}: {e.strerror}"
    return None


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

    def start_redis(self, port: int) -> str | None:
        """Start the private redis-server and wait until it answers; its URL (with the password), or None after
        saying why it could not start."""
        binary = shutil.which(REDIS)
        if binary is None:
            say(REDIS_MISSING)
            return None
        port = port or free_port()
        self.redis_dir = Path(tempfile.mkdtemp(prefix="pagedserve-redis-"))  # mode 0700
        password = secrets.token_urlsafe(32)  # URL- and config-safe characters only
        config = self.redis_dir / "redis.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"port {port}\nbind 127.0.0.1\nprotected-mode yes\ndir {_quoted(str(self.redis_dir))}\n"
                    f"appendonly yes\nsave \"\"\nrequirepass {password}\n")
        child = self.spawn(ChildSpec(REDIS, "redis", [binary, str(config)], dict(os.environ),
                                     self.redis_dir / "redis.log"))
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while not _redis_answers(url):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.redis_dir / "redis.log").read_text(errors="replace")[-800:]
                say(f"redis-server did not start on port {port}:\n{tail}")
                return None
            time.sleep(0.05)
        say(f"redis-server listens on 127.0.0.1:{port} with a password; its config (mode 0600, with the "
            f"password) is {config}, its AOF in {self.redis_dir}")
        return url

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


def _quoted(value: str) -> str:
    """A string as a redis.conf argument."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _redis_answers(url: str) -> bool:
    import redis

    from shared.bus import connect

    try:
        return bool(connect(url, timeout=1.0, retries=0).ping())
    except (redis.RedisError, OSError):
        return False


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


def ensure_model(settings: Settings) -> Settings:
    """The model every child serves, made ready once, before any starts: the built-in tiny model written to the
    cache on first use, a GGUF file converted (config, tokenizer and weights; simulated workers need no weights).
    The children get its checkpoint directory and id."""
    choice = choose_model(settings.model)
    if choice.is_tiny and not (choice.path / "config.json").is_file():
        from pagedserve.tiny_model import write_tiny_model

        say(f"writing the built-in tiny model to {choice.path} (first use)")
        write_tiny_model(choice.path)
    model_dir = choice.checkpoint(weights=not settings.simulate)
    return settings.replace(model=str(model_dir.path),
                            served_model_name=model_dir.served_name(settings.served_model_name))


def up(settings: Settings, topology: Topology = Topology(), policy: RestartPolicy = RestartPolicy(),
       scheduler_module: str = "scheduler") -> int:
    """Run the stack until Ctrl-C/SIGTERM (0) or until a child cannot start (1); 2 for bad arguments or a
    port in use. `scheduler_module` runs another scheduler service (benchmarks' baselines)."""
    problem = topology.problem(settings.port)
    if problem is not None:
        say(problem)
        return 2
    gateways = topology.gateway_ports(settings.port).values()
    busy = next(filter(None, (port_in_use(settings.host, port) for port in gateways)), None)
    if busy is None and not settings.redis_url and topology.redis_port:
        busy = port_in_use("127.0.0.1", topology.redis_port)
    if busy is not None:
        say(f"cannot listen on {busy}; another server is probably there. Stop it, or pick other ports with "
            "--port (and --redis-port); nothing was started")
        return 2
    try:
        settings = ensure_model(settings)
        if settings.simulate:
            get_profile(settings.simulate)
    except (ModelDirError, ProfileError) as e:
        say(str(e))
        return 2
    stack = Stack(settings, scheduler_module=scheduler_module)

    def request_stop(signum: int, _frame: object) -> None:
        stack.stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(stack, topology, policy)
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(stack: Stack, topology: Topology, policy: RestartPolicy) -> int:
    settings = stack.settings
    if not settings.redis_url:
        url = stack.start_redis(topology.redis_port)
        if url is None:
            return 1
        stack.settings = settings = settings.replace(redis_url=url)
    elif not _redis_answers(settings.redis_url):
        say(f"no Redis answers at {redact(settings.redis_url)}; start one or drop --redis-url to let pagedserve "
            "start it")
        return 1
    gateway_ports = topology.gateway_ports(settings.port)
    stack.start_services(topology.workers, gateway_ports)
    probe = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    public = [http_url(settings.host, port) for port in gateway_ports.values()]
    readiness = Readiness(settings.redis_url, {name: http_url(probe, port) for name, port in gateway_ports.items()})
    history = {name: ChildRestarts(policy, child.started_at, ever_ready=child.spec.kind == "redis")
               for name, child in stack.children.items()}
    pending: dict[str, tuple[float, ChildSpec]] = {}  # name → (when to restart it, how)
    announced = False
    while not stack.stopping:
        now = time.monotonic()
        for child in stack.reap():
            decision = history[child.name].exited(now)
            if isinstance(decision, GiveUp):
                say(f"{child.name} exited (exit code {child.proc.returncode}) and cannot start: {decision.reason}; "
                    "stopping the stack")
                return 1
            say(f"{child.name} exited (exit code {child.proc.returncode}); restarting it in {decision.delay:.2f} s "
                f"(restart {decision.recent} of {policy.describe()})")
            pending[child.name] = (decision.at, child.spec)
        for name, (at, spec) in list(pending.items()):
            if now >= at:
                del pending[name]
                history[name].started(stack.spawn(spec).started_at)
        if not announced:
            seen = readiness.check(list(stack.children.values()))
            for name in seen.ready:
                history[name].ready()
            if seen.serving and not pending and seen.ready == set(stack.children):
                announced = True
                _announce(public, settings)
        time.sleep(POLL_S)
    say("stopping")
    return 0


def _announce(public: list[str], settings: Settings) -> None:
    """The first gateway's URL on stdout, the only line there; the others' and a request to try in the log."""
    print(f"ready: {public[0]}", flush=True)
    if len(public) > 1:
        say(f"other gateways at {', '.join(public[1:])}")
    name = settings.served_model_name
    auth = " -H \"Authorization: Bearer $PAGEDSERVE_API_KEY\"" if settings.api_key else ""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    say(f"try: curl -s {public[0]}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
