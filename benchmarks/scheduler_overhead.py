"""Scheduler overhead: CPU time of one scheduling step (plan + apply result) per running batch size, and what
the dashboard's cache snapshots add to it.

Every request shares a system prefix, then decodes with `ignore_eos`; once all of them run in decode,
each step schedules one token for each of them. Timed: `Cluster.schedule` plus
`Cluster.apply_result`; the model-free worker that makes the result is not timed.

The snapshot table runs a steady state on caches of 1k/10k/100k blocks (128 requests about 70% full, half of
each prompt a shared prefix, a new request for each one that ends), its steps taking turns between three ways of
running: no monitor (the scheduler before the dashboard), the monitor as every scheduler runs it (`planned` per
plan, `tick` every 0.25 s), and the monitor with a dashboard watching (a snapshot built and encoded at the rate
`CacheMonitor.tick` allows).

    python -m benchmarks.scheduler_overhead [--seqs 64 256 1024] [--steps 300] [--snapshot-blocks 1000 10000 100000] [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.token_worker import TokenWorker
from scheduler.cluster import Cluster
from scheduler.service import TICK_S, settle_heap
from scheduler.snapshot import CacheMonitor
from shared.protocol import Request, WorkerRegistration, encode
from shared.sampling import SamplingParams
from shared.settings import Settings


def measure(num_seqs: int, caching: bool, steps: int, prompt_len: int, prefix_len: int, block_size: int,
            seed: int) -> list[float]:
    """Microseconds per step over `steps` decode steps of `num_seqs` running sequences."""
    rng = random.Random(seed)
    max_len = prompt_len + steps + 64
    num_blocks = num_seqs * (-(-max_len // block_size)) + 1
    settings = Settings(block_size=block_size, max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs),
                        enable_prefix_caching=caching)
    reg = WorkerRegistration("w0", "bench", num_blocks, 0, block_size, max_len + 1, [0])
    sched = Cluster(settings)
    sched.add_worker(reg)
    settle_heap()  # as the scheduler service does once started
    worker = TokenWorker(reg)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        prompt = prefix + [rng.randrange(1, 32000) for _ in range(prompt_len - prefix_len)]
        sched.add_request(Request(f"r{i}", "bench", prompt, params, 0.0))
    while True:  # warm up: prefill everything
        plan = sched.schedule("w0")
        sched.apply_result(worker.execute(plan).result)
        if plan.num_sequences == num_seqs and all(s.num_new_tokens == 1 for s in plan.sequences()):
            break
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule("w0")
        t1 = time.perf_counter()
        result = worker.execute(plan).result
        t2 = time.perf_counter()
        sched.apply_result(result)
        t3 = time.perf_counter()
        if plan.num_sequences != num_seqs:
            raise RuntimeError(f"expected {num_seqs} sequences a step, planned {plan.num_sequences}")
        samples.append(((t1 - t0) + (t3 - t2)) * 1e6)
    return samples


MODES = ("no monitor", "monitor", "watched")


def measure_snapshots(num_blocks: int, steps: int, seed: int) -> dict:
    """Per mode, microseconds per step (schedule + apply_result + the monitor's calls) over one steady state whose
    steps go to the three modes in turn; and the snapshots the watched mode built: build and encode times, sizes.
    Each mode has its own monitor and its own clock (the wall time of its steps, the worker's included), so it
    ticks every TICK_S and snapshots at the rate CacheMonitor allows as if it ran alone."""
    rng = random.Random(seed)
    bs, num_seqs = 16, 128
    per_seq = int(0.7 * num_blocks / num_seqs) * bs  # tokens of each request, prompt and output
    settings = Settings(block_size=bs, max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    reg = WorkerRegistration("w0", "bench", num_blocks, 0, bs, per_seq + 1, [0])
    cluster = Cluster(settings)
    cluster.add_worker(reg)
    worker = TokenWorker(reg)
    prefix = [rng.randrange(1, 32000) for _ in range(per_seq // 2)]
    arrivals = iter(range(1 << 30))

    def arrive() -> None:
        max_tokens = rng.randrange(16, 65)
        prompt = prefix + [rng.randrange(1, 32000) for _ in range(per_seq - max_tokens - len(prefix))]
        cluster.add_request(Request(f"r{next(arrivals)}", "bench", prompt,
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0))

    for _ in range(num_seqs):
        arrive()
    monitors = {mode: CacheMonitor() for mode in MODES[1:]}
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    clock = dict.fromkeys(MODES, 0.0)
    last_tick = dict.fromkeys(MODES, 0.0)
    builds, encodes, sizes = [], [], []

    def step(mode: str) -> None:
        monitor = monitors.get(mode)
        t0 = time.perf_counter()
        plan = cluster.schedule("w0")
        if plan is not None and monitor is not None:
            monitor.planned(cluster, plan)
        t1 = time.perf_counter()
        result = worker.execute(plan).result if plan is not None else None
        t2 = time.perf_counter()
        if result is not None:
            cluster.apply_result(result)
        ended = len(cluster.pop_finished())
        now = clock[mode] + (t2 - t0)
        if monitor is not None and now - last_tick[mode] >= TICK_S:
            last_tick[mode] = now
            t_tick = time.perf_counter()
            snapshot = monitor.tick(cluster, now, mode == "watched")
            if snapshot is not None:
                t3 = time.perf_counter()
                sizes.append(len(encode(snapshot)))
                builds.append(t3 - t_tick)
                encodes.append(time.perf_counter() - t3)
        t4 = time.perf_counter()
        samples[mode].append(((t1 - t0) + (t4 - t2)) * 1e6)
        clock[mode] += t4 - t0
        for _ in range(ended):
            arrive()

    for _ in range(steps):  # warm up: prefill, and the first requests end
        step("no monitor")
    samples["no monitor"].clear()
    clock["no monitor"] = 0.0
    for i in range(3 * steps):
        step(MODES[i % 3])
    return {"samples": samples, "clock": clock, "builds": builds, "encodes": encodes, "sizes": sizes}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="*", default=[64, 256, 1024], help="running sequences (none: skip that table)")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per point")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=64, help="shared system prefix inside each prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-blocks", type=int, nargs="*", default=[1000, 10000, 100000],
                   help="cache sizes of the snapshot table (none: skip it)")
    p.add_argument("--quick", action="store_true", help="64 and 256 sequences, 60 steps; 1k and 10k blocks")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.steps, args.snapshot_blocks = [64, 256], 60, [1000, 10000]
    print(f"scheduler step = schedule() + apply_result(), decode only; {args.steps} steps per row, "
          f"prompt {args.prompt_len} tokens ({args.prefix_len} shared), block size {args.block_size}")
    print(f"{'running seqs':>12} | {'prefix caching':>14} | {'median us/step':>14} | {'p99 us/step':>11} | "
          f"{'median us/seq':>13}")
    print("-" * 77)
    for n in args.seqs:
        for caching in (True, False):
            samples = measure(n, caching, args.steps, args.prompt_len, args.prefix_len, args.block_size, args.seed)
            median = statistics.median(samples)
            print(f"{n:>12} | {'on' if caching else 'off':>14} | {median:>14.0f} | "
                  f"{percentile(samples, 0.99):>11.0f} | {median / n:>13.2f}")
    if args.snapshot_blocks:
        print_snapshot_table(args.snapshot_blocks, args.steps * 4, args.seed)


def print_snapshot_table(sizes: list[int], steps: int, seed: int) -> None:
    print(f"\ncache snapshots: us per step (schedule + apply_result + the monitor's calls), {steps} steps per mode "
          f"taking turns; 128 requests in a steady state, new ones arriving as others end; 'time in snapshots': "
          f"building and encoding them, as a share of the watched mode's wall time (the worker's part included)")
    print(f"{'blocks':>7} | {'mode':>10} | {'median us/step':>14} | {'vs none':>7} | {'p99 us/step':>11} | "
          f"{'build ms':>8} | {'encode ms':>9} | {'KiB':>5} | {'snap/s':>6} | {'time in snapshots':>17}")
    print("-" * 119)
    for num_blocks in sizes:
        r = measure_snapshots(num_blocks, steps, seed)
        base = statistics.median(r["samples"]["no monitor"])
        for mode in MODES:
            samples = r["samples"][mode]
            median = statistics.median(samples)
            extra = [""] * 5
            if mode == "watched" and r["builds"]:
                seconds = r["clock"][mode]
                extra = [f"{statistics.median(r['builds']) * 1e3:.2f}", f"{statistics.median(r['encodes']) * 1e3:.2f}",
                         f"{max(r['sizes']) / 1024:.0f}", f"{len(r['builds']) / seconds:.1f}",
                         f"{100 * (sum(r['builds']) + sum(r['encodes'])) / seconds:.2f}%"]
            print(f"{num_blocks:>7} | {mode:>10} | {median:>14.0f} | {100 * (median / base - 1):>+6.1f}% | "
                  f"{percentile(samples, 0.99):>11.0f} | {extra[0]:>8} | {extra[1]:>9} | {extra[2]:>5} | "
                  f"{extra[3]:>6} | {extra[4]:>17}")

if __name__ == "__main__":
    main()
