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

Its parts: pagedserve/supervision.py (the children's processes), pagedserve/local_redis.py (the private
redis-server), pagedserve/readiness.py (when a child is ready), pagedserve/ports.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

from gpu_worker.cost_model import ProfileError, get_profile
from pagedserve.local_redis import redis_answers, start_redis
from pagedserve.ports import port_in_use
from pagedserve.readiness import Readiness
from pagedserve.restart_policy import ChildRestarts, GiveUp, RestartPolicy
from pagedserve.supervision import ChildSpec, Stack, say
from shared.model_dir import ModelDirError, choose_model
from shared.settings import ENV_PREFIX, Settings

POLL_S = 0.2


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


def redact(url: str) -> str:
    """`url` with its password, if any, replaced by `***`: for messages."""
    return re.sub(r"^([\w+]+://[^/@]*?:)[^/@]*@", r"\1***@", url)


def http_url(host: str, port: int) -> str:
    """The URL of a server on host:port, an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


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
        url = start_redis(stack, topology.redis_port)
        if url is None:
            return 1
        stack.settings = settings = settings.replace(redis_url=url)
    elif not redis_answers(settings.redis_url):
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
    """The first gateway's URL on stdout, the only line there; the others' and a request to try in the log. The
    others' go first: whoever reads the log once `ready:` is printed finds every gateway there."""
    if len(public) > 1:
        say(f"other gateways at {', '.join(public[1:])}")
    print(f"ready: {public[0]}", flush=True)
    name = settings.served_model_name
    auth = " -H \"Authorization: Bearer $PAGEDSERVE_API_KEY\"" if settings.api_key else ""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    say(f"try: curl -s {public[0]}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
