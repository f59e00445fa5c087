"""Redis behind Sentinel (issue 39): what waiting for a replica costs a streamed token, and how long a failover of
the master stalls the streams.

    python -m benchmarks.failover --out benchmarks/results/failover.json

1. **Cost.** The same greedy streams on three stacks, `pagedserve up --workers 1 --model tiny` each, taking turns
   for --rounds rounds: `single` (up's own Redis, as a single box runs it), `sentinel-0` (a master, a replica and
   three Sentinels on this machine, AOF fsync'd every second as up's, `--replica-acks 0`: nothing waits for the
   replica) and `sentinel-1` (the default
   `--replica-acks 1`: a client is shown a token once the replica holds it, gateway/replication.py). Each phase keeps
   --concurrency streams of --max-tokens tokens in flight until --requests have ended, and reports TTFT, the gap
   between a stream's tokens (ITL), output tok/s, and the CPU the gateway and the Redis master spent per token (from
   /proc). The tiny model's steps take a few ms, so what the bus adds to a token shows.
2. **Failover.** On `sentinel-1`, --concurrency streams of --failover-tokens tokens; --kill-after seconds in, the
   master is SIGKILLed. Reported: the kill to the Sentinels naming the replica; per stream, its stall (its longest
   gap between two tokens) and the kill to the token that ends it (its first after the failover); whether every
   stream ended whole. The old master is brought back as a replica before the next of --failovers kills.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from benchmarks.proc_cpu import cpu_seconds
from benchmarks.redis_servers import SentinelTopology
from benchmarks.up_process import UpProcess
from pagedserve.bench import Endpoint, RunConfig, run_point, send_completion
from pagedserve.local_redis import REDIS
from pagedserve.ports import free_port
from pagedserve.tiny_model import write_tiny_model
from pagedserve.workloads import SampleRequest, WorkloadSpec, build_requests
from shared.model_dir import default_model_dir

STACKS = ("single", "sentinel-0", "sentinel-1")
WARM_S = 3.0  # after the warm-up requests: the gateway's chat-template import, a start-up thread, is over


@dataclass(slots=True)
class CostPoint:
    stack: str
    round: int
    requests: int
    failed: int
    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    out_tok_s: float
    gateway_us_per_token: float
    redis_us_per_token: float


@dataclass(slots=True)
class FailoverPoint:
    promoted_s: float  # the kill to the Sentinels naming the replica
    resumed_median_s: float  # the kill to a stream's first token after its stall (its longest gap), median
    resumed_max_s: float  # ... the last stream's
    stall_median_s: float  # a stream's longest gap between two tokens, median over the streams
    whole: int  # streams that ended with every token
    streams: int


async def closed_loop(endpoint: Endpoint, requests: list[SampleRequest], concurrency: int) -> dict:
    """Send `requests`, `concurrency` at a time: the benchmark client's point (pagedserve/bench.py), its metrics
    sampling off."""
    config = RunConfig(burstiness=1.0, max_concurrency=concurrency, seed=0, metrics_interval=0.0,
                       metrics_pattern=re.compile(""), disable_tqdm=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await run_point(session, endpoint, requests, math.inf, config)


def start_stack(stack: str, topology: SentinelTopology | None, model: Path, log: Path) -> UpProcess:
    args = ["--workers", "1", "--model", str(model), "--served-model-name", "tiny", "--dtype", "float32", "--port",
            str(free_port())]
    if stack != "single":
        args += ["--redis-url", topology.url, "--replica-acks", stack.removeprefix("sentinel-")]
    return UpProcess.start(args, log)


def endpoint(up: UpProcess) -> Endpoint:
    return Endpoint(up.url + "/v1/completions", up.url + "/metrics", "tiny", {})


async def cost_phase(stack: str, rnd: int, up: UpProcess, redis_pid: int, requests: list[SampleRequest],
                     concurrency: int) -> CostPoint:
    await closed_loop(endpoint(up), requests[:concurrency], concurrency)  # warm, and the gateway's start-up done
    await asyncio.sleep(WARM_S)
    gateway = up.pids()["gateway"]
    cpu_before = cpu_seconds(gateway), cpu_seconds(redis_pid)
    point = await closed_loop(endpoint(up), requests, concurrency)
    gateway_cpu, redis_cpu = (cpu_seconds(p) - b for p, b in zip((gateway, redis_pid), cpu_before))
    tokens = point["total_output_tokens"]
    return CostPoint(stack, rnd, point["num_prompts"], point["failed"], point["ttft_ms"]["p50"],
                     point["itl_ms"]["p50"], point["itl_ms"]["p99"], point["output_throughput"],
                     1e6 * gateway_cpu / tokens, 1e6 * redis_cpu / tokens)


async def failover_phase(up: UpProcess, topology: SentinelTopology, requests: list[SampleRequest],
                         kill_after: float) -> FailoverPoint:
    """Every request at once; the master SIGKILLed `kill_after` s in, brought back as a replica once they end."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(send_completion(session, endpoint(up), r)) for r in requests]
        await asyncio.sleep(kill_after)
        old = topology.kill_master()
        killed = time.perf_counter()
        await asyncio.to_thread(topology.wait_failover, old)
        promoted = time.perf_counter() - killed
        outputs = await asyncio.gather(*tasks)
    topology.bring_back(old)
    resumed, stalls = [], []
    for o in outputs:  # the stall is a stream's longest gap; the token that ends it is its first after the failover
        times = o.chunk_times()
        gap = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
        resumed.append(times[gap] - killed)
        stalls.append(times[gap] - times[gap - 1])
    return FailoverPoint(promoted, statistics.median(resumed), max(resumed), statistics.median(stalls),
                         sum(o.success and o.output_tokens == o.max_tokens for o in outputs), len(outputs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="times each stack takes its turn")
    p.add_argument("--requests", type=int, default=96, help="requests a cost phase sends")
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of a cost phase's stream")
    p.add_argument("--failovers", type=int, default=3, help="master kills under load")
    p.add_argument("--failover-tokens", type=int, default=1536, help="tokens of a stream a failover lands in")
    p.add_argument("--kill-after", type=float, default=1.5, help="seconds into the failover streams")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    model = default_model_dir()
    if not (model / "config.json").exists():
        write_tiny_model(model)
    spec = WorkloadSpec("random", args.requests, vocab_size=512, max_model_len=2048, input_len=args.input_len,
                        output_len=args.max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-failover-"))
    topology = SentinelTopology(workdir / "sentinel", appendfsync="everysec")  # as `pagedserve up` runs its Redis
    topology.start()
    costs: list[CostPoint] = []
    failovers: list[FailoverPoint] = []
    try:
        for rnd in range(args.rounds):
            for stack in STACKS:
                up = start_stack(stack, topology, model, workdir / f"up-{stack}-{rnd}.log")
                try:
                    redis_pid = up.pids()[REDIS] if stack == "single" else topology.server(
                        topology.master_port()).proc.pid
                    point = asyncio.run(cost_phase(stack, rnd, up, redis_pid, build_requests(spec, rnd, len(costs)),
                                                   args.concurrency))
                finally:
                    up.stop()
                costs.append(point)
                print(f"[cost] {stack} round {rnd}: ITL p50 {point.itl_p50_ms:.2f} ms, p99 {point.itl_p99_ms:.2f} ms, "
                      f"{point.out_tok_s:.0f} tok/s, gateway {point.gateway_us_per_token:.1f} us/token",
                      file=sys.stderr)
        up = start_stack("sentinel-1", topology, model, workdir / "up-failover.log")
        try:
            long = WorkloadSpec("random", args.concurrency, vocab_size=512, max_model_len=2048,
                                input_len=args.input_len, output_len=args.failover_tokens)
            for i in range(args.failovers):
                point = asyncio.run(failover_phase(up, topology, build_requests(long, 100 + i), args.kill_after))
                failovers.append(point)
                print(f"[failover] {i}: promoted {point.promoted_s:.2f} s, streams resumed "
                      f"{point.resumed_median_s:.2f} s after the kill (median); {point.whole}/{point.streams} whole",
                      file=sys.stderr)
        finally:
            up.stop()
    finally:
        topology.stop()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(args) | {"out": None},
              "cost": [asdict(c) for c in costs], "failover": [asdict(f) for f in failovers]}
    print(format_report(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def format_report(report: dict) -> str:
    lines = ["| stack | round | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | out tok/s | gateway µs/token | "
             "Redis master µs/token | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in report["cost"]:
        lines.append(f"| {c['stack']} | {c['round']} | {c['ttft_p50_ms']:.1f} | {c['itl_p50_ms']:.2f} | "
                     f"{c['itl_p99_ms']:.2f} | {c['out_tok_s']:.0f} | {c['gateway_us_per_token']:.1f} | "
                     f"{c['redis_us_per_token']:.1f} | {c['failed']} |")
    lines += ["", "| failover | promoted after the kill (s) | streams resumed after the kill, median / last (s) | "
              "a stream's stall, median (s) | whole |", "|---:|---:|---:|---:|---:|"]
    for i, f in enumerate(report["failover"]):
        lines.append(f"| {i} | {f['promoted_s']:.2f} | {f['resumed_median_s']:.2f} / {f['resumed_max_s']:.2f} | "
                     f"{f['stall_median_s']:.2f} | {f['whole']}/{f['streams']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
