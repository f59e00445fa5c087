"""Redis behind Sentinel: a `redis+sentinel://` URL names the master the Sentinels know, and the services' clients
follow a failover (the master SIGKILLed, its replica promoted) with no restart. Real servers and real Sentinels."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import urllib.request
from dataclasses import dataclass

import pytest
import redis
from redis_harness import SentinelTopology, free_port

from pagedserve.launcher import redact
from pagedserve.local_redis import redis_answers
from shared.bus import MasterMoved, acknowledge_move, connect, connect_async, failovers_followed_by
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
    assert redis_answers(topology.url), "the launcher's readiness probe reaches the master too"
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


def test_a_fenced_client_writes_nothing_to_a_new_master_until_it_acknowledges_the_move(topology):
    """The scheduler's client: what it would write after a failover may rest on writes the old master lost."""
    async def run() -> None:
        client = connect_async(topology.url, fenced=True)
        await client.set("before", "v")
        new = await asyncio.to_thread(topology.wait_failover, topology.kill_master())
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.set("after", "x")
                raise AssertionError("a fenced client wrote to the new master")
            except MasterMoved:
                break
            except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        assert redis.Redis(port=new).get("after") is None
        assert acknowledge_move(client), "a move was pending"
        await client.set("after", "x")
        assert redis.Redis(port=new).get("after") == b"x"
        assert not acknowledge_move(client)
        await client.aclose()

    asyncio.run(run())


def test_a_gateway_shows_a_token_only_once_a_replica_holds_it_so_a_failover_never_takes_one_back(topology):
    """The gateway's reader waits for the replica (WAIT) before it hands on what it read: while the replica is
    stopped, a token written to the master is held back; a token the failover then loses was never shown, and the
    one written in its place on the new master is."""
    from gateway.bus import Bus
    from gateway.replication import ReplicaGate
    from shared.keys import FIELD, Keys
    from shared.protocol import Assignment, TokenOutput, encode

    key = Keys().out("r")

    def token(index: int, token_id: int) -> dict:
        return {FIELD: encode(TokenOutput("r", 0, index, token_id, worker_id="w", epoch=1))}

    async def shown(queue: asyncio.Queue, within: float) -> list:
        try:
            return (await asyncio.wait_for(queue.get(), within))[1]
        except asyncio.TimeoutError:
            return []

    async def run() -> None:
        bus = Bus(topology.url, 4, 0.4, ReplicaGate(1, 4000))
        bus.start()
        queue: asyncio.Queue = asyncio.Queue()
        bus.follow("r", queue, 0)
        master = redis.Redis(port=topology.master_port())
        master.xadd(key, {FIELD: encode(Assignment("r", "w", 1))})
        master.xadd(key, token(0, 7))
        assert [type(e).__name__ for e in await shown(queue, 5)] == ["Assignment", "TokenOutput"]
        assert bus.gate.replicas == 1
        replica = topology.pause_replica()
        master.xadd(key, token(1, 8))
        assert await shown(queue, 1.0) == [], "held back while the replica lacks it"
        topology.resume(replica)
        assert [e.token_id for e in await shown(queue, 5)] == [8], "shown once the replica has it"
        replica = topology.pause_replica()
        topology.clog_replication()
        master.xadd(key, token(2, 9))  # the failover loses this one
        assert await shown(queue, 0.5) == []
        old = topology.kill_master()
        topology.resume(replica)
        new = await asyncio.to_thread(topology.wait_failover, old)
        assert redis.Redis(port=new).xlen(key) == 3, "the new master lacks the last token"
        redis.Redis(port=new).xadd(key, token(2, 10))
        assert [e.token_id for e in await shown(queue, 15)] == [10]
        assert bus.gate.shortfalls == 0
        await bus.close()

    asyncio.run(run())


# ---- the stack on Sentinel ------------------------------------------------------------------------
STREAMS, MAX_TOKENS = 36, 192  # 12 of each sampling
STACK_SETTINGS = dict(dtype="float32", kv_cache_bytes=16 << 20, swap_space_bytes=16 << 20)
SAMPLING = ("greedy", "seeded", "unseeded")  # stream i samples as SAMPLING[i % 3]


def stream_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 512) for _ in range(rng.randrange(8, 40))] for _ in range(STREAMS)]


def sampling(i: int) -> dict:
    """Stream i's sampling: greedy, seeded (seed 100 + i) or unseeded, all at temperature 1 but the greedy."""
    kind = SAMPLING[i % 3]
    return {"temperature": 0.0} if kind == "greedy" else {"temperature": 1.0, **({"seed": 100 + i} if kind == "seeded"
                                                                                 else {})}


def engine_oracle(model_dir, batch: list[list[int]]) -> dict[int, list[int]]:
    """The in-process engine's tokens for the greedy and seeded streams (a seeded draw is a function of seed, sample
    and position alone, so the stack must give the same)."""
    from pagedserve.engine import Engine
    from shared.sampling import SamplingParams
    from shared.settings import Settings

    engine = Engine(Settings(model=str(model_dir), **STACK_SETTINGS))
    chosen = [i for i in range(len(batch)) if SAMPLING[i % 3] != "unseeded"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling(i)) for i in chosen]
    done = engine.generate([batch[i] for i in chosen], params)
    return {i: c.samples[0].token_ids for i, c in zip(chosen, done)}


@pytest.mark.slow
def test_streams_run_on_unchanged_through_the_masters_sigkill_twice_in_a_row(topology, tiny_model_dir, tmp_path):
    """The stack on `redis+sentinel://`: 36 streams (12 greedy, 12 seeded, 12 unseeded) while the master is
    SIGKILLed with writes its replica never got, then, once the old master is back as a replica, 36 more while the
    new master is. Every client received exactly what the request's stream on the final master holds, with no index
    written twice with another token (so nothing a client saw was lost, and the rest went on from it), and the greedy
    and seeded streams are the in-process engine's, token for token."""
    from up_harness import UpProcess

    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(free_port()),
                          "--redis-url", topology.url, "--heartbeat-ttl", "2", "--replica-ack-timeout", "4",
                          *(f"--{k.replace('_', '-')}={v}" for k, v in STACK_SETTINGS.items())], tmp_path / "up.log")
    phases = [stream_prompts(0), stream_prompts(1)]
    try:
        results = []
        for i, prompts in enumerate(phases):
            results.append(asyncio.run(streams_through_a_failover(up, topology, prompts)))
            if i == 0:
                topology.bring_back(results[0].old_master)
        with urllib.request.urlopen(up.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        final = redis.Redis(port=topology.master_port())
        stored = [[fold_stream(final, rid) for rid in phase.rids] for phase in results]
    finally:
        up.stop()
    print("\nfailovers under load: " + "; ".join(r.summary for r in results))
    for phase, prompts, folds in zip(results, phases, stored):
        assert all(f.conflicts == [] for f in folds), "an index of a stream written twice with another token"
        assert phase.tokens == [f.tokens[0] for f in folds], "each client got what its stream holds"
        assert phase.lost_entries > 0, "the failover lost writes the old master had"
        oracle = engine_oracle(tiny_model_dir, prompts)
        assert {i: phase.tokens[i] for i in oracle} == oracle
    assert "pagedserve_redis_failovers_total 2.0" in metrics
    assert "pagedserve_redis_replica_shortfalls_total 0.0" in metrics
    assert up.log().count("(a Sentinel failover); following it") >= 2 * 4, "every service said so, each time"
    assert up.log().count("taking up the requests from what the new master holds") == 2


@dataclass
class Phase:
    rids: list[str]
    tokens: list[list[int]]  # what each client received
    lost_entries: int  # entries of the streams the old master held at its death and the final master never had
    old_master: int
    summary: str


def fold_stream(client: redis.Redis, rid: str):
    from shared.keys import FIELD, Keys
    from shared.out_stream import OutOfOrder, OutputFold
    from shared.protocol import Assignment, TokenOutput, decode

    fold = OutputFold(1, MAX_TOKENS)
    for _, fields in client.xrange(Keys().out(rid)):
        with contextlib.suppress(OutOfOrder):
            fold.apply(decode(fields[FIELD.encode()], (TokenOutput, Assignment)))
    return fold


async def streams_through_a_failover(up, topology: SentinelTopology, prompts: list[list[int]]) -> Phase:
    import openai

    from shared.keys import Keys

    client = openai.AsyncOpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = [""] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    arrivals: list[float] = []

    async def one(i: int) -> None:
        response = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling(i))
        async for chunk in response:
            ids[i] = chunk.id
            if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
                tokens[i] += chunk.choices[0].model_extra["token_ids"]
                arrivals.append(time.monotonic())

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]

    async def begun() -> None:
        while not all(len(t) >= 2 for t in tokens) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
    await asyncio.wait_for(begun(), 120)
    ended = [t.exception() for t in tasks if t.done()]
    assert not ended, f"the fault must land mid-stream: {ended}"
    replica = topology.pause_replica()
    await asyncio.to_thread(topology.clog_replication)
    await asyncio.sleep(0.3)  # tokens the workers write now reach the master alone
    master = redis.Redis(port=topology.master_port())
    rids = [f"{i}-0" for i in ids]
    held = {rid: {e for e, _ in master.xrange(Keys().out(rid))} for rid in rids}
    shown = sum(map(len, tokens))
    old = topology.kill_master()
    killed = time.monotonic()
    topology.resume(replica)
    new = await asyncio.to_thread(topology.wait_failover, old)
    promoted = time.monotonic() - killed
    await asyncio.wait_for(asyncio.gather(*tasks), 180)
    await client.close()
    final = redis.Redis(port=new)
    lost = sum(len(entries - {e for e, _ in final.xrange(Keys().out(rid))}) for rid, entries in held.items())
    first = min(t for t in arrivals if t > killed) - killed
    return Phase(rids, tokens, lost, old, f"master {old} -> {new}: promoted {promoted:.1f} s after the kill, the "
                 f"first token after it at {first:.1f} s; {lost} stream entries lost with the old master; "
                 f"{shown} tokens shown before the kill")
