"""Serving benchmark: an async load generator against any OpenAI-compatible /v1/completions endpoint.

Streams every response (SSE) to time the first token and the gaps between tokens, sends prompts as
token-id lists with `ignore_eos` so that output lengths hold, and reports throughput and latency the
way vLLM's benchmark and paper do (normalized latency = end-to-end latency / output tokens). While it
runs it samples the endpoint's Prometheus /metrics (KV cache usage over time) for benchmarks/plot.py.

    pagedserve bench --base-url http://127.0.0.1:8000 --model-dir DIR \\
        --dataset sharegpt --length-scale 0.25 --num-prompts 200 --sweep 1,2,4,8 \\
        --label pagedserve --json-out benchmarks/results/pagedserve-sharegpt.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
from tqdm import tqdm

from pagedserve.workloads import DATASETS, SampleRequest, WorkloadSpec, arrival_times, build_requests
from shared.model_dir import ModelDirError, eos_token_ids, max_model_len, read_config

DEFAULT_METRICS_PATTERN = r"kv_cache_usage|cache_usage_perc|requests_running|requests_waiting|preempt"
_PROM_LINE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)")
WARMUP_SALT = 1 << 30  # token-id stream of warmup prompts: distinct from every sweep point's


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (endpoint unreachable, model facts unknown); the message says why."""


@dataclass(slots=True)
class RequestOutput:
    prompt_tokens: int
    max_tokens: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first token
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    error: str = ""
    sent: float = 0.0  # time.perf_counter() when it was sent

    def chunk_times(self) -> list[float]:
        """When each token chunk came, on time.perf_counter()'s clock."""
        times = [self.sent + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times if self.ttft else []


@dataclass(slots=True)
class Endpoint:
    completions_url: str
    metrics_url: str
    model: str
    headers: dict[str, str]


async def send_completion(session: aiohttp.ClientSession, endpoint: Endpoint, req: SampleRequest) -> RequestOutput:
    out = RequestOutput(prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens)
    payload = {"model": endpoint.model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
               "temperature": req.temperature, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = 0
    usage_tokens: int | None = None
    done = False
    start = last = out.sent = time.perf_counter()
    try:
        async with session.post(endpoint.completions_url, json=payload, headers=endpoint.headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for data in sse_data(resp.content):
                if data == b"[DONE]":
                    done = True
                    break
                body = json.loads(data)
                if "error" in body:
                    out.error = f"stream error: {json.dumps(body['error'])[:300]}"
                    return out
                if body.get("usage"):
                    usage_tokens = int(body["usage"]["completion_tokens"])
                # Like vLLM's client: every chunk with a choice is a token event, even with empty text (held
                # back by incremental detokenization); the usage-only chunk has no choice.
                if body.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, AttributeError, KeyError, TypeError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency = time.perf_counter() - start
    out.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if not done:
        out.error = "the stream ended without [DONE]"
    elif chunks == 0:
        out.error = "the stream carried no token"
    else:
        out.success = True
    return out


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data:` of each server-sent event of a stream, `[DONE]` included."""
    async for raw in content:
        line = raw.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


def parse_prometheus(text: str, pattern: re.Pattern[str]) -> dict[str, float]:
    """Values of the series (`name{labels}`) whose metric name matches `pattern`, from Prometheus text."""
    values = {}
    for line in text.splitlines():
        m = _PROM_LINE.match(line.strip())
        if m is None or not pattern.search(m["name"]):
            continue
        try:
            values[m["name"] + (m["labels"] or "")] = float(m["value"])
        except ValueError:
            continue
    return values


@dataclass(slots=True)
class MetricsSampler:
    """Polls /metrics every `interval` seconds while a run lasts; gives up quietly if the endpoint has none."""
    url: str
    pattern: re.Pattern[str]
    interval: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    async def run(self, session: aiohttp.ClientSession, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with session.get(self.url) as resp:
                    if resp.status != 200:
                        self.error = f"GET {self.url}: HTTP {resp.status}"
                        return
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.error = f"GET {self.url}: {type(e).__name__}: {e}"
                return
            self.samples.append({"t": round(time.perf_counter() - t0, 4), "values": parse_prometheus(text, self.pattern)})
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize(outputs: list[RequestOutput], duration: float) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    errors = list(dict.fromkeys(o.error for o in outputs if not o.success))
    return {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "requested_output_tokens": sum(o.max_tokens for o in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats_ms([o.ttft for o in ok]),
        "tpot_ms": _stats_ms([(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]),
        "itl_ms": _stats_ms([gap for o in ok for gap in o.itl]),
        "e2el_ms": _stats_ms([o.latency for o in ok]),
        # The paper's Figure 12 metric: each request's end-to-end latency over its output length, averaged.
        "normalized_latency_s_per_token": float(np.mean([o.latency / o.output_tokens for o in ok])) if ok else None,
    }


async def _request_at(session: aiohttp.ClientSession, endpoint: Endpoint, req: SampleRequest, t0: float,
                      at: float, limit: asyncio.Semaphore | None, bar: tqdm) -> RequestOutput:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    if limit is None:
        out = await send_completion(session, endpoint, req)
    else:
        async with limit:
            out = await send_completion(session, endpoint, req)
    bar.update(1)
    return out


@dataclass(slots=True)
class RunConfig:
    burstiness: float
    max_concurrency: int | None
    seed: int
    metrics_interval: float
    metrics_pattern: re.Pattern[str]
    disable_tqdm: bool


async def run_point(session: aiohttp.ClientSession, endpoint: Endpoint, requests: list[SampleRequest],
                    rate: float, cfg: RunConfig) -> dict[str, Any]:
    """Send `requests` at `rate` (Poisson/gamma arrivals, or all at once) and summarize what came back."""
    times = arrival_times(len(requests), rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    sampler = MetricsSampler(endpoint.metrics_url, cfg.metrics_pattern, cfg.metrics_interval)
    stop = asyncio.Event()
    bar = tqdm(total=len(requests), desc=f"rate {rate:g} req/s", unit="req", disable=cfg.disable_tqdm, file=sys.stderr)
    t0 = time.perf_counter()
    metrics_task = asyncio.create_task(sampler.run(session, t0, stop)) if cfg.metrics_interval > 0 else None
    outputs = await asyncio.gather(*(_request_at(session, endpoint, r, t0, at, limit, bar)
                                     for r, at in zip(requests, times)))
    duration = time.perf_counter() - t0
    stop.set()
    if metrics_task is not None:
        await metrics_task
    bar.close()
    point: dict[str, Any] = {"request_rate": "inf" if math.isinf(rate) else rate, "burstiness": cfg.burstiness,
                             "max_concurrency": cfg.max_concurrency, "num_prompts": len(requests)}
    point.update(summarize(outputs, duration))
    point["metrics"] = sampler.samples
    point["metrics_error"] = sampler.error if metrics_task is not None else "disabled"
    point["requests"] = [{"prompt_tokens": o.prompt_tokens, "output_tokens": o.output_tokens, "ttft_s": o.ttft,
                          "latency_s": o.latency, "error": o.error} for o in outputs]
    return point


def _ms(stats: dict[str, float | None], key: str) -> str:
    value = stats[key]
    return "-" if value is None else f"{value:.1f}"


def format_table(points: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per request rate (ready for RESULTS.md)."""
    head = ("| rate (req/s) | done / failed | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p99 (ms) "
            "| ITL mean / p99 (ms) | E2E mean / p50 / p99 (ms) | norm. latency (s/tok) |")
    rows = [head, "|" + "---|" * 9]
    for p in points:
        norm = p["normalized_latency_s_per_token"]
        rows.append(
            f"| {p['request_rate']} | {p['completed']} / {p['failed']} | {p['request_throughput']:.2f} "
            f"| {p['output_throughput']:.1f} "
            f"| {_ms(p['ttft_ms'], 'mean')} / {_ms(p['ttft_ms'], 'p50')} / {_ms(p['ttft_ms'], 'p99')} "
            f"| {_ms(p['tpot_ms'], 'mean')} / {_ms(p['tpot_ms'], 'p99')} "
            f"| {_ms(p['itl_ms'], 'mean')} / {_ms(p['itl_ms'], 'p99')} "
            f"| {_ms(p['e2el_ms'], 'mean')} / {_ms(p['e2el_ms'], 'p50')} / {_ms(p['e2el_ms'], 'p99')} "
            f"| {'-' if norm is None else f'{norm:.4f}'} |")
    return "\n".join(rows)


@dataclass(slots=True)
class ModelFacts:
    vocab_size: int
    max_model_len: int
    special_ids: tuple[int, ...]


def model_facts(args: argparse.Namespace, listed_max_len: int | None) -> ModelFacts:
    """Vocabulary size, sequence limit and special ids: flags first, then the model dir, then /v1/models."""
    vocab, limit, special = args.vocab_size, args.max_model_len, set()
    if args.model_dir is not None:
        config = read_config(args.model_dir)
        text = config.get("text_config", config)
        vocab = vocab or int(text.get("vocab_size") or 0)
        limit = limit or max_model_len(config)
        special = {int(text[k]) for k in ("bos_token_id", "pad_token_id") if isinstance(text.get(k), int)}
        special.update(eos_token_ids(args.model_dir))
    limit = limit or listed_max_len or 0
    if not vocab:
        raise BenchmarkError("the vocabulary size is unknown: pass --vocab-size or --model-dir")
    if not limit:
        raise BenchmarkError("the model's sequence limit is unknown: pass --max-model-len or --model-dir")
    return ModelFacts(vocab, limit, tuple(sorted(i for i in special if 0 <= i < vocab)))


async def discover_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> tuple[str, int | None]:
    """The first model the endpoint lists, and its max_model_len when it says (vLLM and pagedserve do)."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise BenchmarkError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        raise BenchmarkError(f"GET {url}: {type(e).__name__}: {e}") from None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchmarkError(f"GET {url} lists no model; pass --model")
    listed = models[0].get("max_model_len")
    return str(models[0]["id"]), int(listed) if isinstance(listed, int) else None


def _rates(args: argparse.Namespace) -> list[float]:
    if args.sweep is None:
        return [args.request_rate]
    try:
        rates = [float(r) for r in args.sweep.split(",") if r.strip()]
    except ValueError:
        raise BenchmarkError(f"--sweep takes comma-separated request rates (numbers or inf), got {args.sweep!r}") from None
    if not rates:
        raise BenchmarkError("--sweep lists no request rate")
    return rates


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rates = _rates(args)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # limit=0: the connector must not cap concurrency behind --max-concurrency's back (aiohttp's default is 100).
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model, listed_max_len = (args.model, None) if args.model else await discover_model(session, base_url, headers)
        facts = model_facts(args, listed_max_len)
        spec = WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, vocab_size=facts.vocab_size,
                            max_model_len=facts.max_model_len, length_scale=args.length_scale,
                            input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
                            suffix_len=args.suffix_len, special_ids=facts.special_ids)
        spec.validate()
        endpoint = Endpoint(f"{base_url}{args.endpoint}", f"{base_url}/metrics", model, headers)
        warmup = WorkloadSpec(dataset="random", num_prompts=max(1, args.warmup_requests), vocab_size=facts.vocab_size,
                              max_model_len=facts.max_model_len, input_len=min(8, facts.max_model_len - 4),
                              output_len=4, special_ids=facts.special_ids)
        for req in build_requests(warmup, args.seed, WARMUP_SALT)[:args.warmup_requests]:
            out = await send_completion(session, endpoint, req)
            if not out.success:
                raise BenchmarkError(f"the warmup request to {endpoint.completions_url} failed: {out.error}")
        cfg = RunConfig(burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
                        metrics_interval=args.metrics_interval, metrics_pattern=re.compile(args.metrics_pattern),
                        disable_tqdm=args.disable_tqdm)
        report: dict[str, Any] = {
            "system": args.label or model, "base_url": base_url, "model": model,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seed": args.seed,
            "workload": {k: v for k, v in asdict(spec).items() if k != "special_ids"}, "points": []}
        for salt, rate in enumerate(rates):
            requests = build_requests(spec, args.seed, salt)
            report["points"].append(await run_point(session, endpoint, requests, rate, cfg))
            if args.json_out is not None:
                write_report(report, args.json_out)  # after every point: a long sweep keeps what it measured
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _positive_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = p.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/completions")
    target.add_argument("--model", default="", help="model id to request; empty = the first of /v1/models")
    target.add_argument("--api-key", default="", help="sent as `Authorization: Bearer KEY`")
    target.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    work = p.add_argument_group("workload")
    work.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    work.add_argument("--num-prompts", type=int, default=200)
    work.add_argument("--model-dir", type=Path, default=None,
                      help="local checkpoint: vocabulary size, sequence limit and special ids from its config.json")
    work.add_argument("--vocab-size", type=int, default=0, help="token ids are drawn below this (0 = from --model-dir)")
    work.add_argument("--max-model-len", type=int, default=0,
                      help="longest prompt + output (0 = from --model-dir or /v1/models)")
    work.add_argument("--length-scale", type=float, default=1.0,
                      help="multiplies the ShareGPT/Alpaca lengths (e.g. 0.25 for CPU runs)")
    work.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="random and prefix datasets: output tokens")
    work.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: shared system prefix tokens")
    work.add_argument("--suffix-len", type=int, default=16, help="prefix dataset: distinct suffix tokens")
    work.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_positive_rate, default=math.inf,
                      help="requests per second (inf = all at once)")
    load.add_argument("--sweep", default=None, help="comma-separated request rates, one point each (e.g. 1,2,4,inf)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before measuring")
    out = p.add_argument_group("output")
    out.add_argument("--label", default="", help="system name in the report and plots (default: the model id)")
    out.add_argument("--json-out", type=Path, default=None)
    out.add_argument("--metrics-interval", type=float, default=0.5,
                     help="seconds between /metrics samples (0 = do not sample)")
    out.add_argument("--metrics-pattern", default=DEFAULT_METRICS_PATTERN,
                     help="regex of the Prometheus metric names to record")
    out.add_argument("--disable-tqdm", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a Markdown table per run. 0 when it ran, 2 when it could not."""
    args = build_parser().parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("error: --max-concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(benchmark(args))
    except (BenchmarkError, ModelDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workload = report["workload"]
    print(f"\n{report['system']} — {workload['dataset']} dataset, {workload['num_prompts']} requests per point, "
          f"model {report['model']} at {report['base_url']}")
    print(format_table(report["points"]))
    for p in report["points"]:
        for err in p["errors"]:
            print(f"rate {p['request_rate']}: failed request: {err}", file=sys.stderr)
    if args.json_out is not None:
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
