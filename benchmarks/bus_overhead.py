"""What the Redis bus costs: one request trace through the in-process engine and through the services.

Both run the same scheduler and worker cores with the same settings and compute threads (the engine gets as
many as `pagedserve up` gives its one worker); the services add msgpack, Redis round trips and process hops.
For each concurrency (requests kept in flight) it prints output tokens/s of each, their ratio, and the mean
step time of each (the difference is the per-step latency the bus adds); each the best of `--repeats` runs taken
in turn, so that a shared machine's slow spells fall on all three. Run from the repo root:

    python -m benchmarks.bus_overhead                 # tiny model, concurrency 1, 16, 64
    python -m benchmarks.bus_overhead --quick         # a short smoke run
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.sampling import SamplingParams
from shared.settings import Settings


MODES = ("sync", "async")


@dataclass(slots=True)
class Run:
    tokens: int
    seconds: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / max(self.steps, 1)


def trace(count: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(prompt_len)] for _ in range(count)]


def run_engine(settings: Settings, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> Run:
    from gpu_worker.cpu_setup import stack_placement
    from pagedserve.engine import Engine

    # As many compute threads as the stack's one worker gets (the launcher leaves a core to the front end):
    # the ratio is then the bus's cost, not a thread count's. Not pinned: the services run from this process.
    engine = Engine(settings.replace(compute_threads=settings.compute_threads or stack_placement(0, 1).threads))
    engine.generate(prompts[:1], params)  # warm-up
    queue = list(prompts)
    in_flight: set[str] = set()
    steps = tokens = 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            in_flight.add(engine.add_request(queue.pop(0), params))
        outputs = engine.step()
        steps += 1
        tokens += len(outputs)
        in_flight -= {rid for rid, c in engine.completions.items() if c.finished}
    return Run(tokens, time.perf_counter() - start, steps)


def run_services(client, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> Run:
    from shared.keys import Keys

    results = Keys().results
    client.wait([client.submit(prompts[0], params)])  # warm-up
    steps_before = client.redis.xinfo_stream(results)["entries-added"]
    queue = list(prompts)
    in_flight: list[str] = []
    done: list[str] = []
    start = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            in_flight.append(client.submit(queue.pop(0), params))
        client.poll(block_ms=50)
        done += [r for r in in_flight if client.done(r)]
        in_flight = [r for r in in_flight if not client.done(r)]
    seconds = time.perf_counter() - start
    steps = client.redis.xinfo_stream(results)["entries-added"] - steps_before
    return Run(client.generated_count(done), seconds, steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="what `pagedserve up --model` takes (default: the built-in tiny model)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated requests in flight")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 8 × concurrency, ≥ 16: "
                        "runs of a second or less swung the ratio by ±20 %%)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, in turn; the best one counts")
    parser.add_argument("--quick", action="store_true", help="concurrency 1,8 with short outputs")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.output_len = "1,8", 16
    levels = [int(c) for c in args.concurrency.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    from pagedserve.launcher import ensure_model

    settings = ensure_model(Settings(model=args.model, log_level="warning"))
    stacks = {}
    rows = []
    try:
        for mode in MODES:  # both stacks up at once, so that each level measures all three back to back
            stacks[mode] = start_stack(settings.replace(async_scheduling=mode == "async"))
        for level in levels:
            prompts = trace(args.requests or max(16, 8 * level), args.prompt_len, seed=level)
            runs: dict[str, list[Run]] = {name: [] for name in ("engine", *stacks)}
            for _ in range(args.repeats):
                runs["engine"].append(run_engine(settings, prompts, params, level))
                for mode, (_, client) in stacks.items():
                    runs[mode].append(run_services(client, prompts, params, level))
            best = {name: max(done, key=lambda r: r.tokens_per_s) for name, done in runs.items()}
            engine, services = best.pop("engine"), best
            rows.append((level, engine, services))
            print(f"concurrency {level}: engine {engine.tokens_per_s:.0f} tok/s, services "
                  + ", ".join(f"{m} {r.tokens_per_s:.0f} tok/s" for m, r in services.items()), file=sys.stderr,
                  flush=True)
    finally:
        for stack, _ in stacks.values():
            stack.stop()

    print(f"\nBus overhead: {Path(settings.model).name}, prompt {args.prompt_len}, output {args.output_len} tokens, "
          "1 worker; services with the next step planned after the last one's result (sync) or while it runs "
          f"(async, the default); each the best of {args.repeats} runs in turn\n")
    print("| concurrency | engine tok/s | sync tok/s | async tok/s | sync / engine | async / engine "
          "| engine ms/step | sync ms/step | async ms/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for level, engine, services in rows:
        sync, fast = services["sync"], services["async"]
        print(f"| {level} | {engine.tokens_per_s:.0f} | {sync.tokens_per_s:.0f} | {fast.tokens_per_s:.0f} | "
              f"{sync.tokens_per_s / engine.tokens_per_s:.1%} | {fast.tokens_per_s / engine.tokens_per_s:.1%} | "
              f"{engine.step_ms:.1f} | {sync.step_ms:.1f} | {fast.step_ms:.1f} |")
    return 0


def start_stack(settings: Settings):
    """Redis, the scheduler and one worker; the stack and a bus client, once the worker has joined."""
    from benchmarks.bus_client import BusClient
    from pagedserve.supervision import Stack

    stack = Stack(settings)
    url = stack.start_redis(0)
    if url is None:
        raise SystemExit(1)
    stack.settings = settings.replace(redis_url=url)
    stack.start_services(1, gateway_ports={})
    client = BusClient(url)
    client.wait_for(lambda: (s := client.stats()) is not None and len(s.workers) == 1, "the worker", 120, stack)
    return stack, client

if __name__ == "__main__":
    sys.exit(main())
