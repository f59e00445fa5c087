"""Soak: minutes of mixed load against `pagedserve up` while its workers and its scheduler are SIGKILLed.

Starts `pagedserve up` as a user would (a subprocess; its children's pids from its `started NAME (pid N)` log
lines, its Redis password from the config file whose path it logs) with a small KV cache (`--num-blocks`), so
that requests get preempted. Clients (aiohttp) then loop over a fixed pool of /v1/completions requests: greedy
and seeded ones (n = 1..3), unseeded n > 1, greedy ones with a stop string, streamed or not, some streams
dropped by their client after a few chunks. Every `--kill-every` seconds a worker or the scheduler (in turn)
gets SIGKILL; the launcher restarts it. Once the load stops and the stack is idle it prints one table:

- requests sent, completed, failed (by HTTP status or error event), lost (no byte for `--stall-s` seconds, or a
  stream that ended or was cut after its 200 with neither `[DONE]` nor an error event);
- tokens duplicated, missing or different, against the in-process engine's (`pagedserve.engine.Engine`, the
  same model and settings, no faults) answer to the same request: token by token (logprobs' token texts) for
  greedy and seeded requests, the text (the answer's tokens through the gateway's own detokenizer) for every
  request with known tokens and the stop-string ones, the count for unseeded ones; a stream its client
  dropped must be a prefix of the answer;
- KV blocks still held per worker and requests still queued (the scheduler's `stats` key), requests left
  unacknowledged on the bus;
- Redis keys by pattern (how many, how many without a TTL, stream entries), and per process (the launcher,
  the gateway, the scheduler, the workers, redis-server) RSS, Redis connections (CLIENT LIST, matched to the
  process by its socket) and open sockets, at the start (after a warm-up) and at the end.

    python -m benchmarks.soak --minutes 10 --workers 2 --kill-every 45 --seed 0
"""
from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

from benchmarks.up_process import UpProcess
from pagedserve import bench as serving
from shared.keys import Keys
from shared.protocol import ProtocolError, SchedulerStats, decode
from shared.sampling import SamplingParams
from shared.settings import Settings

SETTLE_TIMEOUT_S = 90.0
STATS_EVERY_S = 1.0
# Key families with a variable part (a request, worker or gateway id); every other key is its own pattern.
VARIABLE_FAMILIES = ("out", "plans", "heartbeat", "gateway")


# ---- the request pool and its fault-free answers --------------------------------------------------------


@dataclass(slots=True)
class Expected:
    """One choice's fault-free answer; `tokens` None where only the text (stop strings) or only the count
    (unseeded sampling) can be checked."""
    text: str | None
    tokens: list[str] | None
    count: int | None
    finish_reason: str


@dataclass(slots=True)
class Case:
    kind: str  # "greedy", "seeded", "stop" or "sampled"
    body: dict[str, Any]
    expected: list[Expected] = field(default_factory=list)


def build_pool(rng: random.Random, prompts: int, vocab: int) -> list[Case]:
    """Prompts (a third share a 64-token prefix, for prefix-cache hits) and, per prompt, a greedy and a seeded
    case (answers filled in by `fill_expected`) and an unseeded n > 1 one (only its token counts are known)."""
    shared = [rng.randrange(5, vocab) for _ in range(64)]
    cases = []
    for i in range(prompts):
        own = [rng.randrange(5, vocab) for _ in range(rng.randrange(8, 128))]
        prompt = shared + own if i % 3 == 0 else own
        cases.append(Case("greedy", {"prompt": prompt, "max_tokens": rng.randrange(16, 65), "temperature": 0.0,
                                     "n": rng.choice([1, 1, 1, 2]), "ignore_eos": True, "logprobs": 1}))
        cases.append(Case("seeded", {"prompt": prompt, "max_tokens": rng.randrange(16, 49), "temperature": 0.9,
                                     "top_p": 0.95, "seed": rng.randrange(1 << 31), "n": rng.choice([1, 2, 3]),
                                     "ignore_eos": True, "logprobs": 1}))
        max_tokens, n = rng.randrange(16, 33), rng.choice([2, 3, 4])
        cases.append(Case("sampled", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "n": n,
                                      "ignore_eos": True, "logprobs": 1},
                          [Expected(None, None, max_tokens, "length")] * n))
    return cases


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """The SamplingParams the gateway makes of one of our bodies."""
    return SamplingParams(n=body["n"], max_tokens=body["max_tokens"], temperature=body["temperature"],
                          top_p=body.get("top_p", 1.0), seed=body.get("seed"), ignore_eos=body["ignore_eos"],
                          logprobs=body.get("logprobs"))


def rendered(tokenizer: Any, prompt: list[int], token_ids: list[int]) -> str:
    """The text the gateway makes of output tokens with no fault: its incremental detokenizer, seeded with the
    prompt's last tokens (so a character begun in the prompt is not the output's)."""
    from gateway.detokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer.after_prompt(tokenizer.decode, prompt)
    return "".join(detokenizer.add(t) for t in token_ids) + detokenizer.flush()


def fill_expected(cases: list[Case], settings: Settings, rng: random.Random) -> list[Case]:
    """Run the greedy and seeded cases in the in-process engine (no faults), record their answers, and add a
    stop-string case per greedy answer that has a plain-ASCII stretch to stop at."""
    from gateway.model import Tokenizer
    from pagedserve.engine import Engine

    tokenizer = Tokenizer.load(Path(settings.model))
    engine = Engine(settings)
    checked = [c for c in cases if c.kind in ("greedy", "seeded")]
    completions = engine.generate([c.body["prompt"] for c in checked], [sampling_params(c.body) for c in checked])
    stops = []
    for case, completion in zip(checked, completions):
        if completion.error is not None:
            raise RuntimeError(f"the engine failed a {case.kind} case: {completion.error}")
        for sample in completion.samples:
            text = rendered(tokenizer, case.body["prompt"], sample.token_ids)
            case.expected.append(Expected(text, [tokenizer.token_text(t) for t in sample.token_ids],
                                          len(sample.token_ids), sample.finish_reason))
        if case.kind == "greedy":
            text = case.expected[0].text
            # A stop string from the middle of the answer, letters only (no byte split across tokens there).
            spots = [m for m in re.finditer(r"[A-Za-z]{3,}", text) if m.start() > 4]
            if spots:
                spot = rng.choice(spots)
                stop = spot.group()[:6]
                cut = text[:text.index(stop)]
                body = {k: v for k, v in case.body.items() if k != "logprobs"} | {"stop": [stop]}
                stops.append(Case("stop", body, [Expected(cut, None, None, "stop")] * body["n"]))
    return cases + stops


# ---- one request -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class Outcome:
    case: Case
    stream: bool
    drop_after: int | None  # the client drops the stream after this many chunks
    result: str = ""  # "completed", "dropped by its client", "HTTP 503", "error event", "lost: ..."
    detail: str = ""
    choices: dict[int, Choice] = field(default_factory=dict)
    completion_tokens: int | None = None


async def send(session: aiohttp.ClientSession, url: str, model: str, case: Case, stream: bool,
               drop_after: int | None, stall_s: float) -> Outcome:
    out = Outcome(case, stream, drop_after)
    body = case.body | {"model": model, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=stall_s)
    answered = False
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=timeout) as resp:
            answered = True
            if resp.status != 200:
                out.result, out.detail = f"HTTP {resp.status}", (await resp.text())[:300]
                return out
            if not stream:
                data = await resp.json()
                for c in data["choices"]:
                    out.choices[c["index"]] = Choice(c["text"], (c.get("logprobs") or {}).get("tokens", []),
                                                     c["finish_reason"])
                out.completion_tokens = data["usage"]["completion_tokens"]
                out.result = "completed"
                return out
            chunks = 0
            async for data in serving.sse_data(resp.content):
                if data == b"[DONE]":
                    out.result = "completed"
                    return out
                event = json.loads(data)
                if "error" in event:
                    out.result, out.detail = "error event", json.dumps(event["error"])[:300]
                    return out
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                for c in event.get("choices", []):
                    choice = out.choices.setdefault(c["index"], Choice())
                    choice.text += c["text"]
                    choice.tokens += (c.get("logprobs") or {}).get("tokens", [])
                    choice.finish_reason = c["finish_reason"] or choice.finish_reason
                chunks += bool(event.get("choices"))
                if drop_after is not None and chunks >= drop_after:
                    resp.close()  # the client goes away mid-stream
                    out.result = "dropped by its client"
                    return out
            out.result = "lost: stream ended without [DONE] or error"
    except asyncio.TimeoutError:
        out.result = f"lost: nothing for {stall_s:.0f} s"
    except aiohttp.ClientError as e:
        # Cut after a 200 with no error event: the answer is lost; before any answer: a failure to connect.
        out.result = "lost: connection cut after 200" if answered else "connection error"
        out.detail = f"{type(e).__name__}: {e}"[:300]
    return out


# ---- checking answers ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    choices_checked: int = 0
    choices_exact: int = 0
    tokens_expected: int = 0
    duplicated: int = 0  # tokens received beyond the answer (an insertion)
    missing: int = 0  # tokens of the answer never received (a deletion)
    different: int = 0  # tokens received in place of the answer's
    texts_differing: int = 0  # choices whose text is not the answer's
    wrong_finish: int = 0
    wrong_usage: int = 0  # usage.completion_tokens other than the tokens received
    drops_checked: int = 0
    drops_not_prefix: int = 0  # dropped streams whose tokens are not a prefix of the answer
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 8:
            self.examples.append(what)


def token_diff(expected: list[str], got: list[str]) -> tuple[int, int, int]:
    """(duplicated, missing, different) tokens that turn `expected` into `got`."""
    duplicated = missing = different = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=expected, b=got, autojunk=False).get_opcodes():
        if op == "insert":
            duplicated += b1 - b0
        elif op == "delete":
            missing += a1 - a0
        elif op == "replace":
            common = min(a1 - a0, b1 - b0)
            different += common
            missing += (a1 - a0) - common
            duplicated += (b1 - b0) - common
    return duplicated, missing, different


def check(outcome: Outcome, tally: Tally) -> None:
    case = outcome.case
    if outcome.result == "dropped by its client":
        for index, choice in outcome.choices.items():
            expected = case.expected[index]
            if expected.tokens is None:
                continue
            tally.drops_checked += 1
            if choice.tokens != expected.tokens[:len(choice.tokens)]:
                tally.drops_not_prefix += 1
                tally.note(f"dropped {case.kind} stream, choice {index}: {choice.tokens} is no prefix of "
                           f"{expected.tokens}")
        return
    if outcome.result != "completed":
        return
    received = 0
    for index, expected in enumerate(case.expected):
        choice = outcome.choices.get(index, Choice())
        tally.choices_checked += 1
        exact = True
        if expected.tokens is not None:
            dup, miss, diff = token_diff(expected.tokens, choice.tokens)
            tally.duplicated, tally.missing, tally.different = (tally.duplicated + dup, tally.missing + miss,
                                                                tally.different + diff)
            tally.tokens_expected += len(expected.tokens)
            exact = not (dup or miss or diff)
        elif expected.count is not None:
            got = len(choice.tokens)
            tally.duplicated += max(got - expected.count, 0)
            tally.missing += max(expected.count - got, 0)
            tally.tokens_expected += expected.count
            exact = got == expected.count
        if expected.text is not None and choice.text != expected.text:
            tally.texts_differing += 1
            exact = False
        if choice.finish_reason != expected.finish_reason:
            tally.wrong_finish += 1
            exact = False
        if not exact:
            tally.note(f"{case.kind} ({'stream' if outcome.stream else 'whole'}), choice {index}: got "
                       f"{choice.text!r} ({choice.finish_reason}), expected {expected.text!r} "
                       f"({expected.finish_reason})")
        tally.choices_exact += exact
        received += len(choice.tokens)
    if case.kind != "stop" and outcome.completion_tokens is not None and outcome.completion_tokens != received:
        tally.wrong_usage += 1


# ---- the load, the faults, the scheduler's stats -------------------------------------------------------------


@dataclass(slots=True)
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (seconds into the load, child, pid)
    preemptions: int = 0  # summed over the scheduler's lives (its counter restarts with it)
    peak_blocks_held: dict[str, int] = field(default_factory=dict)
    stats: SchedulerStats | None = None  # the first snapshot after the load with no request left
    launcher_exit: int | None = None
    load_s: float = 0.0  # until the last client's last answer
    settle_s: float = 0.0  # then until the scheduler showed no request left


async def clients(up: UpProcess, model: str, cases: list[Case], args: argparse.Namespace, run: Run,
                  deadline: float) -> None:
    async def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline and up.proc.poll() is None:
            case = rng.choice(cases)
            stream = rng.random() < 0.6
            drop_after = rng.randrange(1, 8) if stream and rng.random() < args.drop_share else None
            run.outcomes.append(await send(session, up.url, model, case, stream, drop_after, args.stall_s))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(args.seed * 1000 + i) for i in range(args.concurrency)))


async def killer(up: UpProcess, args: argparse.Namespace, run: Run, t0: float, deadline: float) -> None:
    """SIGKILL a worker, then the scheduler, then the next worker, ...: one every `kill_every` seconds."""
    k = 0
    while time.monotonic() + args.kill_every < deadline and up.proc.poll() is None:
        await asyncio.sleep(args.kill_every)
        name = f"worker-{(k // 2) % args.workers}" if k % 2 == 0 else "scheduler"
        pid = up.pids()[name]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it died on its own, or is between restarts
            continue
        run.kills.append((time.monotonic() - t0, name, pid))
        print(f"soak: {time.monotonic() - t0:6.0f} s: SIGKILL {name} (pid {pid}); {len(run.outcomes)} requests "
              "answered so far", file=sys.stderr, flush=True)
        k += 1


async def watch_stats(redis_url: str, run: Run, stop: asyncio.Event) -> None:
    """Follow the scheduler's stats: preemptions over its restarts, the most blocks each worker held."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=5)
    last: SchedulerStats | None = None
    try:
        while not stop.is_set():
            stats = await read_stats(client)
            if stats is not None and (last is None or stats.time > last.time):
                restarted = last is not None and stats.preemptions < last.preemptions
                run.preemptions += stats.preemptions - (0 if last is None or restarted else last.preemptions)
                for w in stats.workers:
                    held = w.num_blocks - w.free_blocks
                    run.peak_blocks_held[w.worker_id] = max(run.peak_blocks_held.get(w.worker_id, 0), held)
                last = stats
            try:
                await asyncio.wait_for(stop.wait(), STATS_EVERY_S)
            except asyncio.TimeoutError:
                pass
    finally:
        await client.aclose()


async def read_stats(client: Any) -> SchedulerStats | None:
    try:
        raw = await client.get(Keys().stats)
        return None if raw is None else decode(raw, SchedulerStats)
    except (redis.RedisError, OSError, ProtocolError):
        return None  # Redis busy or restarting: the next sample will do


async def load(up: UpProcess, model: str, cases: list[Case], args: argparse.Namespace) -> Run:
    run = Run()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    stop = asyncio.Event()
    stats = asyncio.create_task(watch_stats(up.redis_url(), run, stop))
    faults = asyncio.create_task(killer(up, args, run, t0, deadline)) if args.kill_every > 0 else None

    async def progress() -> None:
        while True:
            await asyncio.sleep(60)
            results = Counter(o.result for o in run.outcomes)
            print(f"soak: {time.monotonic() - t0:6.0f} s: {dict(results)}", file=sys.stderr, flush=True)

    ticker = asyncio.create_task(progress())
    try:
        await clients(up, model, cases, args, run, deadline)
        run.load_s = time.monotonic() - t0
        if faults is not None:
            faults.cancel()
        run.stats = await settle(up, args.workers, time.time())
        run.settle_s = time.monotonic() - t0 - run.load_s
    finally:
        ticker.cancel()
        stop.set()
        await stats
    run.launcher_exit = up.proc.poll()
    return run


async def settle(up: UpProcess, workers: int, since: float) -> SchedulerStats | None:
    """The first scheduler snapshot taken after `since` (wall clock) that shows every worker and no request
    left; after SETTLE_TIMEOUT_S, the last one seen (the table then shows what stayed)."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(up.redis_url(), socket_timeout=5)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    seen = None
    try:
        while time.monotonic() < deadline and up.proc.poll() is None:
            stats = await read_stats(client)
            if stats is not None and stats.time > since:
                seen = stats
                if (len(stats.workers) == workers and not (stats.running or stats.waiting or stats.preempted)
                        and all(w.running == 0 for w in stats.workers)):
                    break
            await asyncio.sleep(STATS_EVERY_S)
    finally:
        await client.aclose()
    return seen


# ---- snapshots of Redis and the processes ---------------------------------------------------------------------


@dataclass(slots=True)
class Process:
    name: str
    pid: int
    rss_mib: float
    sockets: int
    redis_connections: int


@dataclass(slots=True)
class Snapshot:
    keys: dict[str, tuple[int, int, int]]  # pattern → (keys, of them without a TTL, stream entries)
    unacknowledged: int  # requests read by a scheduler and not acknowledged
    blocks_held: dict[str, int]  # worker → blocks not free
    queued: tuple[int, int, int] | None  # requests running, waiting, preempted
    processes: list[Process]
    redis_clients: int
    redis_memory_mib: float


def key_pattern(key: str) -> str:
    parts = key.split(":")
    return ":".join(parts[:2]) + ":*" if len(parts) > 2 and parts[1] in VARIABLE_FAMILIES else key


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def tcp_local_ports() -> dict[str, int]:
    """Socket inode → local TCP port, over IPv4 and IPv6."""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            ports[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return ports


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else float("nan")


def snapshot(up: UpProcess, stats: SchedulerStats | None) -> Snapshot:
    keys = Keys()
    with redis.Redis.from_url(up.redis_url(), socket_timeout=10) as r:
        names = [n.decode() for n in r.scan_iter(match=f"{keys.prefix}:*", count=1000)]
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.ttl(name)
            pipe.type(name)
        replies = pipe.execute()
        pipe = r.pipeline(transaction=False)
        streams = [n for n, kind in zip(names, replies[1::2]) if kind == b"stream"]
        for name in streams:
            pipe.xlen(name)
        lengths = dict(zip(streams, pipe.execute()))
        families: dict[str, list[int]] = {}
        for name, ttl in zip(names, replies[::2]):
            row = families.setdefault(key_pattern(name), [0, 0, 0])
            row[0] += 1
            row[1] += ttl == -1
            row[2] += lengths.get(name, 0)
        try:
            unacked = int(r.xpending(keys.requests, keys.scheduler_group)["pending"])
        except redis.ResponseError:  # no group yet
            unacked = 0
        client_ports = [int(c["addr"].rsplit(":", 1)[1]) for c in r.client_list()]
        memory = r.info("memory")["used_memory"] / (1 << 20)
        if stats is None:
            raw = r.get(keys.stats)
            stats = None if raw is None else decode(raw, SchedulerStats)
    port_of = tcp_local_ports()
    processes = []
    owners = {}  # local port → process name
    pids = {"launcher": up.proc.pid} | {name: pid for name, pid in sorted(up.pids().items(), key=_order)}
    for name, pid in pids.items():
        inodes = socket_inodes(pid)
        for inode in inodes:
            if inode in port_of:
                owners.setdefault(port_of[inode], name)
        processes.append(Process(name, pid, rss_mib(pid), len(inodes), 0))
    per_name = Counter(owners.get(port, "not of the stack (1 is this snapshot's own)") for port in client_ports)
    for p in processes:
        p.redis_connections = per_name.pop(p.name, 0)
    processes += [Process(name, 0, float("nan"), 0, count) for name, count in per_name.items()]
    blocks = {w.worker_id: w.num_blocks - w.free_blocks for w in stats.workers} if stats else {}
    queued = (stats.running, stats.waiting, stats.preempted) if stats else None
    return Snapshot({k: tuple(v) for k, v in sorted(families.items())}, unacked, blocks, queued, processes,
                    len(client_ports), memory)


def _order(item: tuple[str, int]) -> tuple[int, str]:
    rank = {"gateway": 0, "scheduler": 1, "redis-server": 3}
    return rank.get(item[0], 2), item[0]


# ---- the report ------------------------------------------------------------------------------------------------


def table(run: Run, start: Snapshot, end: Snapshot, log: str) -> str:
    rows: list[tuple[str, str, str]] = []

    def add(what: str, at_start: object = "", at_end: object = "") -> None:
        rows.append((what, str(at_start), str(at_end)))

    results = Counter(o.result for o in run.outcomes)
    add("load, then settling (s)", "", f"{run.load_s:.0f}, then {run.settle_s:.0f}")
    add("SIGKILLs sent", "", ", ".join(f"{n} × {name}" for name, n in sorted(Counter(k[1] for k in run.kills)
                                                                              .items())) or "none")
    restarts = re.findall(r"(\S+) exited \(exit code (-?\d+)\); restarting", log)
    add("restarts by the launcher", "", f"{len(restarts)} ({sum(code == '-9' for _, code in restarts)} after "
        "SIGKILL)")
    add("launcher still running", "", "yes" if run.launcher_exit is None else f"no (exit {run.launcher_exit})")
    add("requests sent", "", len(run.outcomes))
    add("  completed", "", results.pop("completed", 0))
    add("  dropped by their client mid-stream (on purpose)", "", results.pop("dropped by its client", 0))
    for result in sorted(r for r in results if not r.startswith("lost")):
        add(f"  failed: {result}", "", results[result])
    lost = {r: n for r, n in results.items() if r.startswith("lost")}
    add("  lost (no answer, no error)", "", sum(lost.values()))
    for result, n in sorted(lost.items()):
        add(f"    {result.removeprefix('lost: ')}", "", n)
    tally = Tally()
    for outcome in run.outcomes:
        check(outcome, tally)
    add("choices checked against the fault-free answer", "", f"{tally.choices_checked} "
        f"({tally.tokens_expected} tokens)")
    add("  exact", "", tally.choices_exact)
    add("  tokens duplicated", "", tally.duplicated)
    add("  tokens missing", "", tally.missing)
    add("  tokens different", "", tally.different)
    add("  texts different", "", tally.texts_differing)
    add("  wrong finish reason", "", tally.wrong_finish)
    add("  usage.completion_tokens ≠ tokens received", "", tally.wrong_usage)
    add("dropped streams not a prefix of the answer", "", f"{tally.drops_not_prefix} of {tally.drops_checked}")
    add("preemptions (summed over scheduler restarts)", "", run.preemptions)
    for worker in sorted(set(start.blocks_held) | set(end.blocks_held)):
        add(f"KV blocks held: {worker} (peak during the load: {run.peak_blocks_held.get(worker, '?')})",
            start.blocks_held.get(worker, "-"), end.blocks_held.get(worker, "-"))
    add("requests running / waiting / preempted (scheduler)", " / ".join(map(str, start.queued or ("?",) * 3)),
        " / ".join(map(str, end.queued or ("?",) * 3)))
    add("requests unacknowledged on the bus", start.unacknowledged, end.unacknowledged)
    for pattern in sorted(set(start.keys) | set(end.keys)):
        add(f"Redis keys {pattern}: keys, without TTL, stream entries", _keys(start.keys.get(pattern)),
            _keys(end.keys.get(pattern)))
    add("Redis: clients connected, used memory", f"{start.redis_clients}, {start.redis_memory_mib:.1f} MiB",
        f"{end.redis_clients}, {end.redis_memory_mib:.1f} MiB")
    by_name_start = {p.name: p for p in start.processes}
    by_name_end = {p.name: p for p in end.processes}
    for name in dict.fromkeys([p.name for p in start.processes] + [p.name for p in end.processes]):
        add(f"{name}: RSS, Redis connections, sockets (pid)", _process(by_name_start.get(name)),
            _process(by_name_end.get(name)))
    add("log lines: WARNING / ERROR / Traceback", "", " / ".join(str(len(re.findall(p, log)))
                                                                 for p in (r"\bWARNING\b", r"\bERROR\b",
                                                                           r"Traceback")))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'measure':<{width}} | start | end |", f"| {'-' * width} | --- | --- |"]
    lines += [f"| {what:<{width}} | {a} | {b} |" for what, a, b in rows]
    if tally.examples:
        lines += ["", "first differences:"] + [f"- {e}" for e in tally.examples]
    failures = [o for o in run.outcomes if o.detail][:5]
    if failures:
        lines += ["", "first failures:"] + [f"- {o.result}: {o.detail}" for o in failures]
    return "\n".join(lines)


def _keys(row: tuple[int, int, int] | None) -> str:
    return "-" if row is None else f"{row[0]}, {row[1]}, {row[2]}"


def _process(p: Process | None) -> str:
    if p is None:
        return "-"
    if not p.pid:
        return f"{p.redis_connections} Redis connections"
    return f"{p.rss_mib:.0f} MiB, {p.redis_connections}, {p.sockets} (pid {p.pid})"


# ---- main ---------------------------------------------------------------------------------------------------


async def warm_up(up: UpProcess) -> str:
    """The served model's id, once one request was answered in full: the stack serves (the table's start column
    is taken after it)."""
    async with aiohttp.ClientSession() as session:
        model, _ = await serving.discover_model(session, up.url, {})
        async with session.post(up.url + "/v1/completions", json={"model": model, "prompt": [5, 6, 7],
                                                                   "max_tokens": 4, "temperature": 0}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the warm-up request failed: HTTP {resp.status} {await resp.text()}")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=45.0,
                        help="seconds between SIGKILLs, a worker and the scheduler in turn (0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny",
                        help="what `pagedserve up --model` takes (default: the built-in tiny model)")
    parser.add_argument("--num-blocks", type=int, default=48, help="KV blocks per worker: small, to preempt")
    parser.add_argument("--concurrency", type=int, default=12, help="clients, each one request at a time")
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts in the request pool")
    parser.add_argument("--drop-share", type=float, default=0.2,
                        help="share of streamed requests whose client drops them after a few chunks")
    parser.add_argument("--stall-s", type=float, default=180.0,
                        help="a request with no byte for this long counts as lost")
    parser.add_argument("--log", default="", help="where `pagedserve up` logs (default: a temporary file)")
    args = parser.parse_args(argv)

    from pagedserve.launcher import ensure_model
    from pagedserve.ports import free_port
    from shared.model_dir import read_config

    settings = ensure_model(Settings(model=args.model, dtype="float32", num_blocks=args.num_blocks,
                                     log_level="warning"))
    rng = random.Random(args.seed)
    cases = build_pool(rng, args.prompts, int(read_config(Path(settings.model))["vocab_size"]))
    print(f"soak: answering {len(cases)} cases in the in-process engine (the fault-free answers)", file=sys.stderr,
          flush=True)
    cases = fill_expected(cases, settings, rng)
    log_path = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="pagedserve-soak-")) / "up.log"
    print(f"soak: starting `pagedserve up` (its log: {log_path})", file=sys.stderr, flush=True)
    up = UpProcess.start(["--workers", str(args.workers), "--model", settings.model, "--port", str(free_port()),
                          "--dtype", settings.dtype, "--num-blocks", str(args.num_blocks)], log_path)
    try:
        model = asyncio.run(warm_up(up))
        start = snapshot(up, asyncio.run(settle(up, args.workers, time.time())))
        print(f"soak: {args.minutes:g} minutes of load, {args.concurrency} clients, {len(cases)} cases, a SIGKILL "
              f"every {args.kill_every:g} s", file=sys.stderr, flush=True)
        run = asyncio.run(load(up, model, cases, args))
        end = snapshot(up, run.stats)
        report = table(run, start, end, up.log())
    finally:
        up.stop()
    print(f"soak: `pagedserve up` log kept at {log_path}", file=sys.stderr)
    print(f"python -m benchmarks.soak {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
