"""The private redis-server of `pagedserve up`: AOF on, in a private directory (removed when the stack stops),
protected mode on and a generated password that goes in a config file (mode 0600) there, never on a command line."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from pagedserve.ports import free_port
from pagedserve.supervision import ChildSpec, Stack, say

REDIS_START_TIMEOUT_S = 15.0
REDIS = "redis-server"
REDIS_MISSING = (
    "redis-server was not found on the PATH. Install it (Debian/Ubuntu: sudo apt-get install redis-server; "
    "Fedora: sudo dnf install redis; macOS: brew install redis; conda: conda install -c conda-forge redis-server) "
    "or point pagedserve at a running Redis with --redis-url redis://HOST:PORT/0")


def start_redis(stack: Stack, port: int) -> str | None:
    """Start the stack's private redis-server and wait until it answers; its URL (with the password), or None
    after saying why it could not start."""
    binary = shutil.which(REDIS)
    if binary is None:
        say(REDIS_MISSING)
        return None
    port = port or free_port()
    stack.redis_dir = Path(tempfile.mkdtemp(prefix="pagedserve-redis-"))  # mode 0700
    password = secrets.token_urlsafe(32)  # URL- and config-safe characters only
    config = stack.redis_dir / "redis.conf"
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"port {port}\nbind 127.0.0.1\nprotected-mode yes\ndir {_quoted(str(stack.redis_dir))}\n"
                f"appendonly yes\nsave \"\"\nrequirepass {password}\n")
    child = stack.spawn(ChildSpec(REDIS, "redis", [binary, str(config)], dict(os.environ),
                                 stack.redis_dir / "redis.log"))
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while not redis_answers(url):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            tail = (stack.redis_dir / "redis.log").read_text(errors="replace")[-800:]
            say(f"redis-server did not start on port {port}:\n{tail}")
            return None
        time.sleep(0.05)
    say(f"redis-server listens on 127.0.0.1:{port} with a password; its config (mode 0600, with the "
        f"password) is {config}, its AOF in {stack.redis_dir}")
    return url


def _quoted(value: str) -> str:
    """A string as a redis.conf argument."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def redis_answers(url: str) -> bool:
    """Whether a Redis answers PING at `url` within a second."""
    import redis

    from shared.bus import connect

    try:
        return bool(connect(url, timeout=1.0, retries=0).ping())
    except (redis.RedisError, OSError):
        return False
