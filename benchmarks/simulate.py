"""The vLLM paper's Figures 12 and 13 at paper scale, simulated: a 13B model on one A100-40GB.

    python -m benchmarks.simulate --out-dir benchmarks/results/simulated/fig12 [--profile a100-40gb-opt-13b] [--quick]

ShareGPT-like and Alpaca-like traces (pagedserve/workloads.py: the paper's mean lengths, Poisson arrivals)
are served at rising request rates by pagedserve and by the paper's three Orca baselines, which reserve KV
for a sequence's whole possible length at admission (benchmarks/baselines.py: max_model_len, the output
rounded up to a power of two, the exact output). Every system is the real scheduler core over simulated
workers with the same cost model (gpu_worker/cost_model.py), driven on a virtual clock
(benchmarks/discrete_event.py). Writes one JSON report per system and dataset (pagedserve/bench.py's
format, virtual seconds), normalized_latency.png and throughput.png (benchmarks/plot.py), and summary.md:
the request rate each system sustains at a few normalized-latency thresholds, its ratio next to the paper's,
and the mean batch at the paper's Figure 13 rates next to the paper's.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import plot
from benchmarks.baselines import reserving_scheduler
from benchmarks.discrete_event import Simulation, point
from pagedserve.bench import write_report
from pagedserve.workloads import WorkloadSpec, arrival_times, build_requests
from gpu_worker.cost_model import Profile, get_profile
from shared.settings import Settings

PAGED = "pagedserve"
SYSTEMS = {PAGED: None, "orca-oracle": "oracle", "orca-pow2": "pow2", "orca-max": "max"}  # label → reservation
# The paper's Figure 13 (OPT-13B, one A100-40GB): mean batched requests at these rates.
PAPER_BATCH = {"sharegpt": (2.0, {"orca-max": 7.00, "orca-pow2": 9.81, "orca-oracle": 13.62, PAGED: 30.42}),
               "alpaca": (30.0, {"orca-max": 7.00, "orca-pow2": 43.24, "orca-oracle": 72.75, PAGED: 132.44})}
# The paper's text (section 6.2) on the request rates sustained at similar normalized latency, over its three
# model sizes: ShareGPT 1.7-2.7x Orca (Oracle) and 2.7-8x Orca (Max); 2-4x the state of the art overall.
PAPER_RATIOS = {"sharegpt": {"orca-oracle": "1.7–2.7×", "orca-max": "2.7–8×"}}
THRESHOLDS = (2, 5)  # × pagedserve's lowest normalized latency on the dataset


@dataclass(slots=True)
class Plan:
    rates: dict[str, list[float]]
    num_prompts: dict[str, int]
    seed: int = 0


FULL = Plan(rates={"sharegpt": [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5],
                   "alpaca": [2, 4, 8, 12, 16, 20, 24, 28, 30, 36]},
            num_prompts={"sharegpt": 1000, "alpaca": 2000})
QUICK = Plan(rates={"sharegpt": [0.5, 2.0], "alpaca": [8, 30]}, num_prompts={"sharegpt": 60, "alpaca": 120})


def say(message: str) -> None:
    print(f"simulate: {message}", file=sys.stderr, flush=True)


def settings_for(profile: Profile) -> Settings:
    """The paper's setting: its model's sequence limit, no prefix caching (random prompts share nothing), and
    recompute preemption (no swap space)."""
    return Settings(max_model_len=profile.model.max_model_len, enable_prefix_caching=False, swap_space_bytes=0)


def sweep(profile: Profile, plan: Plan, out_dir: Path) -> list[Path]:
    settings = settings_for(profile)
    paths = []
    for dataset, rates in plan.rates.items():
        spec = WorkloadSpec(dataset=dataset, num_prompts=plan.num_prompts[dataset],
                            vocab_size=profile.model.vocab_size, max_model_len=settings.max_model_len)
        requests = build_requests(spec, plan.seed)
        for label, reservation in SYSTEMS.items():
            worker_scheduler = reserving_scheduler(reservation) if reservation else None
            report: dict[str, Any] = {"system": label, "model": profile.name, "simulated": True,
                                      "workload": {"dataset": dataset, "num_prompts": spec.num_prompts,
                                                   "max_model_len": spec.max_model_len, "seed": plan.seed},
                                      "points": []}
            for rate in rates:
                start = time.perf_counter()
                simulation = Simulation(settings, profile, 1, worker_scheduler)
                p = point(simulation, requests, arrival_times(len(requests), rate, 1.0, plan.seed), rate)
                report["points"].append(p)
                say(f"{dataset} {label} @ {rate:g} req/s: {p['request_throughput']:.2f} req/s, norm. latency "
                    f"{p['normalized_latency_s_per_token']:.4f} s/tok, mean batch {p['mean_batch_seqs']:.1f}, "
                    f"{p['preemptions']} preemptions ({time.perf_counter() - start:.0f} s)")
            path = out_dir / f"{label}-{dataset}.json"
            write_report(report, path)
            paths.append(path)
    return paths


def summary(groups: dict[str, list[plot.Report]], profile: Profile) -> str:
    num_blocks = next(iter(groups.values()))[0].points[0]["num_blocks"]
    lines = [f"# Simulated: {profile.name} ({profile.description})\n",
             f"KV cache: {num_blocks} blocks of 16 tokens.\n"]
    for dataset, reports in groups.items():
        by = {r.system: r for r in reports}
        floor = plot.min_norm(by[PAGED])
        lines.append(f"## {dataset}\n")
        lines.append("| threshold (s/token) | " + " | ".join(f"`{s}` req/s" for s in by) + " | "
                     + " | ".join(f"{PAGED} / `{s}`" for s in by if s != PAGED) + " |")
        lines.append("|---" * (2 * len(by)) + "|")
        for k in THRESHOLDS:
            rates = {s: plot.sustained_rate(r, k * floor) for s, r in by.items()}
            ratios = [rates[PAGED] / rates[s] if rates[s] and rates[PAGED] else None for s in by if s != PAGED]
            lines.append(f"| {k} × {floor:.4f} = {k * floor:.4f} | "
                         + " | ".join(plot.fmt(v, ".2f") for v in rates.values()) + " | "
                         + " | ".join("-" if v is None else f"{v:.2f}×" for v in ratios) + " |")
        if dataset in PAPER_RATIOS:
            lines.append("\nThe paper, at similar latency over OPT-13B/66B/175B: "
                         + ", ".join(f"{PAGED} sustains {v} `{s}`'s rate" for s, v in PAPER_RATIOS[dataset].items())
                         + ".")
        rate, paper = PAPER_BATCH[dataset]
        lines.append(f"\nMean batch (sequences per step) at {rate:g} req/s, the paper's Figure 13 rate:\n")
        lines.append("| system | simulated | paper (Figure 13) | simulated req/s achieved | norm. latency (s/tok) |")
        lines.append("|---|---|---|---|---|")
        for s, r in by.items():
            p = next((p for p in r.points if float(p["request_rate"]) == rate), None)
            if p is not None:
                lines.append(f"| `{s}` | {p['mean_batch_seqs']:.2f} | {paper[s]:.2f} | {p['request_throughput']:.2f} "
                             f"| {p['normalized_latency_s_per_token']:.4f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/simulated/fig12"))
    p.add_argument("--profile", default="a100-40gb-opt-13b", help="a profile of gpu_worker/profiles.json")
    p.add_argument("--quick", action="store_true", help="two rates per dataset, a few requests (numbers meaningless)")
    p.add_argument("--plot-only", action="store_true", help="no run: plots and summary from OUT_DIR/*.json")
    args = p.parse_args(argv)
    profile = get_profile(args.profile)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        order = {f"{label}-{dataset}": i for i, (dataset, label) in
                 enumerate((d, label) for d in FULL.rates for label in SYSTEMS)}
        paths = sorted(args.out_dir.glob("*.json"), key=lambda path: order.get(path.stem, len(order)))
    else:
        paths = sweep(profile, QUICK if args.quick else FULL, args.out_dir)
    groups = plot.by_dataset(plot.load_reports(paths))
    title = f"SIMULATED: {profile.name}, virtual clock (benchmarks/simulate.py)"
    plot.plot_normalized_latency(groups, args.out_dir / "normalized_latency.png", None, PAGED, title)
    plot.plot_throughput(groups, args.out_dir / "throughput.png", title)
    text = summary(groups, profile)
    (args.out_dir / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
