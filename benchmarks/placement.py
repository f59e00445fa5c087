"""Prefix-aware placement at 16 simulated workers, against round-robin and random placement.

    python -m benchmarks.placement --out-dir benchmarks/results/simulated/placement [--quick]

A workload shaped like llm-d's shared-prefix capacity benchmark (groups of prompts that share a long system
prompt; pagedserve/workloads.py: prefix_groups) is served at rising request rates by a cluster of simulated
workers (Llama-3-8B on H200 by default) on a virtual clock (benchmarks/discrete_event.py), once per
placement policy: the scheduler's own (scheduler/cluster.py: the least prompt to compute after prefix hits,
then the least load), round-robin, and uniformly random. Reported per point: output tokens/s, TTFT p90, and
the prefix-cache hit rate (prompt tokens found cached over prompt tokens looked up) next to the best
possible (every group's system prompt computed once, every later prompt of the group hitting all its full
blocks). Writes results.json, placement.png and summary.md.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import plot  # noqa: E402
from benchmarks.discrete_event import Simulation  # noqa: E402
from pagedserve.workloads import arrival_times, prefix_groups  # noqa: E402
from gpu_worker.cost_model import get_profile  # noqa: E402
from scheduler.cluster import Cluster  # noqa: E402
from scheduler.worker_scheduler import WorkerScheduler, WorkerSchedulerFactory  # noqa: E402
from shared.settings import Settings  # noqa: E402

BUILT_IN = "prefix-aware (built-in)"
# llm-d's published run of this benchmark (Qwen3-32B, 8 pods): output tokens/s and TTFT p90 per scheduler.
LLM_D = {"precise prefix-aware": (8730, 0.54), "estimated prefix-aware": (6944, 31.1), "random": (4429, 92.6)}


class RoundRobinCluster(Cluster):
    """Each new request on the next worker in turn (of those that can run it)."""

    def __init__(self, settings: Settings, worker_scheduler: WorkerSchedulerFactory | None = None) -> None:
        super().__init__(settings, worker_scheduler=worker_scheduler)
        self._turn = itertools.count()

    def _choose(self, fitting: list[WorkerScheduler], uncached: dict[str, int]) -> WorkerScheduler:
        return fitting[next(self._turn) % len(fitting)]


class RandomCluster(Cluster):
    """Each new request on a worker drawn uniformly (seeded)."""

    def __init__(self, settings: Settings, worker_scheduler: WorkerSchedulerFactory | None = None) -> None:
        super().__init__(settings, worker_scheduler=worker_scheduler)
        self._rng = random.Random(0)

    def _choose(self, fitting: list[WorkerScheduler], uncached: dict[str, int]) -> WorkerScheduler:
        return self._rng.choice(fitting)


POLICIES = {BUILT_IN: Cluster, "round-robin": RoundRobinCluster, "random": RandomCluster}


@dataclass(slots=True)
class Shape:
    """The workload and the cluster. llm-d's: 150 groups x 5 prompts, 6,000 + 1,200 prompt tokens, 1,000 out; here
    its lengths / 4 on A100-40GB + LLaMA-13B workers, whose KV cache (about 15k tokens each) is under pressure
    as llm-d's is and whose capacity a 750-request trace can pass (H200 + Llama-3-8B workers hold 842k tokens
    each and would need about ten times the trace, more than this machine simulates in minutes)."""
    num_groups: int = 150
    group_size: int = 5
    system_len: int = 1500
    question_len: int = 300
    output_len: int = 250
    workers: int = 16
    profile: str = "a100-40gb-llama-13b"
    rates: tuple[float, ...] = (2, 4, 6, 8, 10, 12, 16)
    seed: int = 0

    def best_hit_rate(self, block_size: int) -> float:
        """Every later prompt of a group hits the system prompt's full blocks; the first computes them."""
        hit = (self.system_len // block_size) * block_size * (self.group_size - 1) * self.num_groups
        return hit / ((self.system_len + self.question_len) * self.group_size * self.num_groups)


FULL = Shape()
QUICK = Shape(num_groups=12, group_size=5, system_len=600, question_len=120, output_len=50, workers=4, rates=(2, 8))


def say(message: str) -> None:
    print(f"placement: {message}", file=sys.stderr, flush=True)


def run(shape: Shape) -> list[dict[str, Any]]:
    profile = get_profile(shape.profile)
    settings = Settings(max_model_len=profile.model.max_model_len)
    requests = prefix_groups(shape.num_groups, shape.group_size, shape.system_len, shape.question_len,
                             shape.output_len, profile.model.vocab_size, shape.seed)
    rows = []
    for rate in shape.rates:
        arrivals = arrival_times(len(requests), rate, 1.0, shape.seed)
        for policy, cluster in POLICIES.items():
            start = time.perf_counter()
            simulation = Simulation(settings, profile, shape.workers, cluster=cluster)
            timings = simulation.run(requests, arrivals)
            stats = simulation.stats()
            done = [t for t in timings if t.error is None and t.end is not None]
            duration = max(t.end for t in done) - arrivals[0]
            ttft = np.asarray([t.token_times[0] - t.arrival for t in done])
            row = {"rate": rate, "policy": policy, "completed": len(done), "failed": len(timings) - len(done),
                   "output_throughput": sum(len(t.token_times) for t in done) / duration,
                   "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
                   "hit_rate": stats["prefix_hits"] / stats["prefix_queries"],
                   "best_hit_rate": shape.best_hit_rate(settings.block_size),
                   "preemptions": stats["preemptions"], "mean_batch_seqs": stats["mean_batch_seqs"],
                   "num_blocks": stats["num_blocks"]}
            rows.append(row)
            say(f"{rate:g} req/s {policy}: {row['output_throughput']:.0f} out tok/s, "
                f"TTFT p90 {row['ttft_p90_s']:.2f} s, hit rate {row['hit_rate']:.3f} of {row['best_hit_rate']:.3f}, "
                f"{row['preemptions']} preemptions ({time.perf_counter() - start:.0f} s)")
    return rows


def summary(rows: list[dict[str, Any]], shape: Shape) -> str:
    lines = [f"# Placement at {shape.workers} simulated workers ({shape.profile})\n",
             f"{shape.num_groups} groups × {shape.group_size} prompts, {shape.system_len}-token system prompt + "
             f"{shape.question_len}-token question, {shape.output_len} output tokens; best possible hit rate "
             f"{rows[0]['best_hit_rate']:.3f}; {rows[0]['num_blocks']} KV blocks of 16 tokens per worker.\n",
             "| rate (req/s) | placement | output tok/s | TTFT p50 (s) | TTFT p90 (s) | prefix hit rate | of best | "
             "mean batch | preemptions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['policy']} | {r['output_throughput']:,.0f} | {r['ttft_p50_s']:.2f} "
                     f"| {r['ttft_p90_s']:.2f} | {r['hit_rate']:.3f} | {r['hit_rate'] / r['best_hit_rate']:.0%} "
                     f"| {r['mean_batch_seqs']:.1f} | {r['preemptions']} |")
    lines += ["", "llm-d (Qwen3-32B, 8 pods, its own run): " + "; ".join(
        f"{name} {tok:,} output tok/s, TTFT p90 {ttft} s" for name, (tok, ttft) in LLM_D.items()) + "."]
    return "\n".join(lines) + "\n"


def plot_rows(rows: list[dict[str, Any]], shape: Shape, out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for i, policy in enumerate(POLICIES):
        mine = [r for r in rows if r["policy"] == policy]
        rates = [r["rate"] for r in mine]
        for ax, key in zip(axes, ("output_throughput", "ttft_p90_s", "hit_rate")):
            ax.plot(rates, [r[key] for r in mine], marker="o", label=policy, color=f"C{i}")
    axes[2].axhline(rows[0]["best_hit_rate"], color="gray", linestyle="--", linewidth=1, label="best possible")
    for ax, title in zip(axes, ("output tokens/s", "TTFT p90 (s)", "prefix hit rate")):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=8)
    plot.finish(fig, out, f"SIMULATED: {shape.workers} x {shape.profile}, virtual clock (benchmarks/placement.py)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/simulated/placement"))
    p.add_argument("--quick", action="store_true", help="4 workers, a small workload (numbers meaningless)")
    p.add_argument("--plot-only", action="store_true", help="no run: plot and summary from OUT_DIR/results.json")
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = args.out_dir / "results.json"
    if args.plot_only:
        data = json.loads(results.read_text(encoding="utf-8"))
        rows, shape = data["rows"], Shape(**data["shape"] | {"rates": tuple(data["shape"]["rates"])})
    else:
        rows = run(shape)
        results.write_text(json.dumps({"shape": asdict(shape), "rows": rows}, indent=1) + "\n", encoding="utf-8")
    plot_rows(rows, shape, args.out_dir / "placement.png")
    text = summary(rows, shape)
    (args.out_dir / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
