"""The gateway alone under load: a tiny probe's latency while huge prompts are tokenized, bursts of small
requests, and the gateway's CPU per streamed token.

The gateway runs as its own process (`python -m gateway`, from this tree or from `--source DIR`, e.g. an
older commit unpacked with `git archive`, to compare before and after in one run) on the built-in tiny
model and a private redis-server; this process plays the scheduler and the workers on the bus, answering
each request with scripted tokens (all at once, or one per request per `--step-ms` as decode steps write
them), so only the gateway's own work is measured. On a busy machine, `--together` runs the gateways of all
sources at once, round after round, so that each round's numbers saw the same load.

    python -m benchmarks.gateway_load [--source DIR ...]
    python -m benchmarks.gateway_load --parts stream --streams 32 --step-ms 10 --together --rounds 5 \
        --source /tmp/before --source .
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis
import redis.asyncio as aioredis

from benchmarks.proc_cpu import cpu_seconds
from pagedserve.ports import free_port
from shared.keys import FIELD, Keys
from shared.protocol import Assignment, Request, TokenOutput, decode, encode

KEYS = Keys()
BIG_PROMPT_CHARS = 4_000_000  # ~4 MB of JSON: under the default max_body_bytes (4 MiB)



@dataclass(slots=True)
class Gateway:
    proc: subprocess.Popen
    url: str


async def answer_requests(url: str, tokens_per_request: dict[int, int], default_tokens: int, step_s: float) -> None:
    """The scheduler and workers: each request gets its Assignment and its tokens (ids 20, 21, ...): at once, or
    with `step_s`, one entry per running request per step, as a worker's decode steps write them."""
    client = aioredis.Redis.from_url(url, socket_timeout=10)
    cursor = "0-0"  # a fresh Redis: every request from the first
    running: dict[str, collections.deque] = {}  # per request, its entries not yet written
    pacer = asyncio.create_task(pace(client, running, step_s)) if step_s else None
    try:
        while True:
            for _, entries in await client.xread({KEYS.requests: cursor}, block=1000) or ():
                for entry_id, fields in entries:
                    cursor = entry_id
                    req = decode(fields[FIELD.encode()], Request)
                    count = min(tokens_per_request.get(req.prompt_token_ids[0], default_tokens), req.params.max_tokens)
                    outs = [Assignment(req.rid, "w0", 1)] + [
                        TokenOutput(req.rid, s, i, 20 + i % 400, worker_id="w0", epoch=1,
                                    finish_reason="length" if i == count - 1 else None)
                        for i in range(count) for s in range(req.params.n)]
                    if pacer is None:
                        await write(client, outs)
                    else:
                        running[req.rid] = collections.deque(outs)
    finally:
        if pacer is not None:
            pacer.cancel()
        await client.aclose()


async def pace(client: aioredis.Redis, running: dict[str, collections.deque], step_s: float) -> None:
    while True:
        await asyncio.sleep(step_s)
        step = [outs.popleft() for outs in running.values()]
        for rid in [rid for rid, outs in running.items() if not outs]:
            del running[rid]
        if step:
            await write(client, step)


async def write(client: aioredis.Redis, outs: list[Assignment | TokenOutput]) -> None:
    async with client.pipeline(transaction=False) as pipe:
        for out in outs:
            pipe.xadd(KEYS.out(out.rid), {FIELD: encode(out)})
        await pipe.execute()


def start_gateway(source: Path, model: Path, redis_url: str, log: Path) -> Gateway:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(source), PAGEDSERVE_MODEL=str(model), PAGEDSERVE_REDIS_URL=redis_url,
               PAGEDSERVE_PORT=str(port), PAGEDSERVE_LOG_LEVEL="warning", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=source, env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                wait_idle(proc.pid, deadline)
                return Gateway(proc, url)
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the gateway from {source} exited: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    raise SystemExit(f"the gateway from {source} did not start")


def wait_idle(pid: int, deadline: float) -> None:
    """Until the process has done its start-up work (the gateway imports the chat-template renderer in the
    background, seconds of CPU that the first measure would count): under 10 % of a core for half a second."""
    used = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        used, before = cpu_seconds(pid), used
        if used - before < 0.05:
            return


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, float]:
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - start


async def probe_under_big_prompts(url: str, big: int) -> dict[str, float]:
    """Latency of a 1-token probe, alone and while `big` ~4 MB prompts are being tokenized."""
    text = ("The blocks of a sequence need not be contiguous in memory. " * 80_000)[:BIG_PROMPT_CHARS]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        idle = [(await post(session, url, {"prompt": "hi", "max_tokens": 1}))[1] for _ in range(20)]
        bigs = [asyncio.ensure_future(post(session, url, {"prompt": text, "max_tokens": 1})) for _ in range(big)]
        await asyncio.sleep(0.3)
        loaded = []
        while not all(b.done() for b in bigs):
            loaded.append((await post(session, url, {"prompt": "hi", "max_tokens": 1}))[1])
            await asyncio.sleep(0.1)
        big_s = [b.result()[1] for b in bigs]
    return {"idle p50 ms": 1000 * statistics.median(idle), "loaded p50 ms": 1000 * statistics.median(loaded),
            "loaded max ms": 1000 * max(loaded), "probes": len(loaded), "big prompts done s": max(big_s)}


async def burst(url: str, count: int) -> dict[str, float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(post(session, url, {"prompt": f"{i} hi", "max_tokens": 4})
                                         for i in range(count)))
        wall = time.perf_counter() - start
    statuses = [s for s, _ in results]
    return {"200": statuses.count(200), "429": statuses.count(429), "503": statuses.count(503),
            "other": sum(s not in (200, 429, 503) for s in statuses), "wall s": wall}


async def stream_cost(url: str, pid: int, tokens: int, streams: int) -> dict[str, float]:
    """Gateway CPU per token for `streams` concurrent streams of `tokens` tokens each (logprobs off)."""
    async def one(session: aiohttp.ClientSession) -> int:
        body = {"prompt": [3], "max_tokens": tokens, "stream": True}  # prompt token 3: answered with `tokens`
        async with session.post(url + "/v1/completions", json=body) as resp:
            # an event's data line, after its `id:` line where the gateway numbers its events
            return sum(1 for event in (await resp.read()).split(b"\n\n") if b"data: {" in event)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        cpu, start = cpu_seconds(pid), time.perf_counter()
        events = await asyncio.gather(*(one(session) for _ in range(streams)))
        cpu, wall = cpu_seconds(pid) - cpu, time.perf_counter() - start
    return {"tokens": tokens * streams, "events": sum(events), "gateway CPU us/token": 1e6 * cpu / (tokens * streams),
            "tokens/s": tokens * streams / wall}


def table(title: str, rows: dict[str, dict[str, float]]) -> None:
    columns = list(next(iter(rows.values())))
    print(f"\n{title}\n")
    print("| source | " + " | ".join(columns) + " |")
    print("| --- | " + " | ".join("---:" for _ in columns) + " |")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


async def measure(gw: Gateway, redis_url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    driver = asyncio.create_task(answer_requests(redis_url, {3: args.stream_tokens}, 1, args.step_ms / 1000))
    out = {}
    try:
        if "probe" in args.parts:
            out["probe"] = await probe_under_big_prompts(gw.url, args.big)
        for count in (256, 1024) if "burst" in args.parts else ():
            out[f"burst {count}"] = await burst(gw.url, count)
            await asyncio.sleep(0.5)
            out[f"burst {count}"]["redis conns after"] = len(redis.Redis.from_url(redis_url).client_list()) - 2
        if "stream" in args.parts:
            out["stream"] = await stream_cost(gw.url, gw.proc.pid, args.stream_tokens, args.streams)
        return out
    finally:
        driver.cancel()


async def stream_together(gws: list[Gateway], redis_url: str, args: argparse.Namespace) -> list[list[dict[str, float]]]:
    """Per round, per gateway: its CPU per streamed token while every gateway streams at once (`stream_cost`)."""
    driver = asyncio.create_task(answer_requests(redis_url, {3: args.stream_tokens}, 1, args.step_ms / 1000))
    try:
        return [await asyncio.gather(*(stream_cost(gw.url, gw.proc.pid, args.stream_tokens, args.streams)
                                       for gw in gws)) for _ in range(args.rounds)]
    finally:
        driver.cancel()


def run(sources: list[Path], model: Path, tmp: Path, args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """{row name: {part: its measures}}: each source's gateway alone in turn, or all at once (`--together`)."""
    results = {}
    names = [str(s) if sources.count(s) == 1 else f"{s} ({k + 1})" for k, s in enumerate(sources)]
    for group in [list(range(len(sources)))] if args.together else [[k] for k in range(len(sources))]:
        port = free_port()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{port}/0"
        gws: list[Gateway] = []
        try:
            time.sleep(0.5)
            gws = [start_gateway(sources[k].resolve(), model, redis_url, tmp / f"gateway-{k}.log") for k in group]
            if args.together:
                for r, row in enumerate(asyncio.run(stream_together(gws, redis_url, args))):
                    results |= {f"{names[k]} round {r + 1}": {"stream": cost} for k, cost in zip(group, row)}
            else:
                results[names[group[0]]] = asyncio.run(measure(gws[0], redis_url, args))
        finally:
            for proc in [gw.proc for gw in gws] + [server]:
                proc.terminate()
                proc.wait(30)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", type=Path, default=[],
                        help="a source tree to run the gateway from (repeat to compare); default: this one")
    parser.add_argument("--parts", default="probe,burst,stream", help="what to measure (comma-separated)")
    parser.add_argument("--big", type=int, default=4, help="concurrent ~4 MB prompts")
    parser.add_argument("--stream-tokens", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (per gateway)")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="write one token per running request every this many ms, as decode steps do (0: all of "
                             "a request's tokens at once)")
    parser.add_argument("--together", action="store_true",
                        help="the stream part only, with every source's gateway streaming at the same time on one "
                             "Redis, so that all share the same machine load: a fair A/B on a busy machine")
    parser.add_argument("--rounds", type=int, default=3, help="with --together: how many times to measure")
    args = parser.parse_args()
    sources = args.source or [Path(__file__).resolve().parents[1]]
    from pagedserve.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        results = run(sources, write_tiny_model(Path(tmp) / "tiny"), Path(tmp), args)
    for part in next(iter(results.values())):
        table(part, {name: r[part] for name, r in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
