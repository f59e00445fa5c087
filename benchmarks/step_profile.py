"""Where a step's time goes: the worker alone, split by phase, and the whole stack, CPU seconds per process.

Worker (`--part worker`): the worker core driven by step plans, as the scheduler sends them: B sequences
of `--context` prompt tokens prefilled, then `--steps` decode steps of all B. Each decode step is split into
  plan        Worker.execute outside the runner: checking the plan, registering sequences, building results
  inputs      flattening the chunks into the step's tensors (gpu_worker/input_batch.py)
  attention   store_kv + paged_attention of every layer (the attention backend)
  model rest  the rest of the model's forward (embeddings, norms, projections, MLPs, rotary)
  logits      the lm_head over the sampled rows
  sampling    the sampler (penalties, temperature, draws, logprobs, .tolist())
per model, dtype, attention backend and batch size, in ms per step.

Prefill (`--part prefill`): one sequence's prompt of each of `--prompts` lengths prefilled in one step,
split by the same phases, ms per prefill (the mean of `--steps` after a warm-up).

Stack (`--part stack`): `pagedserve up --workers 1` under a fixed load (pagedserve/bench.py in this
process: `--stack-requests` requests of `--context` prompt / `--stack-output` output tokens, at most B in
flight), CPU seconds of each process over the load, per output token (µs), and wall time.

    python -m benchmarks.step_profile                       # both parts, both models, both dtypes
    python -m benchmarks.step_profile --part worker --models tiny --dtypes float32 --batches 64
    python -m benchmarks.step_profile --part prefill --models llama-100m --backends cpu --prompts 128,2048
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from benchmarks.proc_cpu import cpu_seconds, descendants

PHASES = ("plan", "inputs", "attention", "model rest", "logits", "sampling")


@dataclass(slots=True)
class Clock:
    """Seconds spent per name, by wrapping the callables that do the work. By default the calling thread's
    CPU time: with one torch thread every op runs on it, and on a shared machine CPU time does not count the
    waits for a core that wall time does (`now=time.perf_counter` for wall time)."""
    now: Callable[[], float] = time.thread_time
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self.now() - start
        return timed


def instrument(worker: Any, clock: Clock) -> None:
    """Time the worker's phases in place: the runner's entry points and its attention backend's calls."""
    import gpu_worker.model_runner as model_runner

    runner = worker.runner
    worker.execute = clock.wrap("total", worker.execute)
    runner.execute = clock.wrap("runner", runner.execute)
    model_runner.prepare_inputs = clock.wrap("inputs", model_runner.prepare_inputs)
    runner.model.forward = clock.wrap("forward", runner.model.forward)
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits)
    runner.sampler = clock.wrap("sampling", runner.sampler)
    backend = runner.backend
    timed = SimpleNamespace(store_kv=clock.wrap("attention", backend.store_kv),
                            paged_attention=clock.wrap("attention", backend.paged_attention),
                            copy_blocks=backend.copy_blocks)
    if hasattr(backend, "step_attention"):  # the per-step callable does the layers' stores and attention
        timed.step_attention = lambda *step: clock.wrap("attention", backend.step_attention(*step))
    runner.backend = timed


def phases(clock: Clock, steps: int) -> dict[str, float]:
    """ms per step of each phase."""
    s = clock.seconds
    ms = {"plan": s["total"] - s["runner"], "inputs": s["inputs"], "attention": s["attention"],
          "model rest": s["forward"] - s["attention"], "logits": s["logits"], "sampling": s["sampling"]}
    ms = {k: 1000 * v / steps for k, v in ms.items()}
    ms["total"] = 1000 * s["total"] / steps
    return ms


BLOCK = 16


def _load_worker(model_dir: Path, dtype: str, backend: str, num_blocks: int) -> Any:
    from gpu_worker.worker import Worker
    from shared.settings import Settings

    settings = Settings(model=str(model_dir), dtype=dtype, attention_backend=backend, block_size=BLOCK,
                        num_blocks=num_blocks, swap_space_bytes=0, max_num_batched_tokens=1 << 20)
    return Worker.load(settings, progress=False)


def _timed(worker: Any, step: Callable[[], None], steps: int, wall: bool) -> dict[str, float]:
    """ms per step of each phase over `steps` calls of `step`, after one untimed."""
    step()  # warm-up
    clock = Clock(time.perf_counter) if wall else Clock()
    instrument(worker, clock)
    for _ in range(steps):
        step()
    return phases(clock, steps)


def profile_worker(model_dir: Path, dtype: str, backend: str, batch: int, context: int, steps: int,
                   wall: bool = False) -> dict[str, float]:
    import torch

    from shared.protocol import NewSequence, ScheduledSequence, StepPlan
    from shared.sampling import SamplingParams

    per_seq = math.ceil((context + steps + 2) / BLOCK)
    worker = _load_worker(model_dir, dtype, backend, batch * per_seq + 1)
    wid = worker.registration.worker_id
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, worker.vocab_size, (batch, context), generator=gen).tolist()
    lengths = [context] * batch
    step_ids = iter(range(1 << 30))

    def decode() -> None:
        plan = StepPlan(wid, 0, next(step_ids), scheduled=[
            ScheduledSequence(i, n - 1, 1) for i, n in enumerate(lengths)])
        for out in worker.execute(plan).outputs:
            lengths[int(out.rid)] += 1

    worker.execute(StepPlan(wid, 0, next(step_ids), new_sequences=[
        NewSequence(i, str(i), 0, p, [], params) for i, p in enumerate(prompts)], scheduled=[
        ScheduledSequence(i, 0, context, new_block_ids=list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
        for i in range(batch)]))
    lengths = [n + 1 for n in lengths]
    return _timed(worker, decode, steps, wall)


def profile_prefill(model_dir: Path, dtype: str, backend: str, length: int, repeats: int,
                    wall: bool = False) -> dict[str, float]:
    import torch

    from shared.protocol import NewSequence, ScheduledSequence, StepPlan
    from shared.sampling import SamplingParams

    blocks = list(range(1, 1 + math.ceil((length + 1) / BLOCK)))
    worker = _load_worker(model_dir, dtype, backend, len(blocks) + 1)
    wid = worker.registration.worker_id
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = torch.randint(3, worker.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    step_ids, seqs = iter(range(1 << 30)), iter(range(1 << 30))
    forget = worker.execute  # not timed: the instrumented `execute` is the prefill's

    def prefill() -> None:
        seq = next(seqs)
        worker.execute(StepPlan(wid, 0, next(step_ids),
                                new_sequences=[NewSequence(seq, str(seq), 0, prompt, [], params)],
                                scheduled=[ScheduledSequence(seq, 0, length, new_block_ids=blocks)]))
        forget(StepPlan(wid, 0, next(step_ids), freed=[seq]))

    return _timed(worker, prefill, repeats, wall)


def _phase_table(args: argparse.Namespace, models: dict[str, Path], sizes: str, size: str, title: str,
                 profile: Callable[[Path, str, str, int], dict[str, float]]) -> None:
    """`profile(model_dir, dtype, backend, n)` for every model, dtype, backend and n in `sizes`, as one table whose
    `size` column is n, with tokens per second as n tokens per total."""
    rows = []
    for name, model_dir in models.items():
        for dtype in args.dtypes.split(","):
            for backend in args.backends.split(","):
                for n in (int(x) for x in sizes.split(",")):
                    ms = profile(model_dir, dtype, backend, n)
                    rows.append((name, dtype, backend, n, ms))
                    say(f"{name} {dtype} {backend} {size}={n}: {ms['total']:.2f} ms, "
                        f"{1000 * n / ms['total']:.0f} tok/s")
    print(f"\n{title}, {args.threads} torch thread(s); {'wall' if args.wall else 'CPU'} ms per step\n")
    print(f"| model | dtype | backend | {size} | " + " | ".join(PHASES) + " | total | tok/s |")
    print("|---|---|---|---:|" + "---:|" * (len(PHASES) + 2))
    for name, dtype, backend, n, ms in rows:
        cells = " | ".join(f"{ms[p]:.2f}" for p in PHASES)
        print(f"| {name} | {dtype} | {backend} | {n} | {cells} | {ms['total']:.2f} | {1000 * n / ms['total']:,.0f} |")


def worker_part(args: argparse.Namespace, models: dict[str, Path]) -> None:
    _phase_table(args, models, args.batches, "B",
                 f"Worker alone: decode steps of B sequences at context {args.context}, {args.steps} steps",
                 lambda m, d, b, n: profile_worker(m, d, b, n, args.context, args.steps, args.wall))


def prefill_part(args: argparse.Namespace, models: dict[str, Path]) -> None:
    _phase_table(args, models, args.prompts, "prompt",
                 f"Worker alone: one sequence's prompt prefilled in one step, mean of {args.steps}",
                 lambda m, d, b, n: profile_prefill(m, d, b, n, args.steps, args.wall))


def _process_name(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    text = " ".join(c.decode(errors="replace") for c in cmd)
    if "redis-server" in text:
        return "redis"
    m = re.search(r"-m (\S+)", text)
    module = m.group(1) if m else text[:30]
    return {"gpu_worker": "worker", "pagedserve": "launcher"}.get(module, module)


def profile_stack(model_dir: Path, dtype: str, concurrency: int, args: argparse.Namespace) -> dict[str, float]:
    from pagedserve import bench as serving
    from benchmarks.compare import Server, free_port

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pagedserve", "up", "--model", str(model_dir), "--dtype", dtype,
           "--workers", "1", "--port", str(free_port()), "--log-level", "warning", *args.up_args.split()]
    log = Path(tempfile.mkdtemp(prefix="pagedserve-profile-")) / "up.log"
    with Server(cmd, log, env) as server:
        bench = serving.build_parser().parse_args([
            "--base-url", server.url, "--model-dir", str(model_dir), "--dataset", "random", "--input-len",
            str(args.context), "--output-len", str(args.stack_output), "--num-prompts",
            str(args.stack_requests or max(16, 2 * concurrency)),
            "--max-concurrency", str(concurrency), "--disable-tqdm", "--warmup-requests", "2"])
        pids = {p: _process_name(p) for p in [server.proc.pid, *descendants(server.proc.pid)]}
        # the warm-up happens inside benchmark(); measure CPU over the whole call and subtract nothing: the
        # warm-up is two short requests against hundreds
        before = {p: cpu_seconds(p) for p in pids}
        client_before, start = time.process_time(), time.perf_counter()
        report = asyncio.run(serving.benchmark(bench))
        wall = time.perf_counter() - start
        cpu = defaultdict(float)
        for p, name in pids.items():
            cpu[name] += cpu_seconds(p) - before[p]
        cpu["client"] = time.process_time() - client_before
    point = report["points"][0]
    return {"wall": wall, "tokens": point["total_output_tokens"], "tok/s": point["output_throughput"], **cpu}


STACK_PROCESSES = ("gateway", "scheduler", "worker", "redis", "client", "launcher")


def stack_part(args: argparse.Namespace, models: dict[str, Path]) -> None:
    rows = []
    for name, model_dir in models.items():
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                r = profile_stack(model_dir, dtype, batch, args)
                rows.append((name, dtype, batch, r))
                say(f"stack {name} {dtype} c={batch}: {r['tok/s']:.0f} tok/s, "
                    + ", ".join(f"{p} {r.get(p, 0):.1f} s" for p in STACK_PROCESSES))
    print(f"\nWhole stack (`pagedserve up --workers 1`): {args.stack_requests or 'max(16, 2c)'} requests of "
          f"{args.context} prompt / {args.stack_output} output tokens at concurrency c; CPU µs per output token per "
          f"process (share of all CPU), and the wall time\n")
    print("| model | dtype | c | out tok/s | " + " | ".join(STACK_PROCESSES) + " | all CPU s | wall s |")
    print("|---|---|---:|---:|" + "---:|" * (len(STACK_PROCESSES) + 2))
    for name, dtype, batch, r in rows:
        total = sum(r.get(p, 0.0) for p in STACK_PROCESSES)
        cells = " | ".join(f"{1e6 * r.get(p, 0.0) / r['tokens']:,.0f} ({r.get(p, 0.0) / total:.0%})"
                           for p in STACK_PROCESSES)
        print(f"| {name} | {dtype} | {batch} | {r['tok/s']:,.0f} | {cells} | {total:.1f} | {r['wall']:.1f} |")


def say(message: str) -> None:
    print(f"step_profile: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", choices=("worker", "prefill", "stack", "both"), default="both",
                   help="both: worker and stack")
    p.add_argument("--models", default="tiny,llama-100m", help="comma-separated: tiny, llama-100m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backends", default="torch", help="worker part: comma-separated attention backends")
    p.add_argument("--batches", default="1,16,64", help="sequences per step (worker), concurrency (stack)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=16, help="worker part: decode steps measured; prefill part: "
                   "prefills measured per prompt length")
    p.add_argument("--prompts", default="128,512,2048", help="prefill part: comma-separated prompt lengths")
    p.add_argument("--stack-requests", type=int, default=0, help="requests per stack run (0 = 2 × concurrency, ≥ 16)")
    p.add_argument("--stack-output", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker part; "
                   "OMP_NUM_THREADS of the stack")
    p.add_argument("--up-args", default="", help="extra `pagedserve up` flags")
    p.add_argument("--wall", action="store_true", help="worker part: wall time instead of the thread's CPU time "
                   "(the same on an idle machine with --threads 1)")
    args = p.parse_args(argv)
    import torch

    from benchmarks.worker_throughput import MODELS

    torch.set_num_threads(args.threads)
    logging.getLogger("gpu_worker").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="pagedserve-profile-") as tmp:
        models = {name: MODELS[name](Path(tmp) / name) for name in args.models.split(",")}
        if args.part in ("worker", "both"):
            worker_part(args, models)
        if args.part == "prefill":
            prefill_part(args, models)
        if args.part in ("stack", "both"):
            stack_part(args, models)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
