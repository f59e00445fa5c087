"""Redis behind Sentinel: a `redis+sentinel://` URL names the master the Sentinels know, and the services' clients
follow a failover (the master SIGKILLed, its replica promoted) with no restart. Real servers and real Sentinels."""
from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.request

import pytest
import redis
from redis_harness import SentinelTopology, free_port

from pagedserve.launcher import _redis_answers, redact
from shared.bus import connect, connect_async, failovers_followed_by
from shared.redis_target import Endpoint, RedisTargetError, SentinelTarget, sentinel_target

pytestmark = pytest.mark.redis


def test_a_sentinel_url_names_its_sentinels_master_database_and_passwords():
    assert sentinel_target("redis://:pw@127.0.0.1:6379/0") is None
    assert sentinel_target("redis+sentinel://:p%40ss@a:26380,b/mymaster/2?sentinel_password=s") == SentinelTarget(
        (Endpoint("a", 26380), Endpoint("b", 26379)), "mymaster", 2, "p@ss", "s")
    assert sentinel_target("redis+sentinel://h:1/m") == SentinelTarget((Endpoint("h", 1),), "m")


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel:///m", "names no Sentinel"),
    ("redis+sentinel://h:1", "needs /MASTER"),
    ("redis+sentinel://h:1/m/x", "must be a number"),
    ("redis+sentinel://h:99999/m", "is not HOST:PORT"),
    ("redis+sentinel://h:1/m?tls=1", "unknown option"),
])
def test_a_malformed_sentinel_url_is_refused_saying_why(url, says):
    with pytest.raises(RedisTargetError, match=says):
        sentinel_target(url)


def test_messages_show_a_sentinel_urls_password_as_stars():
    assert redact("redis+sentinel://:secret@h:1,h:2/m/0") == "redis+sentinel://:***@h:1,h:2/m/0"


@pytest.fixture
def topology(tmp_path):
    topo = SentinelTopology(tmp_path / "sentinel")
    topo.start()
    yield topo
    topo.stop()


def until(action, timeout: float = 30.0):
    """`action()` once Redis lets it through, retrying while the failover runs; the seconds it took too."""
    start = time.monotonic()
    while True:
        try:
            return action(), time.monotonic() - start
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            if time.monotonic() - start > timeout:
                raise
            time.sleep(0.05)


def test_a_client_follows_the_master_through_a_failover_without_a_restart_and_says_so(topology, caplog):
    client = connect(topology.url)
    client.set("before", "kept")
    assert client.wait(1, 5000) == 1, "the replica holds the write"
    assert _redis_answers(topology.url), "the launcher's readiness probe reaches the master too"
    old = topology.kill_master()
    new = topology.wait_failover(old)
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        value, took = until(lambda: client.get("before"))
        until(lambda: client.set("after", "written"))
    print(f"\nfailover: master {old} -> {new}; the client's first read {took:.2f} s after the promotion")
    assert value == b"kept"
    assert redis.Redis(port=new).get("after") == b"written", "the write reached the new master"
    assert f"to 127.0.0.1:{new} (a Sentinel failover)" in caplog.text


def test_a_connection_the_caller_holds_reaches_the_master_too_not_the_default_host(topology):
    """The worker reads plans and sends steps on connections of its own (sent now, replies read later): redis-py
    would connect such a one to localhost:6379 on its first send, where this machine has another Redis."""
    client = connect(topology.url, blocking=True)
    client.xadd("plans", {"step": 1})
    own = client.connection_pool.make_connection()
    own.send_packed_command(own.pack_commands([("XREAD", "COUNT", 1, "STREAMS", "plans", "0-0")]))
    assert (own.port, len(client.parse_response(own, "XREAD"))) == (topology.master_port(), 1)


def test_an_asyncio_client_follows_a_failover_too(topology):
    async def run() -> bytes:
        client = connect_async(topology.url)
        await client.set("k", "v")
        assert await client.wait(1, 5000) == 1
        new = await asyncio.to_thread(topology.wait_failover, topology.kill_master())
        deadline = time.monotonic() + 30
        while True:
            try:
                value = await client.get("k")
                break
            except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        await client.set("k2", "v2")
        assert redis.Redis(port=new).get("k2") == b"v2"
        assert failovers_followed_by(client.connection_pool) == 1
        await client.aclose()
        return value

    assert asyncio.run(run()) == b"v"


# ---- the stack on Sentinel ------------------------------------------------------------------------
STREAMS, MAX_TOKENS = 12, 192
STACK_SETTINGS = dict(dtype="float32", kv_cache_bytes=16 << 20, swap_space_bytes=16 << 20)


def stream_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(8, 40))] for _ in range(STREAMS)]


def engine_oracle(model_dir, batch: list[list[int]], seeded: bool) -> list[str]:
    """The in-process engine's texts: greedy, or sampled at temperature 1 with prompt i's seed 100 + i (a seeded
    draw is a function of seed, sample and position alone, so the stack must give the same)."""
    from transformers import AutoTokenizer

    from pagedserve.engine import Engine
    from shared.sampling import SamplingParams
    from shared.settings import Settings

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine = Engine(Settings(model=str(model_dir), **STACK_SETTINGS))
    params = [SamplingParams(temperature=1.0 if seeded else 0.0, seed=100 + i if seeded else None,
                             max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(batch))]
    return [tokenizer.decode(c.samples[0].token_ids, skip_special_tokens=True) for c in engine.generate(batch, params)]


@pytest.mark.slow
def test_streams_run_on_unchanged_through_the_masters_sigkill_twice_in_a_row(topology, tiny_model_dir, tmp_path):
    """The stack on `redis+sentinel://`: 12 greedy streams while the master is SIGKILLed, then, once the old master
    is back as a replica, 12 seeded sampled ones while the new master is. Every stream is the in-process engine's,
    token for token. (Replication is asynchronous: this shows the services follow the failover; it does not prove
    that no acknowledged write can be lost, see the README.)"""
    from up_harness import UpProcess

    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(free_port()),
                          "--redis-url", topology.url, "--heartbeat-ttl", "2",
                          *(f"--{k.replace('_', '-')}={v}" for k, v in STACK_SETTINGS.items())], tmp_path / "up.log")
    phases = [stream_prompts(0), stream_prompts(1)]
    try:
        results = []
        for i, prompts in enumerate(phases):
            results.append(asyncio.run(streams_through_a_failover(up, topology, prompts, seeded=i == 1)))
            if i == 0:
                topology.bring_back(int(results[0][-1].split()[1]))
        with urllib.request.urlopen(up.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        up.stop()
    print("\nfailovers under load: " + "; ".join(r[-1] for r in results))
    for i, (prompts, texts) in enumerate(zip(phases, results)):
        assert texts[:-1] == engine_oracle(tiny_model_dir, prompts, seeded=i == 1), f"phase {i}"
    assert "pagedserve_redis_failovers_total 2.0" in metrics
    assert up.log().count("(a Sentinel failover); following it") >= 2 * 4, "every service said so, each time"


async def streams_through_a_failover(up, topology: SentinelTopology, prompts: list[list[int]], seeded: bool) -> list:
    import openai

    client = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = [""] * len(prompts)
    chunks = [0] * len(prompts)

    async def one(i: int) -> None:
        sampling = {"temperature": 1.0, "seed": 100 + i} if seeded else {"temperature": 0}
        response = await client.completions.create(model="tiny", prompt=prompts[i], max_tokens=MAX_TOKENS,
                                                   stream=True, extra_body={"ignore_eos": True}, **sampling)
        async for chunk in response:
            if chunk.choices:
                texts[i] += chunk.choices[0].text
                chunks[i] += 1

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    async def begun() -> None:
        while not all(c >= 2 for c in chunks) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
    await asyncio.wait_for(begun(), 120)
    ended = [t.exception() for t in tasks if t.done()]
    assert not ended, f"the fault must land mid-stream: {ended}"
    old = topology.kill_master()
    killed = time.monotonic()
    new = await asyncio.to_thread(topology.wait_failover, old)
    promoted = time.monotonic() - killed
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    await client.close()
    return [*texts, f"master {old} -> {new}, promoted {promoted:.1f} s after the kill"]
