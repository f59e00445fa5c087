"""Plots and a summary table from the JSON reports of pagedserve/bench.py (one file per system and dataset).

    python -m benchmarks.plot benchmarks/results/*.json --out-dir benchmarks/results --baseline hf-static

Writes normalized_latency.png (the vLLM paper's Figure 12 layout: normalized latency against request rate,
one panel per dataset, one line per system, on a log axis), throughput.png (the best output throughput of
each system),
kv_usage.png (KV cache usage over time, where the endpoint exported it) and summary.md, which it also
prints: per system the request rate it sustains at twice the baseline's minimum normalized latency
(interpolated where its latency crosses that threshold), and its ratio to the baseline's.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_KV_PATTERN = r"kv_cache_usage|cache_usage_perc"


@dataclass(slots=True)
class Report:
    system: str
    dataset: str
    points: list[dict[str, Any]]

    def rated_points(self) -> list[dict[str, Any]]:
        """Points with a finite request rate, by rate (an all-at-once point has no place on a rate axis)."""
        return sorted((p for p in self.points if p["request_rate"] != "inf"), key=_rate)


def load_reports(paths: list[Path]) -> list[Report]:
    reports = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            reports.append(Report(str(data["system"]), str(data["workload"]["dataset"]), list(data["points"])))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {path} is not a pagedserve/bench.py report: {type(e).__name__}: {e}")
    return reports


def by_dataset(reports: list[Report]) -> dict[str, list[Report]]:
    groups: dict[str, list[Report]] = defaultdict(list)
    for r in reports:
        groups[r.dataset].append(r)
    return dict(sorted(groups.items()))


def system_colors(groups: dict[str, list[Report]]) -> dict[str, str]:
    """One color per system, the same in every plot."""
    systems = dict.fromkeys(r.system for reports in groups.values() for r in reports)
    return {system: f"C{i % 10}" for i, system in enumerate(systems)}


def plot_normalized_latency(groups: dict[str, list[Report]], out: Path, max_latency: float | None,
                            baseline: str, title: str = "") -> None:
    """Log latency axis: the systems' knees lie a decade or more apart. A dashed line marks the targets'
    threshold (twice the baseline's minimum) in the panels that have the baseline."""
    colors = system_colors(groups)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 3.8), squeeze=False)
    for ax, (dataset, reports) in zip(axes[0], groups.items()):
        for r in reports:
            pts = [p for p in r.rated_points() if p["normalized_latency_s_per_token"] is not None]
            ax.plot([p["request_rate"] for p in pts], [p["normalized_latency_s_per_token"] for p in pts],
                    marker="o", label=r.system, color=colors[r.system])
        base_min = next((min_norm(r) for r in reports if r.system == baseline), None)
        if base_min is not None:
            ax.axhline(2 * base_min, color="gray", linestyle="--", linewidth=1, label=f"2 × {baseline} min")
        ax.set_title(dataset)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_yscale("log")
        if max_latency is not None:
            ax.set_ylim(top=max_latency)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    finish(fig, out, title)


def plot_throughput(groups: dict[str, list[Report]], out: Path, title: str = "") -> None:
    """The best output throughput of each system, one panel per dataset (each with its own systems)."""
    colors = system_colors(groups)
    fig, axes = plt.subplots(1, len(groups), figsize=(sum(1.2 + 0.9 * len(r) for r in groups.values()), 3.6),
                             squeeze=False, width_ratios=[len(r) for r in groups.values()])
    for ax, (dataset, reports) in zip(axes[0], groups.items()):
        best = [max((p["output_throughput"] for p in r.points), default=0.0) for r in reports]
        bars = ax.bar(range(len(reports)), best, 0.7, color=[colors[r.system] for r in reports])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(reports)), [r.system for r in reports], rotation=20, ha="right", fontsize=8)
        ax.set_title(dataset)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("best output throughput (tokens/s)")
    finish(fig, out, title)


def finish(fig: plt.Figure, out: Path, title: str = "") -> None:
    """Lay out, title (e.g. to mark simulated figures) and write the figure."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _rate(point: dict[str, Any]) -> float:
    return math.inf if point["request_rate"] == "inf" else float(point["request_rate"])


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def kv_point(report: Report, pattern: re.Pattern[str]) -> dict[str, Any] | None:
    """The point whose KV usage is most telling: the highest request rate that has KV samples."""
    def has_kv(p: dict[str, Any]) -> bool:
        return any(pattern.search(name) for s in p.get("metrics") or [] for name in s["values"])
    return max((p for p in report.points if has_kv(p)), key=_rate, default=None)


def plot_kv_usage(groups: dict[str, list[Report]], out: Path, pattern: re.Pattern[str]) -> bool:
    """KV usage against time, one panel per dataset; False (and no file) when no report has KV samples."""
    panels = {d: [(r, kv_point(r, pattern)) for r in reports] for d, reports in groups.items()}
    panels = {d: [(r, p) for r, p in rows if p is not None] for d, rows in panels.items()}
    panels = {d: rows for d, rows in panels.items() if rows}
    if not panels:
        return False
    colors = system_colors(groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (dataset, rows) in zip(axes[0], panels.items()):
        for report, point in rows:
            series = sorted({n for s in point["metrics"] for n in s["values"] if pattern.search(n)})
            for i, name in enumerate(series):
                ts = [(s["t"], s["values"][name]) for s in point["metrics"] if name in s["values"]]
                label = report.system if len(series) == 1 else f"{report.system} {name[name.find('{'):]}"
                ax.plot([t for t, _ in ts], [v for _, v in ts], label=f"{label} @ {point['request_rate']} req/s",
                        color=colors[report.system], linestyle=("-", "--", ":", "-.")[i % 4])
        ax.set_title(dataset)
        ax.set_xlabel("time since the first request (s)")
        ax.set_ylabel("KV cache usage" if pattern.pattern == DEFAULT_KV_PATTERN else pattern.pattern)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    finish(fig, out)
    return True


def min_norm(report: Report) -> float | None:
    values = [p["normalized_latency_s_per_token"] for p in report.rated_points()
              if p["normalized_latency_s_per_token"] is not None]
    return min(values, default=None)


def sustained_rate(report: Report, threshold: float) -> float | None:
    """The request throughput a system sustains at `threshold` normalized latency. Walking up the sweep, the
    achieved throughput where the latency first crosses the threshold, interpolated linearly between the last
    point within and the first beyond; the last point's if none is beyond; None if the first is beyond."""
    last: tuple[float, float] | None = None
    for p in report.rated_points():
        norm = p["normalized_latency_s_per_token"]
        if norm is None:
            continue
        if norm > threshold:
            if last is None:
                return None
            x0, y0 = last
            return max(x0, x0 + (p["request_throughput"] - x0) * (threshold - y0) / (norm - y0))
        last = (p["request_throughput"], norm)
    return None if last is None else last[0]


def summary(groups: dict[str, list[Report]], baseline: str) -> str:
    lines = []
    for dataset, reports in groups.items():
        base = next((r for r in reports if r.system == baseline), None)
        base_min = min_norm(base) if base is not None else None
        lines.append(f"### {dataset}\n")
        if base_min is None:
            lines.append(f"(no baseline `{baseline}` here: each system's threshold is twice its own minimum)\n")
        else:
            lines.append(f"threshold: 2 × `{baseline}`'s minimum normalized latency = {2 * base_min:.4f} s/token\n")
        lines.append("| system | min norm. latency (s/tok) | req/s at threshold | × baseline "
                     "| best out tok/s | TTFT mean at the lowest rate (ms) |")
        lines.append("|---|---|---|---|---|---|")
        base_rate = sustained_rate(base, 2 * base_min) if base_min is not None else None
        for r in reports:
            own_min = min_norm(r)
            threshold = 2 * (base_min if base_min is not None else own_min) if own_min is not None else None
            rate = sustained_rate(r, threshold) if threshold is not None else None
            ratio = rate / base_rate if rate is not None and base_rate else None
            best = max((p["output_throughput"] for p in r.points), default=None)
            rated = r.rated_points()
            ttft = rated[0]["ttft_ms"]["mean"] if rated else None
            lines.append(f"| {r.system} | {fmt(own_min, '.4f')} | {fmt(rate, '.2f')} | {fmt(ratio, '.2f')} "
                         f"| {fmt(best, '.1f')} | {fmt(ttft, '.1f')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="JSON reports written by pagedserve/bench.py --json-out")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/out/plots"))
    p.add_argument("--baseline", default="hf-static", help="system label the targets are measured against")
    p.add_argument("--max-latency", type=float, default=None, help="clip the normalized-latency axis (s/token)")
    p.add_argument("--kv-pattern", default=DEFAULT_KV_PATTERN, help="regex of the KV usage metric names")
    args = p.parse_args(argv)
    groups = by_dataset(load_reports(args.reports))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = [args.out_dir / "normalized_latency.png", args.out_dir / "throughput.png"]
    plot_normalized_latency(groups, written[0], args.max_latency, args.baseline)
    plot_throughput(groups, written[1])
    if plot_kv_usage(groups, args.out_dir / "kv_usage.png", re.compile(args.kv_pattern)):
        written.append(args.out_dir / "kv_usage.png")
    text = summary(groups, args.baseline)
    (args.out_dir / "summary.md").write_text(text + "\n", encoding="utf-8")
    written.append(args.out_dir / "summary.md")
    print(text)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
