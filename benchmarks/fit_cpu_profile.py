"""Fit the `cpu-tiny` simulation profile to this machine's measured step times of the built-in model.

    python -m benchmarks.fit_cpu_profile [--write] [--threads 1]

Times the real worker's device side (ModelRunner.execute: one forward pass and sampling, float32, the torch
reference attention), in CPU time of its thread (a simulated CPU step burns as much: gpu_worker/simulated.py),
on a grid of steps: decode batches at several context lengths, prefill chunks, chunks
after a context, mixed steps. Then fits the cost model's parameters for a CPU (gpu_worker/cost_model.py:
peak FLOPs, memory bandwidth, attention's share of peak, per-step and per-sequence overheads) by least
squares on the relative error, prints measured against fitted times, and with --write stores the fit in
gpu_worker/profiles.json (device `cpu-2core`, profile `cpu-tiny`). The thread count should be the one the
served workers use (`benchmarks/compare.py --threads`, 1 by default).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from gpu_worker.cost_model import PROFILES_PATH, ChunkSize, get_profile
from scheduler.kv_cache_manager import cdiv
from shared.sampling import SamplingParams
from shared.settings import Settings

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
BLOCK_SIZE = 16
# The steps of the validation sweep (benchmarks/compare.py: ShareGPT lengths x 0.25, max_model_len 512, up to
# ~20 running sequences): the fit is for that range. (Past it the torch reference attention falls off the
# CPU caches: 64 sequences of 512 tokens take 3x what a single bandwidth predicts.)
DECODE = [(b, c) for b in (1, 2, 4, 8, 16, 32) for c in (16, 64, 128, 256, 448)]  # (batch, context)
PREFILL = [(0, n) for n in (16, 32, 64, 128, 256, 512)] + [(128, 64), (256, 64)]  # one (context, new)
MIXED = [(4, 64, 64), (8, 128, 128), (16, 64, 256), (16, 128, 32)]  # (decode batch, context, a prefill chunk)


def steps() -> list[list[ChunkSize]]:
    """Each step as its chunks."""
    grid = [[ChunkSize(c, 1)] * b for b, c in DECODE]
    grid += [[ChunkSize(*chunk)] for chunk in PREFILL]
    grid += [[ChunkSize(c, 1)] * b + [ChunkSize(0, n)] for b, c, n in MIXED]
    return grid


def measure(model_dir: Path, grid: list[list[ChunkSize]], reps: int) -> list[float]:
    """CPU seconds of ModelRunner.execute per step of the grid (this thread's: waiting for a core while other
    processes run does not count), the median of `reps` passes over the grid, each in a new order. On a quiet
    machine the median is the least; on a busy one it includes what sharing the core's caches and execution
    units costs, which the real worker pays too while it serves."""
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.sequence import SequenceState

    most = max(sum(cdiv(c + n, BLOCK_SIZE) for c, n in chunks) for chunks in grid)
    runner = ModelRunner(Settings(model=str(model_dir), num_blocks=most + 1, swap_space_bytes=0), model_dir, False)
    rng = np.random.default_rng(0)
    steps = []
    for chunks in grid:
        seqs, next_block = [], 1
        for i, (context, new) in enumerate(chunks):
            blocks = cdiv(context + new, BLOCK_SIZE)
            tokens = rng.integers(5, 512, context + new).tolist()
            seqs.append((SequenceState(i, str(i), 0, GREEDY, tokens, len(tokens),
                                       list(range(next_block, next_block + blocks))), context, new))
            next_block += blocks
        runner.execute(seqs, [])  # warm-up
        steps.append(seqs)
    samples: list[list[float]] = [[] for _ in grid]
    for _ in range(reps):
        for i in rng.permutation(len(grid)):
            start = time.thread_time()
            runner.execute(steps[i], [])
            samples[i].append(time.thread_time() - start)
    return [statistics.median(s) for s in samples]


def fit(grid: list[list[ChunkSize]], measured: list[float]) -> dict[str, float]:
    """Grid search over peak FLOPs, bandwidth and attention's share; the two overheads by weighted least squares
    (weights 1/measured: relative error) at each grid point; the best fit by its relative squared error."""
    model = get_profile("cpu-tiny").model
    y = np.asarray(measured)
    n_seqs = np.asarray([len(c) for c in grid], dtype=float)
    dense_flops, attn_flops, kv_bytes = np.asarray([model.step_work(c, len(c)) for c in grid], dtype=float).T
    read = float(model.step_read_bytes)
    flops_grid = np.logspace(9, 12, 61)
    bw_grid = np.logspace(9, 12, 61)
    attn_grid = np.logspace(-3, 0, 31)
    f, b, a = (g.reshape(-1) for g in np.meshgrid(flops_grid, bw_grid, attn_grid, indexing="ij"))
    g = (np.maximum(dense_flops[None, :] / f[:, None], read / b[:, None])
         + np.maximum(attn_flops[None, :] / (f * a)[:, None], kv_bytes[None, :] / b[:, None]))
    w = 1.0 / y
    design = np.stack([np.ones_like(n_seqs), n_seqs], axis=1) * w[:, None]  # [points, 2]
    residual = (y[None, :] - g) * w[None, :]  # [combos, points]
    coef, *_ = np.linalg.lstsq(design, residual.T, rcond=None)  # [2, combos]
    coef = np.maximum(coef, 0.0)
    err = ((residual - (design @ coef).T) ** 2).sum(axis=1)
    best = int(np.argmin(err))
    return {"peak_flops": float(f[best]), "memory_bandwidth": float(b[best]), "attention": float(a[best]),
            "step_overhead_s": float(coef[0, best]), "seq_overhead_s": float(coef[1, best])}


def write(params: dict[str, float], errors: list[float], threads: int, reps: int) -> None:
    data = json.loads(PROFILES_PATH.read_text(encoding="utf-8"))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    where = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {threads}"
    source = (f"measured: benchmarks/fit_cpu_profile.py on {when} ({where}): ModelRunner.execute CPU times of "
              f"the built-in model on {len(errors)} steps (median of {reps} passes), fitted with a median relative "
              f"error of {statistics.median(errors):.1%} (largest {max(errors):.1%})")
    device = data["devices"]["cpu-2core"]
    device.update(peak_flops=round(params["peak_flops"], -6), memory_bandwidth=round(params["memory_bandwidth"], -6),
                  host_bandwidth=round(params["memory_bandwidth"], -6), source=source)
    data["profiles"]["cpu-tiny"]["efficiency"] = {
        "matmul": 1.0, "attention": round(params["attention"], 5), "bandwidth": 1.0,
        "step_overhead_s": round(params["step_overhead_s"], 6), "seq_overhead_s": round(params["seq_overhead_s"], 7),
        "source": source + "; peak FLOPs and bandwidth are those achieved (efficiency 1), swaps move at memory speed"}
    PROFILES_PATH.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote the fit to {PROFILES_PATH}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads, as the served workers run")
    p.add_argument("--reps", type=int, default=40, help="passes over the grid (the median time of each step counts)")
    p.add_argument("--write", action="store_true", help="store the fit in gpu_worker/profiles.json")
    args = p.parse_args(argv)
    import torch

    from pagedserve.tiny_model import write_tiny_model

    torch.set_num_threads(args.threads)
    grid = steps()
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure(write_tiny_model(Path(tmp) / "tiny"), grid, args.reps)
    params = fit(grid, measured)
    profile = get_profile("cpu-tiny")
    fitted = dataclasses.replace(
        profile, device=dataclasses.replace(profile.device, peak_flops=params["peak_flops"],
                                            memory_bandwidth=params["memory_bandwidth"]),
        efficiency=dataclasses.replace(profile.efficiency, matmul=1.0, bandwidth=1.0, attention=params["attention"],
                                       step_overhead_s=params["step_overhead_s"],
                                       seq_overhead_s=params["seq_overhead_s"]))
    print("| step (context, new) × count | measured (ms) | fitted (ms) | error |")
    print("|---|---|---|---|")
    errors = []
    for chunks, t in zip(grid, measured):
        model_t = fitted.step_time(chunks, len(chunks))
        errors.append(abs(model_t - t) / t)
        shape = ", ".join(f"{c} × {chunks.count(c)}" for c in dict.fromkeys(chunks))
        print(f"| {shape} | {t * 1e3:.2f} | {model_t * 1e3:.2f} | {(model_t - t) / t:+.1%} |")
    print("fit: " + ", ".join(f"{k} {v:.4g}" for k, v in params.items())
          + f"; median error {statistics.median(errors):.1%}, largest {max(errors):.1%}")
    if args.write:
        write(params, errors, args.threads, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
