"""Scheduler overhead: CPU time of one scheduling step (plan + apply result) per running batch size.

Every request shares a system prefix, then decodes with `ignore_eos`; once all of them run in decode,
each step schedules one token for each of them. Timed: `Cluster.schedule` plus
`Cluster.apply_result`; the model-free worker that makes the result is not timed.

    python -m benchmarks.scheduler_overhead [--seqs 64 256 1024] [--steps 300] [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.token_worker import TokenWorker
from scheduler.cluster import Cluster
from shared.protocol import Request, WorkerRegistration
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
    worker = TokenWorker(reg)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_len)]
    params = SamplingParams(max_tokens=steps + 32, ignore_eos=True, temperature=0.0)
    for i in range(num_seqs):
        prompt = prefix + [rng.randrange(1, 32000) for _ in range(prompt_len - prefix_len)]
        sched.add_request(Request(f"r{i}", "bench", prompt, params, 0.0))
    while True:  # warm up: prefill everything
        plan = sched.schedule("w0")
        sched.apply_result(worker.execute(plan))
        if len(plan.scheduled) == num_seqs and all(s.num_new_tokens == 1 for s in plan.scheduled):
            break
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule("w0")
        t1 = time.perf_counter()
        result = worker.execute(plan)
        t2 = time.perf_counter()
        sched.apply_result(result)
        t3 = time.perf_counter()
        if len(plan.scheduled) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} sequences a step, planned {len(plan.scheduled)}")
        samples.append(((t1 - t0) + (t3 - t2)) * 1e6)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024], help="running sequences")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per point")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=64, help="shared system prefix inside each prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="64 and 256 sequences, 60 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.steps = [64, 256], 60
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


if __name__ == "__main__":
    main()
