"""How many workers one scheduler keeps busy (issue 39): simulated workers of the H200 profile (Llama-3-8B, a decode
step of 256 sequences in ~14-17 ms), 256 running sequences each.

    python -m benchmarks.scheduler_capacity --bus-workers 4 8 16 --out benchmarks/results/scheduler_capacity.json

**Measured** (`--workers 1 2 4`, what two cores hold at real speed): `pagedserve up --workers N --simulate
h200-llama-3-8b` with N x 288 greedy requests put on the bus directly (no gateway in the path: its cost per token is
benchmarks.gateway_load's), each decoding --output-len tokens after a --input-len prompt. Over a --window of steady
decode: the share of the window each worker waited for its next plan (`pagedserve_worker_plan_wait_seconds`, what
the workers report), the share its modelled steps took (the steps it ran, each the cost model's time for 256
sequences at the window's mean context: the rest is its own host work and the wait), and from /proc and Redis's
INFO the CPU the scheduler spent per step and per sequence, the workers' CPU per step, Redis's CPU and commands per
generated token.

**Measured past what the full stack holds** (`--bus-workers 4 8 16`): the same requests and window on a Redis, the
scheduler service and benchmarks/bus_workers.py's workers, which read their plans, take the cost model's time and
answer with tokens, many to a process, writing no `out:` streams: the scheduler's side at real speed, where two cores
cannot hold as many full workers (their CPU and Redis's per token are the full stack's rows). A bus worker's wait
runs to when its plan landed in Redis, not to when its process, shared by all of them, got to reading it.

**Computed** (1 to 64 workers): with a lookahead, a worker waits when the scheduler cannot plan every worker's next
step within one step: busy = min(1, step time / (N x the scheduler's CPU per step)), from the figure measured with
the most workers (a scheduler's cost per step falls as it plans several workers a round), checked against the runs
that fit. Redis's single core caps the tokens per second at 1 / its CPU per token, from the one-worker full stack (bus
workers write no `out:` streams); the table says how many workers that is.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import redis

from benchmarks.bus_client import BusClient
from benchmarks.proc_cpu import cpu_seconds
from benchmarks.redis_servers import LocalRedis
from benchmarks.up_process import UpProcess
from gpu_worker.cost_model import ChunkSize, get_profile
from pagedserve.local_redis import REDIS
from pagedserve.ports import free_port
from pagedserve.tiny_model import write_tiny_model
from shared.model_dir import default_model_dir
from shared.protocol import SchedulerStats
from shared.sampling import SamplingParams

PROFILE = "h200-llama-3-8b"
SEQS = 256
FULL, BUS = "full stack", "bus workers"


@dataclass(slots=True)
class Measured:
    workers: int
    kind: str  # "full stack" (pagedserve up) or "bus workers" (benchmarks/bus_workers.py)
    window_s: float
    steps: int  # plans all workers ran in the window
    waiting: list[float]  # per worker: the share of the window it waited for its next plan (its own report)
    busy: list[float]  # per worker: the share of the window its modelled steps took
    scheduler_cores: float  # the scheduler's CPU seconds per second of the window
    scheduler_ms_per_step: float
    scheduler_us_per_seq: float
    worker_ms_per_step: float
    redis_us_per_token: float
    redis_commands_per_token: float
    step_ms: float  # the cost model's decode step at the window's mean context


def step_seconds(context: int) -> float:
    return get_profile(PROFILE).step_time([ChunkSize(context, 1)] * SEQS, SEQS)


def snapshot(client: BusClient, server: redis.Redis, pids: dict[str, int]) -> tuple[SchedulerStats, dict, dict]:
    """The scheduler's stats (published every 0.25 s: the first after this call), each process's CPU seconds and
    Redis's command counts, taken together."""
    first = client.stats()
    while (stats := client.stats()) is None or first is None or stats.time == first.time:
        time.sleep(0.01)
    cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    calls = {k: v["calls"] for k, v in server.info("commandstats").items()}
    return stats, cpu, calls


@dataclass(slots=True)
class Stack:
    """A running stack to measure: its Redis URL and the pids of the scheduler, the worker processes and Redis."""
    url: str
    pids: dict[str, int]


@contextmanager
def full_stack(workers: int, model: Path, log: Path) -> Iterator[Stack]:
    """`pagedserve up` with simulated workers of the profile, one process each."""
    up = UpProcess.start(["--workers", str(workers), "--simulate", PROFILE, "--model", str(model), "--port",
                          str(free_port()), "--max-num-seqs", str(SEQS), "--max-num-batched-tokens", "8192"], log)
    try:
        children = up.pids()
        pids = {name: pid for name, pid in children.items() if name == "scheduler" or name.startswith("worker")}
        yield Stack(up.redis_url(), pids | {"redis": children[REDIS]})
    finally:
        up.stop()


@contextmanager
def bus_stack(workers: int, workdir: Path) -> Iterator[Stack]:
    """A Redis, the scheduler service and benchmarks/bus_workers.py's workers (all of them in one process)."""
    server = LocalRedis(workdir / f"redis-{workers}", appendfsync="everysec")
    server.start()
    procs: list[subprocess.Popen] = []
    try:
        with open(workdir / f"bus-{workers}.log", "wb") as log:
            for command in (["-m", "scheduler", "--redis-url", server.url, "--max-num-seqs", str(SEQS),
                             "--max-num-batched-tokens", "8192"],
                            ["-m", "benchmarks.bus_workers", "--redis-url", server.url, "--workers", str(workers),
                             "--profile", PROFILE]):
                procs.append(subprocess.Popen([sys.executable, *command], stdout=log, stderr=log))
        yield Stack(server.url, {"scheduler": procs[0].pid, "workers": procs[1].pid, "redis": server.proc.pid})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.stop()


def measure(stack: Stack, workers: int, kind: str, args: argparse.Namespace) -> Measured:
    client = BusClient(stack.url)
    server = redis.Redis.from_url(stack.url)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    client.wait_for(lambda: (s := client.stats()) is not None and len(s.workers) == workers,
                    "the scheduler to see every worker", timeout=60)  # a request goes to a worker it sees on arrival
    rng = random.Random(workers)

    def submit(count: int) -> None:
        for _ in range(count):
            client.submit([rng.randrange(5, 500) for _ in range(args.input_len)], params)

    # An eighth more than the seats: placement weighs each worker's work to come, so a burst does not split
    # evenly; the extras wait, and every worker keeps 256 running through the window. Should a worker still run
    # fewer after a while, its shortfall goes in again (placement sends the most to the least loaded).
    submit(workers * SEQS * 9 // 8)
    deadline = time.monotonic() + 120 + 10 * workers
    running = [w.running for w in client.stats().workers]
    while any(n != SEQS for n in running):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for every worker to run {SEQS} sequences")
        time.sleep(5.0)
        before, running = running, [w.running for w in client.stats().workers]
        if running == before:  # no admission in 5 s: the workers short of 256 have nothing waiting
            submit(sum(SEQS - n for n in running))
    time.sleep(args.settle)
    before = snapshot(client, server, stack.pids)
    time.sleep(args.window)
    after = snapshot(client, server, stack.pids)
    (s0, cpu0, calls0), (s1, cpu1, calls1) = before, after
    if not all(w.running == SEQS for w in (*s0.workers, *s1.workers)):
        raise RuntimeError(f"a worker ran fewer than {SEQS} sequences at the start or the end of the window (the first "
                           "requests ended in it?): lengthen --output-len or shorten --window")
    window = s1.time - s0.time
    steps = {w.worker_id: w.steps for w in s1.workers}
    waited = {w.worker_id: w.plan_wait for w in s1.workers}
    for w in s0.workers:
        steps[w.worker_id] -= w.steps
        waited[w.worker_id] -= w.plan_wait
    total_steps = sum(steps.values())
    tokens = total_steps * SEQS
    # Every sequence started together and gains a token a step: the context at a step is the prompt and the steps
    # before it (the mean over workers; they run in step).
    done_before = statistics.mean(w.steps for w in s0.workers)
    mean_context = args.input_len + done_before + total_steps / workers / 2
    step_s = step_seconds(int(mean_context))
    worker_cpu = sum(cpu1[n] - cpu0[n] for n in cpu0 if n.startswith("worker"))
    commands = sum(calls1.values()) - sum(calls0.get(k, 0) for k in calls1)
    scheduler_cpu = cpu1["scheduler"] - cpu0["scheduler"]
    return Measured(workers, kind, window, total_steps, [waited[w] / window for w in sorted(steps)],
                    [steps[w] * step_s / window for w in sorted(steps)], scheduler_cpu / window,
                    1e3 * scheduler_cpu / total_steps, 1e6 * scheduler_cpu / tokens, 1e3 * worker_cpu / total_steps,
                    1e6 * (cpu1["redis"] - cpu0["redis"]) / tokens, commands / tokens, 1e3 * step_s)


def computed(measured: list[Measured], counts: list[int]) -> list[dict]:
    """Busy share and the limits for `counts` workers: the scheduler's cost per step measured with the most workers,
    Redis's per token with one full worker."""
    base = next(m for m in measured if m.workers == 1 and m.kind == FULL)
    largest = max(measured, key=lambda m: (m.workers, m.kind == BUS))  # (the bus workers' run, of as many)
    step_ms, sched_ms = largest.step_ms, largest.scheduler_ms_per_step
    redis_tokens_s = 1e6 / base.redis_us_per_token
    rows = []
    for n in counts:
        busy = min(1.0, step_ms / (n * sched_ms))
        rows.append({"workers": n, "busy": busy, "scheduler_cores": n * sched_ms / step_ms,
                     "tokens_per_s": n * SEQS / (step_ms / 1e3) * busy,
                     "redis_cores": n * SEQS / (step_ms / 1e3) * base.redis_us_per_token / 1e6})
    rows.append({"redis_workers_cap": redis_tokens_s / (SEQS / (step_ms / 1e3))})
    return rows


def format_report(report: dict) -> str:
    lines = ["Measured (the real scheduler and Redis; workers simulated at real speed: the full stack's, or bus",
             "workers that only read plans and answer, many to a process; shares are each worker's, else their mean):",
             "", "| workers | kind | waiting for a plan | modelled steps | scheduler cores | scheduler ms/step | "
             "scheduler µs/seq | worker ms/step | Redis µs/token | Redis commands/token | modelled step ms |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in report["measured"]:
        lines.append(f"| {m['workers']} | {m['kind']} | {_shares(m['waiting'])} | {_shares(m['busy'])} | "
                     f"{m['scheduler_cores']:.2f} | {m['scheduler_ms_per_step']:.2f} | "
                     f"{m['scheduler_us_per_seq']:.2f} | "
                     f"{m['worker_ms_per_step']:.2f} | {m['redis_us_per_token']:.2f} | "
                     f"{m['redis_commands_per_token']:.3f} | {m['step_ms']:.1f} |")
    lines += ["", "Computed (busy = min(1, step / (N x scheduler CPU per step)); the scheduler's CPU per step as "
              "measured with the most workers, Redis's per token with one full worker):", "",
              "| workers | busy | scheduler cores needed | output tok/s | Redis cores needed |",
              "|---:|---:|---:|---:|---:|"]
    for row in report["computed"]:
        if "workers" in row:
            lines.append(f"| {row['workers']} | {row['busy']:.0%} | {row['scheduler_cores']:.2f} | "
                         f"{row['tokens_per_s']:,.0f} | {row['redis_cores']:.2f} |")
        else:
            lines.append(f"\nOne Redis core holds about {row['redis_workers_cap']:.0f} such workers.")
    return "\n".join(lines)


def _shares(shares: list[float]) -> str:
    if len(shares) > 4:
        return f"{statistics.mean(shares):.0%} (min {min(shares):.0%}, max {max(shares):.0%})"
    return ", ".join(f"{s:.0%}" for s in shares)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4], help="worker counts run on the full stack")
    p.add_argument("--bus-workers", type=int, nargs="*", default=[], help="worker counts run as bus workers")
    p.add_argument("--computed", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1800, help="long enough to outlast the measurement (the tiny "
                   "model, whose tokenizer the simulated workers use, holds 2,048 tokens)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of decode before the window")
    p.add_argument("--window", type=float, default=10.0, help="seconds measured")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model = default_model_dir()
    if not (model / "config.json").exists():
        write_tiny_model(model)
    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-capacity-"))
    measured = []
    runs = [(n, FULL, lambda n=n: full_stack(n, model, workdir / f"up-{n}.log")) for n in args.workers]
    runs += [(n, BUS, lambda n=n: bus_stack(n, workdir)) for n in args.bus_workers]
    for n, kind, stack in runs:
        with stack() as running:
            m = measure(running, n, kind, args)
        measured.append(m)
        print(f"[{n} workers, {kind}] waiting {_shares(m.waiting)}; scheduler {m.scheduler_cores:.2f} cores, "
              f"{m.scheduler_ms_per_step:.2f} ms/step ({m.scheduler_us_per_seq:.2f} µs/seq)", file=sys.stderr)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "profile": PROFILE,
              "args": vars(args) | {"out": None}, "measured": [asdict(m) for m in measured],
              "computed": computed(measured, args.computed)
              if any(m.workers == 1 and m.kind == FULL for m in measured) else []}
    print(format_report(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
