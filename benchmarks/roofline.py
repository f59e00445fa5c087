"""The machine's limit for decoding the real model (SmolLM2-135M-Instruct), and each server's share of it.

A decode step reads every weight once and does 2 FLOPs per weight per sequence (plus attention). On one core, as
both servers run their model here:
- at concurrency 1 the step cannot be faster than the weight bytes (in the serving dtype) over the memory bandwidth
  one thread reaches (measured: the best of several float32 sums over a 1 GiB tensor);
- at concurrency 64, than the step's FLOPs over the GEMM throughput one thread reaches on the model's own linear
  shapes at 64 rows (measured with torch's linear, each shape in float32 and in the serving dtype, the faster
  counting: a CPU without bfloat16 dot products multiplies bfloat16 on its float32 units; attention at the
  benchmark's mean context of 192 tokens counted at the same rate).
With `--results DIR` (the `vllm/` folder that `benchmarks.compare --systems vllm` writes), each server's measured
TPOT at concurrency 1 and 64 is set against that limit: share = limit / TPOT.

    python -m benchmarks.roofline
    python -m benchmarks.roofline --results /tmp/vs-smollm2/vllm
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from statistics import mean

import torch

from shared.model_dir import CHAT_MODEL_NAME, read_config, resolve_model_dir

BANDWIDTH_BYTES = 1 << 30
CONTEXT = 192  # mean context of a `vllm bench serve` random 128-in/128-out request over its decode
DTYPES = {"float32": ("fp32", torch.float32), "bfloat16": ("bf16", torch.bfloat16)}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def bandwidth() -> float:
    """Bytes per second one thread reads, summing a float32 tensor far larger than any cache."""
    x = torch.ones(BANDWIDTH_BYTES // 4)
    return BANDWIDTH_BYTES / best_of(x.sum, 5)


def linear_shapes(config: dict) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matrix a decode step multiplies (the tied vocabulary projection included)."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, layers = config["intermediate_size"], config["num_hidden_layers"]
    return [(hidden, (heads + 2 * kv) * head_dim, layers), (heads * head_dim, hidden, layers),
            (hidden, 2 * inter, layers), (inter, hidden, layers), (hidden, config["vocab_size"], 1)]


def gemm_seconds(shapes: list[tuple[int, int, int]], rows: int, dtype: torch.dtype) -> tuple[float, float]:
    """(seconds, FLOPs) of one step's linears at `rows` rows, each shape timed on its own in float32 and in `dtype`,
    the faster counting."""
    seconds = flops = 0.0
    for k, n, count in shapes:
        best = min(best_of(lambda x=torch.randn(rows, k, dtype=d), w=torch.randn(n, k, dtype=d):
                           torch.nn.functional.linear(x, w), 5) for d in {torch.float32, dtype})
        seconds += count * best
        flops += count * 2 * rows * k * n
    return seconds, flops


def measured_tpot(results: Path) -> dict[tuple[str, int], float]:
    """(server label, concurrency) → median TPOT in ms, averaged over repeats, of the unlimited-rate cells."""
    found: dict[tuple[str, int], list[float]] = defaultdict(list)
    for path in results.glob("*-c*-rinf-s*.json"):
        label, concurrency = path.name.split("-c")[0], int(path.name.split("-c")[1].split("-")[0])
        found[(label, concurrency)].append(json.loads(path.read_text())["median_tpot_ms"])
    return {key: mean(values) for key, values in found.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=None, help="vllm bench serve results of benchmarks.versus_vllm")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = read_config(resolve_model_dir(CHAT_MODEL_NAME).path)
    shapes = linear_shapes(config)
    params = sum(k * n * count for k, n, count in shapes)
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    tpot = measured_tpot(args.results) if args.results else {}
    print(f"\n{CHAT_MODEL_NAME}: {params / 1e6:.1f}M weights multiplied per step; one thread\n")
    print("| dtype | read GB/s | c=1 limit ms (weights / bandwidth) | GEMM GFLOP/s at 64 rows | c=64 limit ms "
          "(FLOPs / GEMM) | " + " | ".join(f"{s} c={c} TPOT ms (share)" for s in ("vllm", "pagedserve")
                                           for c in (1, 64)) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * 4)
    gbps = bandwidth() / 1e9
    for name, (short, dtype) in DTYPES.items():
        c1 = params * torch.finfo(dtype).bits / 8 / (gbps * 1e9) * 1e3
        seconds, flops = gemm_seconds(shapes, 64, dtype)
        attention = 64 * 4 * layers * heads * head_dim * CONTEXT
        c64 = seconds * (flops + attention) / flops * 1e3
        cells = []
        for system in ("vllm", "pagedserve"):
            for c, limit in ((1, c1), (64, c64)):
                measured = tpot.get((f"{system}-{short}", c))
                cells.append(f"{measured:.1f} ({limit / measured:.0%})" if measured else "-")
        print(f"| {name} | {gbps:.1f} | {c1:.1f} | {flops / seconds / 1e9:.1f} | {c64:.1f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
