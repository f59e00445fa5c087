"""Tenants under load (issue 36): each tenant's TTFT and throughput alone and together, under the fcfs, priority
and fair scheduling policies, on `pagedserve up --workers 2`.

    python -m benchmarks.tenants --out benchmarks/results/tenants.json
    python -m benchmarks.tenants --policies fair --scenarios tenfold --duration 10     # a shorter look

Each policy gets a fresh stack, `pagedserve up --workers 2 --model tiny --simulate a100-40gb-opt-13b
--max-num-seqs 8 --reconnect-grace 0 --api-keys FILE --scheduling-policy POLICY`, whose keys file names four
tenants of weight 1, and runs two scenarios of three phases each (one tenant alone, the other alone, both together):

- `tenfold`: tenant `light` sends Poisson arrivals at --light-rate and `heavy` at --ratio times that, more than the
  two workers can serve, so that heavy alone saturates them; every request is a prompt of --input-len tokens
  streaming --output-len tokens.
- `interactive`: tenant `interactive` sends the same short requests as Poisson arrivals at --interactive-rate, with
  `priority` -10 under the priority policy (the others refuse a nonzero priority, so there it sends none);
  tenant `batch` keeps --batch-concurrency requests of --batch-output-len tokens in flight (a closed loop), several
  times what the batch holds, so that the batch is full of low-priority work all the time.

Why this shape: the workers are simulated (the cost model's OPT-13B on an A100; a step sleeps), so the two cores run
the gateway, scheduler and client rather than a model, and what differs between policies is the scheduler's doing;
a small batch (--max-num-seqs per worker) fills within seconds; fixed lengths (`ignore_eos`) make TTFT differences
queueing, not request size; arrivals are seeded, the same under every policy and alone as together. TTFT is to the
first streamed token (pagedserve/bench.py's client). Requests sent before --warmup are load but not measured; a
tenant's throughput counts the output tokens that reached the client inside the window from --warmup to
--duration, so an overloaded tenant's backlog does not stretch it. After the window, open requests get --drain
seconds, then are cut (the client disconnects, and with no reconnect grace the stack aborts them): one cut before
its first token is `unserved`, its wait so far a lower bound of its TTFT (a percentile it reaches is marked >=).

The targets table checks issue 36's figures: (a) under fair, light's TTFT p99 together is at most 1.5x its p99
alone, and the two together keep the cluster as busy as heavy alone (heavy takes what light leaves); (b) under
priority, interactive's TTFT p99 beside the batch is at most 2x its idle TTFT (its p50 alone), and the batch still
completes (its throughput and E2E latency together against alone).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import numpy as np

from pagedserve.bench import (BenchmarkError, Endpoint, ModelFacts, RequestOutput, _stats_ms, discover_model,
                                model_facts, parse_prometheus, send_completion, write_report)
from benchmarks.up_process import UpProcess
from pagedserve.workloads import SampleRequest, WorkloadSpec, arrival_times, build_requests
from pagedserve.ports import free_port
from shared.model_dir import default_model_dir

POLICIES = ("fcfs", "priority", "fair")
SCENARIOS = ("tenfold", "interactive")
TENANTS = ("light", "heavy", "interactive", "batch")
INTERACTIVE_PRIORITY = -10  # the interactive tenant's max_priority in the keys file, and what it asks for
LIGHT_P99_LIMIT = 1.5  # (a): light's TTFT p99 together over alone
CAPACITY_SHARE = 0.95  # (a): tokens together over heavy alone, allowing for the noise of a window's token count
INTERACTIVE_LIMIT = 2.0  # (b): interactive's TTFT p99 beside the batch over its p50 alone
CUT_SLACK_S = 0.01  # aiohttp's timer may fire this much before the cutoff (the event loop's clock resolution)
IDLE_TIMEOUT_S = 60.0
BATCH_POOL_PER_LANE = 16  # distinct prompts per closed-loop lane; past them a lane reuses prompts
_IDLE_SERIES = re.compile(r"^pagedserve_(num_requests_(running|waiting|preempted)|gateway_waiting_requests)$")


def api_key(tenant: str) -> str:
    return f"bench-{tenant}"


def keys_toml() -> str:
    """The keys file: one key per tenant, weight 1; only the interactive tenant may ask for a priority below 0."""
    tables = []
    for tenant in TENANTS:
        cap = f"max_priority = {INTERACTIVE_PRIORITY}\n" if tenant == "interactive" else ""
        tables.append(f'[tenants.{tenant}]\nkeys = ["{api_key(tenant)}"]\nweight = 1.0\n{cap}')
    return "\n".join(tables)


@dataclass(frozen=True, slots=True)
class Load:
    """How one tenant sends during a phase: Poisson arrivals at `rate`, or (`concurrency` > 0) that many requests
    always in flight."""
    tenant: str
    input_len: int
    output_len: int
    seed: int  # arrivals and prompt lengths; the same in every phase and policy
    rate: float = 0.0
    concurrency: int = 0
    priority: int = 0  # sent only when nonzero


@dataclass(frozen=True, slots=True)
class Phase:
    scenario: str
    name: str
    loads: tuple[Load, ...]


@dataclass(frozen=True, slots=True)
class Window:
    """A phase's clock, in seconds from its start: measured from `warmup` to `duration`, requests cut at `cutoff`."""
    warmup: float
    duration: float
    cutoff: float


def phases(args: argparse.Namespace) -> list[Phase]:
    """Each chosen scenario's three phases: the first tenant alone, the second alone, both together."""
    short = dict(input_len=args.input_len, output_len=args.output_len)
    pairs = {
        "tenfold": (Load("light", seed=args.seed * 10 + 1, rate=args.light_rate, **short),
                    Load("heavy", seed=args.seed * 10 + 2, rate=args.light_rate * args.ratio, **short)),
        "interactive": (Load("interactive", seed=args.seed * 10 + 3, rate=args.interactive_rate, **short),
                        Load("batch", input_len=args.input_len, output_len=args.batch_output_len,
                             seed=args.seed * 10 + 4, concurrency=args.batch_concurrency)),
    }
    out = []
    for scenario in args.scenarios:
        first, second = pairs[scenario]
        out += [Phase(scenario, f"{first.tenant} alone", (first,)), Phase(scenario, f"{second.tenant} alone", (second,)),
                Phase(scenario, f"{first.tenant} + {second.tenant}", (first, second))]
    return out


def with_priority(load: Load, policy: str) -> Load:
    """The interactive tenant asks for its priority only where the policy takes one."""
    if load.tenant == "interactive" and policy == "priority":
        return Load(load.tenant, load.input_len, load.output_len, load.seed, load.rate, load.concurrency,
                    INTERACTIVE_PRIORITY)
    return load


@dataclass(slots=True)
class TenantSession:
    """What send_completion posts through: the shared session, adding the tenant's extra body fields (vLLM's
    `priority`) and a timeout that ends at the phase's cutoff, so that a cut request still reports its first token."""
    session: aiohttp.ClientSession
    extra: dict[str, Any]
    cutoff: float  # perf_counter() time

    def post(self, url: str, *, json: dict[str, Any], headers: dict[str, str]) -> Any:
        timeout = aiohttp.ClientTimeout(total=max(self.cutoff - time.perf_counter(), 0.001))
        return self.session.post(url, json=json | self.extra, headers=headers, timeout=timeout)


@dataclass(slots=True)
class Sent:
    """One request as the client saw it."""
    at: float  # seconds from the phase's start to its send
    out: RequestOutput
    outcome: str  # completed, cut (after its first token), unserved (cut before it) or failed

    def token_times(self) -> np.ndarray:
        """When each streamed token arrived, in seconds from the phase's start."""
        if not self.out.ttft:
            return np.zeros(0)
        return self.at + self.out.ttft + np.cumsum([0.0, *self.out.itl])


async def _send(session: TenantSession, endpoint: Endpoint, req: SampleRequest, t0: float) -> Sent:
    at = time.perf_counter() - t0
    out = await send_completion(session, endpoint, req)  # type: ignore[arg-type]  # it only posts
    if out.success:
        return Sent(at, out, "completed")
    if time.perf_counter() >= session.cutoff - CUT_SLACK_S:
        return Sent(at, out, "cut" if out.ttft else "unserved")
    return Sent(at, out, "failed")


async def open_loop(session: TenantSession, endpoint: Endpoint, requests: list[SampleRequest], times: list[float],
                    t0: float) -> list[Sent]:
    async def at(req: SampleRequest, when: float) -> Sent:
        await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
        return await _send(session, endpoint, req, t0)

    return list(await asyncio.gather(*(at(r, when) for r, when in zip(requests, times))))


async def closed_loop(session: TenantSession, endpoint: Endpoint, prompts: Iterator[SampleRequest], lanes: int,
                      t0: float, end: float) -> list[Sent]:
    sent: list[Sent] = []

    async def lane() -> None:
        while time.perf_counter() < end:
            sent.append(await _send(session, endpoint, next(prompts), t0))

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return sent


@dataclass(slots=True)
class Stat:
    """A figure, and whether it is only a lower bound (a percentile that reached an unserved request's wait)."""
    value: float | None
    at_least: bool = False

    def __str__(self) -> str:
        if self.value is None:
            return "-"
        return f"{'>=' if self.at_least else ''}{self.value:.3g}" if abs(self.value) < 100 else \
            f"{'>=' if self.at_least else ''}{self.value:.0f}"

    def over(self, other: Stat) -> Stat:
        if self.value is None or not other.value:
            return Stat(None)
        return Stat(self.value / other.value, self.at_least and not other.at_least)


@dataclass(slots=True)
class TenantResult:
    tenant: str
    priority: int
    sent: int  # measured requests: sent from the warmup on
    completed: int
    cut: int
    unserved: int
    failed: int
    errors: list[str]
    ttft_p50_ms: Stat
    ttft_p99_ms: Stat
    ttft_mean_ms: Stat
    e2e_p50_ms: Stat  # completed requests only
    e2e_p99_ms: Stat
    output_tok_s: float  # tokens that arrived inside the window, over its length
    requests: list[dict[str, Any]] = field(repr=False)


def _percentile(values: list[float], q: float, lower_bound_from: float) -> Stat:
    """The q-th percentile of `values` (ms); at least that where it reaches a lower-bound value (>= lower_bound_from)."""
    if not values:
        return Stat(None)
    value = float(np.percentile(values, q))
    return Stat(value, value >= lower_bound_from)


def tenant_result(load: Load, sent: list[Sent], window: Window) -> TenantResult:
    measured = [s for s in sent if s.at >= window.warmup]
    known = [s.out.ttft * 1000.0 for s in measured if s.outcome in ("completed", "cut")]
    waits = [(window.cutoff - s.at) * 1000.0 for s in measured if s.outcome == "unserved"]
    bound = min(waits, default=math.inf)  # a percentile at or above the shortest unserved wait may be one of them
    ttfts = known + waits
    e2e = _stats_ms([s.out.latency for s in measured if s.outcome == "completed"])
    tokens = sum(int(((t >= window.warmup) & (t < window.duration)).sum()) for t in map(Sent.token_times, sent))
    count = {o: sum(s.outcome == o for s in measured) for o in ("completed", "cut", "unserved", "failed")}
    return TenantResult(
        tenant=load.tenant, priority=load.priority, sent=len(measured), **count,
        errors=list(dict.fromkeys(s.out.error for s in measured if s.outcome == "failed"))[:3],
        ttft_p50_ms=_percentile(ttfts, 50, bound), ttft_p99_ms=_percentile(ttfts, 99, bound),
        ttft_mean_ms=Stat(float(np.mean(ttfts)) if ttfts else None, bool(waits)),
        e2e_p50_ms=Stat(e2e["p50"]), e2e_p99_ms=Stat(e2e["p99"]),
        output_tok_s=tokens / (window.duration - window.warmup),
        requests=[{"at_s": round(s.at, 4), "ttft_s": round(s.out.ttft, 4), "latency_s": round(s.out.latency, 4),
                   "outcome": s.outcome} for s in sent])


@dataclass(slots=True)
class PhaseResult:
    scenario: str
    name: str
    wall_s: float
    idle_after: bool  # the stack had nothing running or waiting before the next phase
    tenants: dict[str, TenantResult]


@dataclass(slots=True)
class Stack:
    """What a phase needs of the running stack."""
    base_url: str
    model: str
    facts: ModelFacts


async def run_phase(session: aiohttp.ClientSession, stack: Stack, phase: Phase, salt: int, policy: str,
                    args: argparse.Namespace) -> PhaseResult:
    started = time.perf_counter()
    window = Window(args.warmup, args.duration, args.duration + args.drain)
    t0 = time.perf_counter() + 0.2  # every tenant's tasks are set up before the first send
    senders = []
    loads = [with_priority(load, policy) for load in phase.loads]
    for load in loads:
        endpoint = Endpoint(f"{stack.base_url}/v1/completions", f"{stack.base_url}/metrics", stack.model,
                            {"Authorization": f"Bearer {api_key(load.tenant)}"})
        tenant_session = TenantSession(session, {"priority": load.priority} if load.priority else {}, t0 + window.cutoff)
        if load.concurrency:
            spec = workload(stack.facts, load, load.concurrency * BATCH_POOL_PER_LANE)
            # Reusing a prompt only hits the prefix cache, and only a lane faster than the pool allows gets there.
            prompts = itertools.cycle(build_requests(spec, load.seed, salt))
            senders.append(closed_loop(tenant_session, endpoint, prompts, load.concurrency, t0, t0 + window.duration))
        else:
            times = [t for t in arrival_times(math.ceil(load.rate * window.duration * 2) + 16, load.rate, 1.0, load.seed)
                     if t < window.duration]
            requests = build_requests(workload(stack.facts, load, len(times)), load.seed, salt)
            senders.append(open_loop(tenant_session, endpoint, requests, times, t0))
    sent = await asyncio.gather(*senders)
    idle = await wait_idle(session, f"{stack.base_url}/metrics")
    return PhaseResult(phase.scenario, phase.name, time.perf_counter() - started, idle,
                       {load.tenant: tenant_result(load, s, window) for load, s in zip(loads, sent)})


def workload(facts: ModelFacts, load: Load, num: int) -> WorkloadSpec:
    return WorkloadSpec(dataset="random", num_prompts=max(1, num), vocab_size=facts.vocab_size,
                        max_model_len=facts.max_model_len, input_len=load.input_len, output_len=load.output_len,
                        special_ids=facts.special_ids)


async def wait_idle(session: aiohttp.ClientSession, metrics_url: str) -> bool:
    """Wait until the stack has no request running, waiting or preempted (so that phases do not overlap)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        async with session.get(metrics_url) as resp:
            values = parse_prometheus(await resp.text(), _IDLE_SERIES)
        if not any(values.values()):
            return True
        await asyncio.sleep(0.25)
    return False


async def warm_up(session: aiohttp.ClientSession, stack: Stack, policy: str, args: argparse.Namespace) -> None:
    """One short request per tenant, with its phase's priority: the keys and the priority are taken, or it says why."""
    for tenant in TENANTS:
        load = with_priority(Load(tenant, input_len=8, output_len=4, seed=args.seed), policy)
        endpoint = Endpoint(f"{stack.base_url}/v1/completions", "", stack.model,
                            {"Authorization": f"Bearer {api_key(tenant)}"})
        tenant_session = TenantSession(session, {"priority": load.priority} if load.priority else {},
                                       time.perf_counter() + 60.0)
        out = await send_completion(tenant_session, endpoint,  # type: ignore[arg-type]  # it only posts
                                    build_requests(workload(stack.facts, load, 1), load.seed, salt=1 << 30)[0])
        if not out.success:
            raise BenchmarkError(f"tenant {tenant}'s warmup request failed under {policy}: {out.error}")


async def run_policy_phases(url: str, policy: str, args: argparse.Namespace) -> list[PhaseResult]:
    # limit=0: aiohttp's default connector would cap the requests in flight at 100.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model, listed_max_len = await discover_model(session, url, {"Authorization": f"Bearer {api_key('light')}"})
        facts = model_facts(argparse.Namespace(vocab_size=0, max_model_len=0, model_dir=default_model_dir()),
                            listed_max_len)
        stack = Stack(url, model, facts)
        await warm_up(session, stack, policy, args)
        results = []
        for salt, phase in enumerate(phases(args)):
            result = await run_phase(session, stack, phase, salt, policy, args)
            progress(f"[{policy}] {phase.scenario}: {phase.name} ({result.wall_s:.0f} s): " + "; ".join(
                f"{t.tenant} {t.completed}/{t.sent} done, TTFT p50 {t.ttft_p50_ms} p99 {t.ttft_p99_ms} ms, "
                f"{t.output_tok_s:.0f} tok/s" for t in result.tenants.values())
                + ("" if result.idle_after else f"; the stack was still busy {IDLE_TIMEOUT_S:.0f} s after"))
            results.append(result)
    return results


def stack_args(policy: str, keys_path: Path, args: argparse.Namespace) -> list[str]:
    return ["--workers", str(args.workers), "--model", "tiny", "--simulate", args.simulate,
            "--max-num-seqs", str(args.max_num_seqs), "--reconnect-grace", "0", "--port", str(free_port()),
            "--api-keys", str(keys_path), "--scheduling-policy", policy, *args.up_args.split()]


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Target:
    """One of issue 36's figures: its value under each policy, and the policy and limit it must meet."""
    label: str
    policy: str
    limit: str  # e.g. "<= 1.5"; empty: reported, no limit
    values: dict[str, Stat]

    def holds(self) -> bool | None:
        value = self.values.get(self.policy)
        if not self.limit or value is None or value.value is None:
            return None
        op, bound = self.limit.split()
        if op == "<=":
            return value.value <= float(bound) and not value.at_least
        return value.value >= float(bound)


def _tenant(phases_of: list[PhaseResult], name: str, tenant: str) -> TenantResult | None:
    return next((p.tenants[tenant] for p in phases_of if p.name == name), None)


def targets(runs: dict[str, list[PhaseResult]]) -> list[Target]:
    def each(figure: Any) -> dict[str, Stat]:
        out = {}
        for policy, results in runs.items():
            try:
                out[policy] = figure(lambda name, tenant: _tenant(results, name, tenant))
            except AttributeError:  # a phase this run left out
                continue
        return out

    return [
        Target("(a) light TTFT p99: together / alone", "fair", f"<= {LIGHT_P99_LIMIT}",
               each(lambda t: t("light + heavy", "light").ttft_p99_ms.over(t("light alone", "light").ttft_p99_ms))),
        Target("(a) light + heavy tok/s together / heavy alone", "fair", f">= {CAPACITY_SHARE}",
               each(lambda t: Stat((t("light + heavy", "light").output_tok_s + t("light + heavy", "heavy").output_tok_s)
                                   / t("heavy alone", "heavy").output_tok_s))),
        Target("(a) heavy tok/s together / (heavy alone - light together)", "fair", "",
               each(lambda t: Stat(t("light + heavy", "heavy").output_tok_s
                                   / (t("heavy alone", "heavy").output_tok_s - t("light + heavy", "light").output_tok_s)))),
        Target("(b) interactive TTFT p99 beside batch / p50 alone", "priority", f"<= {INTERACTIVE_LIMIT}",
               each(lambda t: t("interactive + batch", "interactive").ttft_p99_ms.over(
                   t("interactive alone", "interactive").ttft_p50_ms))),
        Target("(b) interactive TTFT p99 beside batch / p99 alone", "priority", "",
               each(lambda t: t("interactive + batch", "interactive").ttft_p99_ms.over(
                   t("interactive alone", "interactive").ttft_p99_ms))),
        Target("(b) batch requests completed beside interactive", "priority", ">= 1",
               each(lambda t: Stat(t("interactive + batch", "batch").completed))),
        Target("(b) batch tok/s: together / alone", "priority", "",
               each(lambda t: Stat(t("interactive + batch", "batch").output_tok_s / t("batch alone", "batch").output_tok_s))),
        Target("(b) batch E2E p50: together / alone", "priority", "",
               each(lambda t: t("interactive + batch", "batch").e2e_p50_ms.over(t("batch alone", "batch").e2e_p50_ms))),
    ]


def format_phases(runs: dict[str, list[PhaseResult]], scenario: str) -> str:
    rows = ["| policy | phase | tenant | priority | sent | done / cut / unserved / failed | TTFT p50 (ms) "
            "| TTFT p99 (ms) | E2E p50 (ms) | out tok/s |", "|" + "---|" * 10]
    for policy, results in runs.items():
        for p in results:
            if p.scenario != scenario:
                continue
            for t in p.tenants.values():
                rows.append(f"| {policy} | {p.name} | {t.tenant} | {t.priority} | {t.sent} "
                            f"| {t.completed} / {t.cut} / {t.unserved} / {t.failed} | {t.ttft_p50_ms} "
                            f"| {t.ttft_p99_ms} | {t.e2e_p50_ms} | {t.output_tok_s:.0f} |")
    return "\n".join(rows)


def format_targets(found: list[Target], policies: list[str]) -> str:
    rows = [f"| figure | target | {' | '.join(policies)} | holds |", "|" + "---|" * (len(policies) + 3)]
    for t in found:
        holds = t.holds()
        verdict = "-" if holds is None else ("yes" if holds else "no")
        target = f"{t.limit} under {t.policy}" if t.limit else "reported"
        rows.append(f"| {t.label} | {target} | {' | '.join(str(t.values.get(p, Stat(None))) for p in policies)} "
                    f"| {verdict} |")
    return "\n".join(rows)


def report(args: argparse.Namespace, runs: dict[str, list[PhaseResult]], logs: dict[str, str],
           wall_s: float) -> dict[str, Any]:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": round(wall_s, 1),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "stack": stack_args("POLICY", Path("KEYS"), args), "keys_file": keys_toml(), "logs": logs,
            "runs": {policy: [asdict(p) for p in results] for policy, results in runs.items()},
            "targets": [asdict(t) | {"holds": t.holds()} for t in targets(runs)]}


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated); got {text!r}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tenants", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", type=_names(POLICIES), default=list(POLICIES))
    p.add_argument("--scenarios", type=_names(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--duration", type=float, default=30.0, help="seconds each phase sends")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds at a phase's start that are load, not measured")
    p.add_argument("--drain", type=float, default=10.0, help="seconds open requests get after a phase, then are cut")
    p.add_argument("--light-rate", type=float, default=2.5, help="tenfold: light's requests per second")
    p.add_argument("--ratio", type=float, default=10.0, help="tenfold: heavy's rate over light's")
    p.add_argument("--interactive-rate", type=float, default=2.5, help="interactive: its requests per second")
    p.add_argument("--batch-concurrency", type=int, default=64, help="interactive: batch requests always in flight")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens of every request")
    p.add_argument("--output-len", type=int, default=32, help="output tokens of light, heavy and interactive requests")
    p.add_argument("--batch-output-len", type=int, default=128, help="output tokens of a batch request")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8, help="the batch of each worker")
    p.add_argument("--simulate", default="a100-40gb-opt-13b", help="the workers' profile (gpu_worker/profiles.json)")
    p.add_argument("--up-args", default="", help="more `pagedserve up` arguments (e.g. --no-async-scheduling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here (after each policy)")
    p.add_argument("--log-dir", type=Path, default=None, help="the stacks' logs and keys file (default: a temp dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print its tables. 0 when it ran, 2 when it could not."""
    args = build_parser().parse_args(argv)
    if not 0 <= args.warmup < args.duration or args.drain < 0:
        print("error: need 0 <= --warmup < --duration and --drain >= 0", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedserve-tenants-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    keys_path = log_dir / "keys.toml"
    keys_path.write_text(keys_toml())
    started = time.perf_counter()
    runs: dict[str, list[PhaseResult]] = {}
    logs: dict[str, str] = {}
    for policy in args.policies:
        log_path = log_dir / f"up-{policy}.log"
        logs[policy] = str(log_path)
        progress(f"[{policy}] starting the stack (log: {log_path})")
        try:
            up = UpProcess.start(stack_args(policy, keys_path, args), log_path)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            runs[policy] = asyncio.run(run_policy_phases(up.url, policy, args))
        except BenchmarkError as e:
            print(f"error: {e} (the stack's log: {log_path})", file=sys.stderr)
            return 2
        finally:
            up.stop()
        if args.out is not None:
            write_report(report(args, runs, logs, time.perf_counter() - started), args.out)
    wall_s = time.perf_counter() - started
    print(f"\nTenants on `pagedserve up --workers {args.workers} --simulate {args.simulate} --max-num-seqs "
          f"{args.max_num_seqs} {args.up_args}`: phases of {args.duration:g} s (measured after {args.warmup:g} s, cut "
          f"{args.drain:g} s after), prompts of {args.input_len} tokens; {wall_s / 60:.1f} min in all")
    titles = {"tenfold": f"light at {args.light_rate:g} req/s, heavy at {args.ratio:g}x that; "
                         f"{args.output_len} output tokens each",
              "interactive": f"interactive at {args.interactive_rate:g} req/s, {args.output_len} output tokens "
                             f"(priority {INTERACTIVE_PRIORITY} under priority); batch {args.batch_concurrency} in "
                             f"flight, {args.batch_output_len} output tokens"}
    for scenario in args.scenarios:
        print(f"\n{scenario}: {titles[scenario]}\n")
        print(format_phases(runs, scenario))
    print("\nTargets\n")
    print(format_targets(targets(runs), args.policies))
    if args.out is not None:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
