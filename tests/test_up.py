"""`pagedserve up` as a user runs it (the real command, a subprocess): it refuses a busy port, announces
`ready:` only when all of it is, keeps its Redis behind a password nobody can read off a command line, and
keeps serving through a SIGKILL of each of its children mid-stream.

Oracle of the fault tests: the in-process engine's greedy tokens for the same prompts and settings, decoded
with the model's tokenizer; every stream must carry that text and token count exactly (nothing missing,
nothing twice), except the streams of a killed gateway's own clients, which must be cut cleanly after a
prefix of it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis
from redis_harness import free_port
from up_harness import FaultLoad, Phase, UpProcess, health, run_phase, run_up, settle

from shared.keys import Keys
from shared.sampling import SamplingParams
from shared.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.redis]
KEY = "up-test-key"
WORKERS = ("worker-0", "worker-1")
STREAMS = 12
MAX_TOKENS = 192  # a phase lasts long enough for the fault to land mid-stream (at 64 one ended within 0.4 s)
RECOVERY_S = 10.0
LOAD = FaultLoad("tiny", MAX_TOKENS, KEY, WORKERS)
# The services and the oracle engine share these, so that both hold the same KV cache.
STACK_SETTINGS = dict(dtype="float32", kv_cache_bytes=16 << 20, swap_space_bytes=16 << 20)


def live_heartbeats(redis_url: str) -> list[str]:
    with redis.Redis.from_url(redis_url, socket_timeout=5) as r:
        return [w for w in WORKERS if r.exists(Keys().heartbeat(w))]


@dataclass(slots=True)
class Started:
    up: UpProcess
    health_at_ready: tuple[int | None, dict]
    heartbeats_at_ready: list[str]


@pytest.fixture(scope="module")
def started(tiny_model_dir, tmp_path_factory):
    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(free_port()), "--api-key", KEY,
                   "--heartbeat-ttl", "2", *(f"--{k.replace('_', '-')}={v}" for k, v in STACK_SETTINGS.items())],
                  tmp_path_factory.mktemp("up") / "up.log")
    # What `ready:` promised, looked at the moment it came.
    snapshot = Started(up, health(up.url), live_heartbeats(up.redis_url()))
    yield snapshot
    up.stop()


@pytest.fixture
def up(started) -> UpProcess:
    assert started.up.proc.poll() is None, f"`pagedserve up` exited:\n{started.up.log()[-4000:]}"
    return started.up


def test_ready_comes_once_its_own_gateway_answers_and_every_worker_has_a_heartbeat(started):
    status, body = started.health_at_ready
    assert status == 200 and body["workers"] == list(WORKERS)
    assert started.heartbeats_at_ready == list(WORKERS)


def test_up_refuses_a_busy_port_before_starting_anything(up, tiny_model_dir):
    port = up.url.rsplit(":", 1)[1]
    second = run_up("--model", str(tiny_model_dir), "--port", port)  # the running stack's gateway answers there
    assert second.returncode == 2 and second.stdout == ""
    assert f"port {port}: Address already in use" in second.stderr and "--port" in second.stderr
    assert "nothing was started" in second.stderr and " (pid " not in second.stderr
    with socket.socket() as taken:  # a listener that answers nothing
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        third = run_up("--model", str(tiny_model_dir), "--port", str(free_port()), "--redis-port", str(busy))
    assert third.returncode == 2 and " (pid " not in third.stderr
    assert f"port {busy}: Address already in use" in third.stderr


def test_the_private_redis_needs_a_password_that_no_command_line_or_log_shows(up):
    url = up.redis_url()
    password = re.match(r"redis://:([^@]+)@", url).group(1)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=5, retry=None).ping()  # no retries: fail at once
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        assert r.config_get("protected-mode") == {"protected-mode": "yes"}
    config = Path(re.search(r"is (\S+/redis\.conf)", up.log()).group(1))
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    pids = up.pids()
    assert set(pids) == {"redis-server", "scheduler", *WORKERS, "gateway"}
    for name, pid in pids.items():
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        if name != "redis-server":  # the services get it from their environment
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"PAGEDSERVE_REDIS_URL={url}".encode() in environ, name
    assert password not in up.log()


def test_a_wrong_redis_url_is_reported_without_its_password(tiny_model_dir):
    port = free_port()
    out = run_up("--model", str(tiny_model_dir), env={"PAGEDSERVE_REDIS_URL": f"redis://:s3cret@127.0.0.1:{port}/0"})
    assert out.returncode == 1 and f"no Redis answers at redis://:***@127.0.0.1:{port}/0" in out.stderr
    assert "s3cret" not in out.stderr


def test_the_try_hint_runs_as_printed_with_the_api_key_in_the_environment(up):
    hint = re.search(r"try: (curl .*)", up.log()).group(1)
    assert "Authorization: Bearer" in hint and KEY not in hint
    answered = subprocess.run(["sh", "-c", hint], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PAGEDSERVE_API_KEY=KEY))
    assert json.loads(answered.stdout)["usage"]["completion_tokens"] >= 1
    refused = subprocess.run(["sh", "-c", hint], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PAGEDSERVE_API_KEY="wrong"))
    assert json.loads(refused.stdout)["error"]["code"] == "invalid_api_key"


# ---- faults ------------------------------------------------------------------------------------------


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(8, 40))] for _ in range(STREAMS)]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """Greedy texts and token counts of the in-process engine, one batch per phase."""
    from transformers import AutoTokenizer

    from pagedserve.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = Engine(Settings(model=str(tiny_model_dir), **STACK_SETTINGS))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(batch: list[list[int]]) -> list[tuple[str, int]]:
        return [(tokenizer.decode(c.samples[0].token_ids, skip_special_tokens=True), len(c.samples[0].token_ids))
                for c in engine.generate(batch, params)]
    return run


FAULTS = ["worker-1", "scheduler", "redis-server", "gateway"]


def test_each_child_killed_mid_stream_is_restarted_and_no_stream_loses_or_repeats_a_token(up, oracle):
    phases = [Phase(fault, prompts(seed)) for seed, fault in enumerate(FAULTS)]
    for phase in phases:
        old_pid = up.pids()[phase.fault]
        asyncio.run(run_phase(up, LOAD, phase))
        settle(up, LOAD, phase.fault, old_pid)
    log = up.log()
    print("\nrecovery after SIGKILL (first new request served): "
          + ", ".join(f"{p.fault} {p.recovery_s:.1f} s" for p in phases))
    for phase in phases:
        assert f"{phase.fault} exited (exit code -9); restarting it" in log
        assert phase.recovery_s < RECOVERY_S, f"{phase.fault}: no new request served {RECOVERY_S:.0f} s after the kill"
        expected = oracle(phase.prompts)
        for i, (got, (text, count)) in enumerate(zip(phase.streams, expected)):
            where = f"{phase.fault} phase, stream {i}"
            if phase.fault == "gateway":  # these clients' own connection died: cut, after a correct prefix
                assert got.error is not None and got.finish_reason is None, where
                assert text.startswith(got.text), where
            else:
                assert got.error is None, f"{where}: {got.error}"
                assert (got.text, got.completion_tokens, got.finish_reason) == (text, count, "length"), where
    assert up.proc.poll() is None


def test_a_worker_that_exits_cleanly_is_restarted_as_compose_does(up):
    old = up.kill("worker-0", signal.SIGTERM)
    settle(up, LOAD, "worker-0", old)
    assert "worker-0 exited (exit code 0); restarting it" in up.log()
    response = openai.OpenAI(base_url=up.url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3


def test_sigterm_stops_the_whole_stack_and_removes_the_private_redis_directory(up):
    children = up.pids()
    config = Path(re.search(r"is (\S+/redis\.conf)", up.log()).group(1))
    assert up.stop() == 0
    for name, pid in children.items():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
            f"{name} (pid {pid}) outlived `pagedserve up`"
    assert not config.parent.exists()
    assert up.log().count("exited") == len(FAULTS) + 1, "stopping is no exit to restart from"


def test_a_child_that_cannot_start_stops_the_stack_and_says_which(tiny_model_dir):
    out = run_up("--model", str(tiny_model_dir), "--num-blocks", "1", "--workers", "1")  # a worker needs 2
    assert out.returncode == 1 and out.stdout == ""
    assert "worker-0 exited (exit code 1) and cannot start: it exited before it was ever ready" in out.stderr
    assert "a worker needs at least 2" in out.stderr
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", out.stderr)]
    assert len(pids) == 4 and not any(Path(f"/proc/{p}").exists() for p in pids)
