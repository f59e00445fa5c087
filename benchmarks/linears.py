"""bfloat16 or float32 linears on this CPU, each way `gpu_worker/packed_linear.py` can take, side by side: µs per
call for the shapes of the built-in tiny model and the ~100M Llama, at a decode step's rows (1-64) and a prefill
chunk's.

The ways for bfloat16: "onednn" (torch's oneDNN matmul, weights packed once; where oneDNN has native bfloat16),
"amx" (kernels/cpu_linear.c on AMX tiles, where the CPU has them), "avx512bf16" (cpu_linear.c with AVX-512 BF16's
dot products, where the CPU has them), "fma" (cpu_linear.c in float32 fused multiply-adds), "chunks" (float32
chunks for MKL); for float32 (`--dtype float32`): "mkl" (torch's own linear) and "fma" (cpu_linear.c). Calls
of all ways alternate, each its best of `--rounds`, so that a shared machine's slow spells fall on all of them;
the ratios are to the first way's time. One torch thread, as `pagedserve up` gives a worker on two cores.

    python -m benchmarks.linears
    python -m benchmarks.linears --ways onednn,amx --rows 1,64 --shapes 100m
    python -m benchmarks.linears --dtype float32 --ways mkl,fma --rows 1,8,64,2048
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

ORDER = ("onednn", "mkl", "amx", "avx512bf16", "fma", "chunks")  # the table's columns; ratios are to the first
# (name, out_features, in_features): the projections of each model (q|k|v and gate|up merged, as the worker has them)
SHAPES = {
    "tiny": [("qkv", 512, 256), ("o", 256, 256), ("gate_up", 1024, 256), ("down", 256, 512), ("lm_head", 512, 256)],
    "100m": [("qkv", 1280, 768), ("o", 768, 768), ("gate_up", 4096, 768), ("down", 768, 2048),
             ("lm_head", 32000, 768)],
}


def best_of(calls: list[Callable[[], object]], repeats: int, rounds: int) -> list[float]:
    """µs per call of each callable, the best of `rounds` rounds of `repeats` calls, the callables alternating."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()  # warm-up
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            best[i] = min(best[i], (time.perf_counter() - start) / repeats * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ways", default="", help="comma-separated ways (default: all this CPU has)")
    p.add_argument("--shapes", default="tiny,100m", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--rows", default="1,4,16,64,256", help="comma-separated input rows per call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args(argv)

    import torch

    from gpu_worker.cpu_setup import reuse_freed_memory
    from gpu_worker.packed_linear import available_kinds, twin
    from kernels import native

    torch.set_num_threads(1)
    reuse_freed_memory()  # as the worker does: a large call's scratch is not page-faulted in afresh each time
    dtype = getattr(torch, args.dtype)
    kernel = native.load()
    have = [kind for kind in ORDER if kind in available_kinds(kernel, dtype)]
    ways = args.ways.split(",") if args.ways else have
    missing = [w for w in ways if w not in have]
    if missing:
        p.error(f"not on this CPU: {', '.join(missing)} (this one has {', '.join(have)})")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"| model | linear (out × in) | rows | {' | '.join(f'{w} µs' for w in ways)} | "
          f"{' | '.join(f'{w} / {ways[0]}' for w in ways[1:])} |")
    print("|---|---|---:|" + "---:|" * (2 * len(ways) - 1))
    for model in args.shapes.split(","):
        for name, n, k in SHAPES[model]:
            gen = torch.Generator().manual_seed(n * k)
            linear = torch.nn.Linear(k, n, bias=False).to(dtype)
            twins = [twin(w, linear, kernel) for w in ways]
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(dtype)
                repeats = max(2, min(500, int(2e7 / (n * k * max(m, 8) ** 0.5))))
                with torch.inference_mode():
                    times = best_of([lambda t=t: t(x) for t in twins], repeats, args.rounds)
                ratios = " | ".join(f"{t / times[0]:.2f}" for t in times[1:])
                print(f"| {model} | {name} ({n} × {k}) | {m} | {' | '.join(f'{t:,.1f}' for t in times)} | {ratios} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
