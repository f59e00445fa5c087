"""The serving comparison of issue 8 in one command: every system, the same requests, then the plots.

    python -m benchmarks.compare --out-dir benchmarks/results [--quick]

For each request rate of the sweep and each system (the static-batching baseline, pagedserve with a
contiguous max_model_len reservation per request, pagedserve with 1 and with 2 workers) it starts a
fresh server, waits for `ready:`, sends the same requests (same dataset, seed and arrivals) with
pagedserve/bench.py, and stops the server. Systems alternate within each rate, so that load from
other processes on a shared machine falls on all of them alike. Then the shared-prefix dataset runs on
one worker with prefix caching on and off, and benchmarks/plot.py writes the PNGs and summary.md, to
which the target verdicts are appended. Every system gets the same KV memory per worker
(--num-blocks; the baseline gets as many token slots), so memory limits the batch as on a GPU.
Progress goes to stderr, server logs to --log-dir (default: a new folder under the temporary directory).

`--systems vllm --vllm-bin PATH` runs instead the side-by-side with vLLM's CPU build of issue 16
(benchmarks/versus_vllm.py) and prints its table; without --vllm-bin the vllm system is skipped with a message.

`--systems pagedserve-1w,simulated-1w` checks the simulated worker instead (issue 15): the same sweep on the
real stack and on the stack with a simulated worker fitted to this machine (`up --simulate cpu-tiny`), rate by
rate, and the error of the simulated normalized latency at each rate.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import plot, versus_vllm
from pagedserve import bench as serving
from pagedserve.ports import free_port
from shared.settings import Settings

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
BASELINE, CONTIGUOUS, PAGED, PAGED_2W = "hf-static", "contiguous", "pagedserve-1w", "pagedserve-2w"
PREFIX_ON, PREFIX_OFF = "prefix-on", "prefix-off"
# pagedserve with a simulated worker fitted to this machine (gpu_worker/simulated.py, profile cpu-tiny): run with
# PAGED to check the simulation against the real stack (`--systems pagedserve-1w,simulated-1w`); not by default.
SIMULATED = "simulated-1w"
SYSTEMS = (BASELINE, CONTIGUOUS, PAGED, PAGED_2W, PREFIX_ON, PREFIX_OFF, SIMULATED)  # run, plot and table order
SIMULATION_TOLERANCE = 0.15
VLLM = "vllm"  # not in the sweep: with --vllm-bin, the side-by-side of benchmarks/versus_vllm.py


class ServerError(RuntimeError):
    """A server did not start; the message carries the end of its output."""


class Server:
    """A server subprocess that prints `ready: URL` on stdout; its stderr (the logs) goes to `log`."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log_file, text=True,
                                     env=env, cwd=Path(__file__).resolve().parents[1])
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("ready: ") and not self.url:
                self.url = line.split(" ", 1)[1].strip()
                self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str:
        self._ready.wait(timeout)
        if not self.url:
            self.stop()
            tail = self.log.read_text(encoding="utf-8", errors="replace")[-3000:]
            raise ServerError(f"{' '.join(map(str, self.proc.args))} did not print `ready:`; log {self.log}:\n{tail}")
        return self.url

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log_file.close()

    def __enter__(self) -> "Server":
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(slots=True)
class Plan:
    """What one comparison runs (the full run and --quick differ only here). A point sends about
    `point_seconds` of arrivals, within [min_prompts, max_prompts] requests; the requests of a smaller point
    are the head of a larger one's (pagedserve/workloads.py). max_prompts stays below 100: the gateway's
    pool of blocking Redis connections holds 100, and it leaks one per request (see RESULTS.md)."""
    rates: list[float]
    prefix_rates: list[float]
    point_seconds: float = 10.0
    min_prompts: int = 30
    max_prompts: int = 90
    max_model_len: int = 512
    num_blocks: int = 128  # KV blocks per worker, null block included (8 MiB of the tiny model's float32 KV)
    length_scale: float = 0.25
    prefix_len: int = 448
    suffix_len: int = 16
    prefix_output_len: int = 32
    seed: int = 0
    up_args: list[str] = field(default_factory=list)
    baseline_args: list[str] = field(default_factory=list)

    def num_prompts(self, rate: float) -> int:
        return max(self.min_prompts, min(self.max_prompts, round(rate * self.point_seconds)))


FULL = Plan(rates=[1, 2, 4, 5, 6, 7, 8, 10, 14, 20], prefix_rates=[2, 4, 8])
QUICK = Plan(rates=[2, 8], prefix_rates=[4], min_prompts=12, max_prompts=12)


def server_commands(model: Path, plan: Plan) -> dict[str, list[str]]:
    """Server command line per system label, without the port. The baseline's token budget is the usable
    part of a worker's cache (block 0 is the null block); its batch cap is pagedserve's max_num_seqs."""
    stack = ["--model", str(model), "--max-model-len", str(plan.max_model_len), "--num-blocks", str(plan.num_blocks),
             *plan.up_args]
    up = [sys.executable, "-m", "pagedserve", "up", *stack]
    defaults = Settings()
    budget = (plan.num_blocks - 1) * defaults.block_size
    return {
        BASELINE: [sys.executable, "-m", "benchmarks.hf_static_server", "--model", str(model),
                   "--max-batch-size", str(defaults.max_num_seqs), "--kv-budget-tokens", str(budget),
                   *plan.baseline_args],
        CONTIGUOUS: [sys.executable, "-m", "benchmarks.contiguous", "up", *stack, "--workers", "1"],
        PAGED: [*up, "--workers", "1"],
        PAGED_2W: [*up, "--workers", "2"],
        PREFIX_ON: [*up, "--workers", "1", "--enable-prefix-caching"],
        PREFIX_OFF: [*up, "--workers", "1", "--no-enable-prefix-caching"],
        SIMULATED: [*up, "--workers", "1", "--simulate", "cpu-tiny"],
    }


def say(message: str) -> None:
    print(f"compare: {message}", file=sys.stderr, flush=True)



def run_point(label: str, cmd: list[str], bench_args: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start a fresh server, measure one point with pagedserve/bench.py, stop the server."""
    with Server([*cmd, "--port", str(free_port())], log, env) as server:
        args = serving.build_parser().parse_args(["--base-url", server.url, "--label", label, "--disable-tqdm",
                                                  "--request-timeout", "600", *bench_args])
        return asyncio.run(serving.benchmark(args))


def sweep(systems: dict[str, list[str]], plan: Plan, rates: list[float], workload: list[str], out_dir: Path,
          log_dir: Path, env: dict[str, str]) -> list[Path]:
    """Every rate on every system, systems alternating within a rate; one JSON report per system."""
    reports: dict[str, dict[str, Any]] = {}
    total, done = len(rates) * len(systems), 0
    for rate in rates:
        for label, cmd in systems.items():
            start = time.perf_counter()
            rep = run_point(label, cmd, [*workload, "--request-rate", str(rate), "--num-prompts",
                                         str(plan.num_prompts(rate))],
                            log_dir / f"{label}-{rate:g}.log", env)
            if label in reports:
                reports[label]["points"] += rep["points"]
            else:
                reports[label] = rep
            done += 1
            p = rep["points"][0]
            norm = p["normalized_latency_s_per_token"]
            say(f"[{done}/{total}] {label} @ {rate:g} req/s: {p['completed']} done, {p['failed']} failed, "
                f"{p['request_throughput']:.2f} req/s, {p['output_throughput']:.0f} tok/s, "
                f"TTFT {p['ttft_ms']['mean'] or 0:.0f} ms, norm. latency {norm or 0:.4f} s/tok "
                f"({time.perf_counter() - start:.0f} s)")
            for err in p["errors"]:
                say(f"  failed request: {err}")
    paths = []
    for label, rep in reports.items():
        for point in rep["points"]:
            point.pop("requests")  # per-request rows: large, and the summaries above hold what the plots need
        path = out_dir / f"{label}-{rep['workload']['dataset']}.json"
        serving.write_report(rep, path)
        paths.append(path)
    return paths


def targets(paths: list[Path]) -> str:
    """Where issue 8's targets land, from the reports just written."""
    groups = plot.by_dataset(plot.load_reports(paths))
    lines = ["## Targets\n"]
    for dataset, reports in groups.items():
        by = {r.system: r for r in reports}
        if BASELINE in by and PAGED in by:
            threshold = 2 * plot.min_norm(by[BASELINE])
            rate = {name: plot.sustained_rate(r, threshold) for name, r in by.items()}
            lines.append(f"- {dataset}: at {threshold:.4f} s/token (twice `{BASELINE}`'s minimum) the systems "
                         "sustain " + ", ".join(f"`{n}` {plot.fmt(v, '.2f')} req/s" for n, v in rate.items()) + ".")
            best = {name: max(p["output_throughput"] for p in r.points) for name, r in by.items()}
            for ref, goal in ((BASELINE, 2.0), (CONTIGUOUS, 1.5)):
                if ref not in by:
                    continue
                pair = f"  - `{PAGED}` / `{ref}`"
                if rate[ref] and rate[PAGED] is not None:
                    ratio = rate[PAGED] / rate[ref]
                    verdict = "met" if ratio >= goal else "NOT met"
                    lines.append(f"{pair} = {ratio:.3f}× (target ≥ {goal}×: {verdict}); "
                                 f"best output throughput {best[PAGED] / best[ref]:.3f}×")
                else:
                    # A system over the threshold at its lowest measured rate has no sustained rate to divide.
                    over = [n for n in (PAGED, ref) if not rate[n]]
                    verdict = "undetermined" if len(over) == 2 else "NOT met" if over == [PAGED] else "met"
                    lines.append(f"{pair}: no ratio, " + " and ".join(f"`{n}`" for n in over)
                                 + f" over the threshold at every measured rate (target ≥ {goal}×: {verdict}; "
                                 "measure lower rates to place it)")
        if PAGED in by and SIMULATED in by:
            lines += validation(dataset, by[PAGED], by[SIMULATED])
        if PREFIX_ON in by and PREFIX_OFF in by:
            on = {p["request_rate"]: p["ttft_ms"]["mean"] for p in by[PREFIX_ON].points}
            off = {p["request_rate"]: p["ttft_ms"]["mean"] for p in by[PREFIX_OFF].points}
            for r in sorted(set(on) & set(off), key=float):
                if on[r] and off[r]:
                    ratio = off[r] / on[r]
                    lines.append(f"- {dataset} @ {r} req/s: TTFT mean {off[r]:.1f} ms off / {on[r]:.1f} ms on = "
                                 f"{ratio:.3f}× lower with prefix caching (target ≥ 2×: "
                                 f"{'met' if ratio >= 2 else 'NOT met'})")
    return "\n".join(lines) + "\n"


def validation(dataset: str, real: plot.Report, simulated: plot.Report) -> list[str]:
    """The simulated stack against the real one, rate by rate: its normalized latency within 15 % at each rate
    below saturation (where the real stack stays within twice its lowest normalized latency)."""
    floor = plot.min_norm(real)
    sim = {p["request_rate"]: p["normalized_latency_s_per_token"] for p in simulated.points}
    lines = [f"- {dataset}: `{SIMULATED}` against `{PAGED}` (normalized latency, s/token; saturation: above "
             f"2 × {floor:.4f})", "", "  | rate | real | simulated | error | below saturation | within "
             f"{SIMULATION_TOLERANCE:.0%} |", "  |---|---|---|---|---|---|"]
    for p in real.rated_points():
        rate, norm = p["request_rate"], p["normalized_latency_s_per_token"]
        if norm is None or sim.get(rate) is None:
            continue
        error = (sim[rate] - norm) / norm
        below = norm <= 2 * floor
        verdict = ("yes" if abs(error) <= SIMULATION_TOLERANCE else "NO") if below else "-"
        lines.append(f"  | {rate:g} | {norm:.4f} | {sim[rate]:.4f} | {error:+.1%} | {'yes' if below else 'no'} "
                     f"| {verdict} |")
    return lines + [""]


def measure(args: argparse.Namespace, plan: Plan) -> list[Path]:
    """Run the sweeps of the systems asked for; the JSON reports written."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedserve-compare-logs-"))
    with tempfile.TemporaryDirectory(prefix="pagedserve-compare-") as tmp:
        model = args.model
        if model is None:
            from pagedserve.tiny_model import write_tiny_model

            model = write_tiny_model(Path(tmp) / "tiny-llama")
        commands = server_commands(model, plan)
        common = ["--model-dir", str(model), "--max-model-len", str(plan.max_model_len), "--seed", str(plan.seed)]
        sharegpt = [*common, "--dataset", "sharegpt", "--length-scale", str(plan.length_scale)]
        prefix = [*common, "--dataset", "prefix", "--prefix-len", str(plan.prefix_len), "--suffix-len",
                  str(plan.suffix_len), "--output-len", str(plan.prefix_output_len)]
        say(f"load average {os.getloadavg()[0]:.2f}; model {model}; rates {plan.rates}; server logs in {log_dir}")
        main_systems = {k: commands[k] for k in args.systems if k not in (PREFIX_ON, PREFIX_OFF)}
        prefix_systems = {k: commands[k] for k in args.systems if k in (PREFIX_ON, PREFIX_OFF)}
        paths = sweep(main_systems, plan, plan.rates, sharegpt, args.out_dir, log_dir, env) if main_systems else []
        if prefix_systems:
            paths += sweep(prefix_systems, plan, plan.prefix_rates, prefix, args.out_dir, log_dir, env)
    say(f"load average {os.getloadavg()[0]:.2f}; plotting")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temporary folder)")
    p.add_argument("--quick", action="store_true", help="a ~2 minute run: two rates, a few requests")
    p.add_argument("--plot-only", action="store_true", help="no run: plots and verdicts from OUT_DIR/*.json")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--rates", default=None, help="comma-separated request rates (overrides the plan's)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per point (default: ~10 s of arrivals)")
    p.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != SIMULATED),
                   help=f"comma-separated labels to run, of {', '.join(SYSTEMS)}")
    p.add_argument("--max-model-len", type=int, default=None, help="every system's sequence limit")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks of 16 tokens per worker")
    p.add_argument("--length-scale", type=float, default=None, help="multiplies the ShareGPT lengths")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every server process")
    p.add_argument("--up-args", default="", help="extra `pagedserve up` flags (e.g. '--device cuda')")
    p.add_argument("--baseline-args", default="", help="extra hf_static_server flags (e.g. '--device cuda')")
    versus_vllm.add_arguments(p)
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS) - {VLLM}
    if unknown:
        p.error(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}, {VLLM}")
    if VLLM in args.systems:  # its own comparison (benchmarks/versus_vllm.py), then the sweep of the others
        args.systems.remove(VLLM)
        code = 0
        if args.vllm_bin is None:
            say("skipping vllm: no --vllm-bin given (install vLLM's CPU build with benchmarks/install_vllm.sh)")
        else:
            code = versus_vllm.run(args)
        if not args.systems:
            return code
    plan = dataclasses.replace(QUICK if args.quick else FULL, up_args=args.up_args.split(),
                               baseline_args=args.baseline_args.split())
    if args.rates:
        plan.rates = [float(r) for r in args.rates.split(",")]
    if args.num_prompts:
        plan.min_prompts = plan.max_prompts = args.num_prompts
    for name in ("max_model_len", "num_blocks", "length_scale"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    if args.plot_only:
        order = {name: i for i, name in enumerate(SYSTEMS)}
        paths = sorted(args.out_dir.glob("*.json"), key=lambda path: order.get(path.stem.rsplit("-", 1)[0], len(order)))
        if not paths:
            p.error(f"--plot-only: no JSON report in {args.out_dir}")
    else:
        paths = measure(args, plan)
    code = plot.main([*map(str, paths), "--out-dir", str(args.out_dir), "--baseline", BASELINE])
    verdicts = targets(paths)
    with open(args.out_dir / "summary.md", "a", encoding="utf-8") as f:
        f.write("\n" + verdicts)
    print(verdicts)
    return code


if __name__ == "__main__":
    sys.exit(main())
