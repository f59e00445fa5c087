"""Draft-free speculative decoding on the real model (issue 38): TPOT, output tokens/s and acceptance with speculation
off, n-gram and suffix, against vLLM's CPU build off and with its `ngram` method, on the same requests.

    python -m benchmarks.speculative [--vllm-bin /work/vllm-venv/bin/vllm] [--concurrency 1,4,16,64]

Every server (`pagedserve up --workers 1` and `vllm serve`, SmolLM2-135M-Instruct in bfloat16) is started first and
stays up; each cell then runs on every server back to back, in an order that rotates from cell to cell (an idle
server costs next to nothing). The cells: three workloads (copy: benchmarks/copy_workload.py's chat requests, each
rendered with the chat template into the token ids the chat endpoint would make; random: 128 random prompt tokens,
greedy; random-t1: the same sampled at temperature 1, text that does not repeat) at each concurrency, 2 x
concurrency requests (at least 4), 128 output tokens each (ignore_eos), through /v1/completions with the bench
client (pagedserve/bench.py). Acceptance comes from each server's own /metrics counters, read before and after a
cell. The simulated GPU's view (gpu_worker/cost_model.py, profile h200-llama-3-8b) prices a step that checks k draft
tokens per sequence against a plain decode step and gives the TPOT ratio each measured acceptance would give there.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.copy_workload import copy_requests
from benchmarks.versus_vllm import System, start, stop, wait_ready
from gpu_worker.cost_model import ChunkSize, get_profile
from pagedserve.bench import Endpoint, RunConfig, run_point
from pagedserve.workloads import SampleRequest, WorkloadSpec, build_requests
from shared.model_dir import resolve_model_dir

OUTPUT_LEN = 128
K = 4
CONFIGS = {"ngram": {"method": "ngram", "num_speculative_tokens": K},
           "suffix": {"method": "suffix", "num_speculative_tokens": K}}
# (draft tokens, accepted tokens, drafts) counters of each server's /metrics
COUNTERS = {"pagedserve": ("pagedserve_spec_decode_num_draft_tokens_total",
                           "pagedserve_spec_decode_num_accepted_tokens_total",
                           "pagedserve_spec_decode_num_drafts_total"),
            "vllm": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                     "vllm:spec_decode_num_drafts_total")}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def workloads(model_dir: Path, num: int) -> dict[str, list[SampleRequest]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    copy = [SampleRequest(tokenizer(tokenizer.apply_chat_template(r.messages, tokenize=False,
                                                                  add_generation_prompt=True),
                                    add_special_tokens=False).input_ids, OUTPUT_LEN)
            for r in copy_requests(num, seed=0, max_tokens=OUTPUT_LEN)]
    specials = tuple(tokenizer.all_special_ids)
    random = build_requests(WorkloadSpec("random", num, len(tokenizer), 2048, input_len=128, output_len=OUTPUT_LEN,
                                         special_ids=specials), seed=0)
    sampled = [dataclasses.replace(r, temperature=1.0) for r in random]
    return {"copy": copy, "random": random, "random-t1": sampled}


def systems(model_dir: Path, name: str, args: argparse.Namespace) -> list[System]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    up = [sys.executable, "-m", "pagedserve", "up", "--model", str(model_dir), "--served-model-name", name,
          "--workers", "1", "--dtype", "bfloat16", "--log-level", "warning"]
    vllm = [args.vllm_bin, "serve", str(model_dir), "--served-model-name", name, "--max-model-len", "2048",
            "--dtype", "bfloat16"]
    vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    out = []
    for method in args.methods.split(","):
        spec = ["--speculative-config", json.dumps(CONFIGS[method])] if method != "off" else []
        out.append(System(f"pagedserve-{method}", [*up, *spec], env))
        if args.vllm_bin and method != "suffix":  # vLLM's suffix method needs arctic-inference, not installed here
            out.append(System(f"vllm-{method}", [*vllm, *spec], vllm_env))
    return out


async def counters(session: aiohttp.ClientSession, url: str, names: tuple[str, ...]) -> list[float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return [sum(float(v) for v in re.findall(rf"^{re.escape(n)}(?:{{[^}}]*}})? (\S+)$", text, re.M)) for n in names]


async def measure(systems: list[System], model: str, loads: dict[str, list[SampleRequest]],
                  concurrencies: list[int]) -> list[dict]:
    """Every cell on every server, the servers back to back within a cell in an order that rotates from cell to
    cell, so that the machine's drift over the run falls on all of them alike."""
    rows = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for system in systems:
            await run_point(session, _endpoint(system, model), next(iter(loads.values()))[:2], float("inf"),
                            _config(2))
        cells = [(workload, c) for workload in loads for c in concurrencies]
        for i, (workload, c) in enumerate(cells):
            for system in systems[i % len(systems):] + systems[:i % len(systems)]:
                rows.append(await measure_cell(session, system, model, workload, loads[workload][:max(4, 2 * c)], c))
    return rows


async def measure_cell(session: aiohttp.ClientSession, system: System, model: str, workload: str,
                       batch: list[SampleRequest], concurrency: int) -> dict:
    names = COUNTERS["vllm" if system.label.startswith("vllm") else "pagedserve"]
    before = await counters(session, system.url, names)
    point = await run_point(session, _endpoint(system, model), batch, float("inf"), _config(concurrency))
    after = await counters(session, system.url, names)
    drafted, accepted, drafts = (a - b for a, b in zip(after, before))
    row = {"system": system.label, "workload": workload, "concurrency": concurrency, "requests": len(batch),
           "failed": point["failed"], "errors": point["errors"], "tpot_ms": point["tpot_ms"]["mean"],
           "output_tok_s": point["output_throughput"], "acceptance": accepted / drafted if drafted else None,
           "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    say(f"{system.label:18} {workload:9} c={concurrency:<3} TPOT {row['tpot_ms']:.1f} ms  "
        f"{row['output_tok_s']:.1f} tok/s  acceptance {row['acceptance']}  failed {row['failed']}")
    return row


def _endpoint(system: System, model: str) -> Endpoint:
    return Endpoint(system.url + "/v1/completions", system.url + "/metrics", model, {})


def _config(concurrency: int) -> RunConfig:
    return RunConfig(burstiness=1.0, max_concurrency=concurrency, seed=0, metrics_interval=0.0,
                     metrics_pattern=re.compile("$^"), disable_tqdm=True)


def gpu_view(rows: list[dict]) -> list[dict]:
    """The TPOT ratio (without / with speculation) each measured acceptance would give on the simulated H200: a
    drafting step checks K tokens per sequence after its decode token and yields `mean_acceptance_length` tokens."""
    profile = get_profile("h200-llama-3-8b")
    context = 512
    view = []
    for row in rows:
        if row["mean_acceptance_length"] is None:
            continue
        c = row["concurrency"]
        plain = profile.step_time([ChunkSize(context, 1)] * c, c)
        drafting = profile.step_time([ChunkSize(context, 1 + K)] * c, c * (1 + K))
        view.append({"system": row["system"], "workload": row["workload"], "concurrency": c,
                     "step_ms_plain": 1000 * plain, "step_ms_drafting": 1000 * drafting,
                     "tpot_ratio": row["mean_acceptance_length"] * plain / drafting})
    return view


def table(rows: list[dict], view: list[dict]) -> str:
    base = {(r["workload"], r["concurrency"], r["system"].split("-")[0]): r
            for r in rows if r["system"].endswith("-off")}
    lines = ["| system | workload | concurrency | TPOT ms | output tok/s | vs off: TPOT / tok/s | acceptance | mean "
             "acceptance length |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        off = base.get((r["workload"], r["concurrency"], r["system"].split("-")[0]))
        vs = (f"{off['tpot_ms'] / r['tpot_ms']:.2f}x / {r['output_tok_s'] / off['output_tok_s']:.2f}x"
              if off and r is not off else "")
        acc = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        mal = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(f"| {r['system']} | {r['workload']} | {r['concurrency']} | {r['tpot_ms']:.1f} | "
                     f"{r['output_tok_s']:.1f} | {vs} | {acc} | {mal} |")
    lines += ["", "Simulated H200 (h200-llama-3-8b, 512-token contexts): a step checking "
              f"{K} draft tokens per sequence against a plain decode step, and the TPOT ratio the measured mean "
              "acceptance length would give there.", "",
              "| system | workload | concurrency | plain step ms | drafting step ms | TPOT without / with |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {v['system']} | {v['workload']} | {v['concurrency']} | {v['step_ms_plain']:.2f} | "
              f"{v['step_ms_drafting']:.2f} | {v['tpot_ratio']:.2f}x |" for v in view]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-bin", default="", help="vLLM's CLI (benchmarks/install_vllm.sh); empty: pagedserve only")
    p.add_argument("--methods", default="off,ngram,suffix", help="comma-separated: off, ngram, suffix")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--workloads", default="copy,random,random-t1", help="comma-separated: copy, random (greedy), "
                   "random-t1 (the same prompts sampled at temperature 1: text that does not repeat)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    args = p.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    model = resolve_model_dir("")
    every = workloads(model.path, max(4, 2 * max(concurrencies)))
    loads = {name: every[name] for name in args.workloads.split(",")}
    log_dir = Path(tempfile.mkdtemp(prefix="speculative-"))
    servers = systems(model.path, model.name, args)
    try:
        for system in servers:  # one at a time: vLLM's start-up takes the machine for minutes
            say(f"starting {system.label} (log {log_dir / (system.label + '.log')})")
            started = time.monotonic()
            start(system, log_dir)
            wait_ready(system)
            say(f"{system.label} ready in {time.monotonic() - started:.0f} s")
        rows = asyncio.run(measure(servers, model.name, loads, concurrencies))
    finally:
        for system in servers:
            stop(system)
    view = gpu_view(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "gpu_view": view, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(table(rows, view))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
