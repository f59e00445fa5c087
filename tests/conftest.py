from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Kernel tests run Triton's interpreter on the CPU; it must be on before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One compute thread per process: the suite starts several processes on a 2-core machine, and
# oversubscribed BLAS threads turn milliseconds into seconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from redis_harness import LocalRedis, RedisUnavailable, open_server  # noqa: E402


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"no Redis for tests under CI: {reason}", pytrace=False)
    pytest.skip(f"no Redis for tests: {reason}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """The session's Redis (REDIS_URL, testcontainers or a local binary); see tests/redis_harness.py."""
    try:
        server = open_server(tmp_path_factory.mktemp("redis"))
    except RedisUnavailable as e:
        _unavailable(str(e))
    yield server
    if server.can_restart:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """A clean database on the session's server."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path):
    """A private `redis-server` with AOF that a fault test may stop and restart."""
    server = LocalRedis(tmp_path / "redis")
    try:
        server.start()
    except RedisUnavailable as e:
        _unavailable(str(e))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in tiny checkpoint, written once per session through `pagedserve tiny-model`'s code."""
    from pagedserve.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def pytest_collection_modifyitems(items) -> None:
    """Tests that take a C kernel build (tests/kernel_builds.py) are marked `c_kernels`: the kernel oracle tests,
    which CI runs again against the sanitized build."""
    for item in items:
        if {"kernel", "avx512_kernel", "best_kernel"} & set(getattr(item, "fixturenames", ())):
            item.add_marker("c_kernels")
