"""KV memory utilization: paged allocation (the real scheduler and block pool) against contiguous reservation.

A synthetic trace with the vLLM paper's length statistics (pagedserve.workloads: ShareGPT-like and
Alpaca-like lognormal lengths, Poisson arrivals, fixed seed) is replayed step by step, with no model,
through (1) the real scheduler core (`Cluster`) with a fixed block budget and (2) Orca-style contiguous allocators that
reserve, per request, max_model_len / the next power of two of its true length / exactly its true length
(those baselines live only here). The arrival rate exceeds what the memory holds, so every system is
memory-bound; each figure is a mean over the steps in which a request was waiting:

- batch: requests computed in the step;
- token states: slots holding KV of tokens, as a share of the memory held (allocated or reserved) and
  of the whole KV memory;
- reservation: held slots that a later token of the same request will fill;
- internal fragmentation: held slots no token of the request will ever fill;
- external fragmentation: free memory while the next request cannot be placed although that much is
  free in total (scattered gaps; never the case for blocks).

Then the memory that sharing saves: n = 4 parallel samples (copy-on-write forks) and a system prompt
shared through the prefix cache, each against the same trace without sharing.

    python -m benchmarks.kv_utilization [--dataset sharegpt alpaca] [--num-requests 1000] [--quick]
"""
from __future__ import annotations

import argparse
import bisect
import statistics
from dataclasses import dataclass, field

from benchmarks.token_worker import TokenWorker
from pagedserve.workloads import WorkloadSpec, arrival_times, build_requests
from benchmarks.baselines import reserving_scheduler
from scheduler.cluster import Cluster
from shared.protocol import Request, WorkerRegistration
from shared.sampling import SamplingParams
from shared.settings import Settings


@dataclass(slots=True)
class Job:
    rid: str
    prompt: list[int]
    output_len: int
    arrival: float
    n: int = 1
    beam_width: int = 0

    @property
    def final_kv(self) -> int:
        """Tokens whose KV the request computes: all but its last sampled token."""
        return len(self.prompt) + self.output_len - 1


@dataclass(slots=True)
class Config:
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(slots=True)
class Tally:
    """Per-step samples (in token slots) taken while some request waits."""
    batch: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)  # block slots as if nothing were shared

    def add(self, batch: int, tokens: int, held: int, reserved: int, external: int, logical: int = 0) -> None:
        self.batch.append(batch)
        self.tokens.append(tokens)
        self.held.append(held)
        self.reserved.append(reserved)
        self.internal.append(held - tokens - reserved)
        self.external.append(external)
        self.logical.append(logical)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


# ---- paged: the real scheduler ------------------------------------------------------------------
def run_paged(jobs: list[Job], cfg: Config, *, caching: bool = False, reserving: bool = False) -> Tally:
    settings = Settings(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=caching)
    reg = WorkerRegistration("w0", "bench", cfg.num_blocks + 1, 0, cfg.block_size, cfg.max_model_len, [0])
    sched = Cluster(settings, worker_scheduler=reserving_scheduler() if reserving else None)
    sched.add_worker(reg)
    worker = TokenWorker(reg)
    ws = sched.workers["w0"]
    final = {job.rid: job.final_kv for job in jobs}
    tally = Tally()
    pending = sorted(jobs, key=lambda j: j.arrival)
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival <= step:
            job = pending.pop(0)
            params = SamplingParams(n=job.n, max_tokens=job.output_len, ignore_eos=True, temperature=0.0,
                                    beam_width=job.beam_width)
            sched.add_request(Request(job.rid, "bench", job.prompt, params, job.arrival))
        plan = sched.schedule("w0")
        if plan is not None:
            sched.apply_result(worker.execute(plan).result)
        if ws.waiting or ws.preempted:
            bs = cfg.block_size
            seqs = [(rs.rid, s) for rs in ws.running for s in rs.seqs]
            tokens = sum(s.num_computed for _, s in seqs)
            lengths = {(rid, s.seq_id): ws.kv.table_len(s.seq_id) * bs for rid, s in seqs}
            reserved = sum(min(lengths[(rid, s.seq_id)], final[rid]) - s.num_computed for rid, s in seqs)
            stats = ws.stats()
            held = (stats.num_blocks - stats.free_blocks) * bs
            tally.add(plan.num_sequences if plan else 0, tokens, held, reserved, 0, sum(lengths.values()))
        step += 1
    sched.pop_finished()
    return tally


# ---- contiguous reservation (Orca-style baselines) ----------------------------------------------
@dataclass(slots=True, eq=False)
class Slot:
    job: Job
    size: int
    start: int = 0
    computed: int = 0
    generated: int = 0


def reservation(policy: str, job: Job, max_model_len: int) -> int:
    true_len = len(job.prompt) + job.output_len
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(max_model_len, 1 << (true_len - 1).bit_length())
    return true_len


def run_contiguous(jobs: list[Job], cfg: Config, policy: str) -> Tally:
    """Iteration-level batching as above, but each request holds one contiguous region (first fit) from
    admission to its end; with the whole region reserved up front it never needs preemption."""
    running: list[Slot] = []  # arrival order
    regions: list[tuple[int, int]] = []  # (start, end) of held regions, by start
    queue: list[Slot] = []
    pending = sorted(jobs, key=lambda j: j.arrival)
    tally = Tally()
    step = 0

    def place(size: int) -> int | None:
        cursor = 0
        for start, end in regions:
            if start - cursor >= size:
                return cursor
            cursor = end
        return cursor if cfg.capacity - cursor >= size else None

    while pending or running or queue:
        while pending and pending[0].arrival <= step:
            job = pending.pop(0)
            queue.append(Slot(job, reservation(policy, job, cfg.max_model_len)))
        budget, batch = cfg.max_num_batched_tokens, 0
        for slot in running:
            if budget == 0:
                break
            todo = min(len(slot.job.prompt) + slot.generated - slot.computed, budget)
            slot.computed += todo
            budget -= todo
            batch += 1
        while queue and budget > 0 and len(running) < cfg.max_num_seqs:
            start = place(queue[0].size)
            if start is None:
                break
            slot = queue.pop(0)
            slot.start = start
            bisect.insort(regions, (start, start + slot.size))
            running.append(slot)
            todo = min(len(slot.job.prompt), budget)
            slot.computed = todo
            budget -= todo
            batch += 1
        for slot in list(running):
            if slot.computed == len(slot.job.prompt) + slot.generated:
                slot.generated += 1  # the step's sampled token
                if slot.generated == slot.job.output_len:
                    running.remove(slot)
                    regions.remove((slot.start, slot.start + slot.size))
        if queue:
            held = sum(s.size for s in running)
            tokens = sum(s.computed for s in running)
            reserved = sum(min(s.size, s.job.final_kv) - s.computed for s in running)
            free = cfg.capacity - held
            external = free if free >= queue[0].size else 0
            tally.add(batch, tokens, held, reserved, external)
        step += 1
    return tally


# ---- reports ------------------------------------------------------------------------------------
def utilization_table(name: str, jobs: list[Job], cfg: Config) -> None:
    rows = [("paged (this scheduler)", run_paged(jobs, cfg))]
    rows += [(label, run_contiguous(jobs, cfg, policy))
             for label, policy in (("contiguous, max_model_len", "max"), ("contiguous, next pow2", "pow2"),
                                   ("contiguous, exact length", "exact"))]
    rows.append(("paged blocks, max_model_len reserved", run_paged(jobs, cfg, reserving=True)))
    ins = statistics.fmean(len(j.prompt) for j in jobs)
    outs = statistics.fmean(j.output_len for j in jobs)
    print(f"\n{name}: {len(jobs)} requests, mean prompt {ins:.0f} / output {outs:.0f} tokens; KV memory "
          f"{cfg.num_blocks} blocks x {cfg.block_size} = {cfg.capacity} token slots; max_model_len {cfg.max_model_len}")
    head = (f"{'system':<37} | {'batch':>6} | {'x paged':>7} | {'tokens/held':>11} | {'tokens/KV':>9} | "
            f"{'reserv./KV':>10} | {'int.frag/KV':>11} | {'ext.frag/KV':>11}")
    print(head)
    print("-" * len(head))
    base = mean(rows[0][1].batch) or float("nan")
    cap = cfg.capacity
    for label, t in rows:
        batch = mean(t.batch)
        held = sum(t.held)
        print(f"{label:<37} | {batch:>6.1f} | {batch / base:>6.2f}x | {100 * sum(t.tokens) / max(held, 1):>10.1f}% | "
              f"{100 * mean(t.tokens) / cap:>8.1f}% | {100 * mean(t.reserved) / cap:>9.1f}% | "
              f"{100 * mean(t.internal) / cap:>10.1f}% | {100 * mean(t.external) / cap:>10.1f}%")


# The vLLM paper's Figure 15 (OPT-13B): memory saved by sharing, over parallel sampling and beam widths 2-6.
PAPER_SAVINGS = {"sharegpt": ("16.2-30.5%", "44.3-66.3%"), "alpaca": ("6.1-9.8%", "37.6-55.2%")}


def sharing_table(name: str, jobs: list[Job], cfg: Config, system_prompt: list[int]) -> None:
    print(f"\n{name}: memory saved by sharing (paged; means over steps with a request waiting)")
    head = f"{'workload':<42} | {'batch':>6} | {'blocks held':>11} | {'unshared':>8} | {'saved':>6}"
    print(head)
    print("-" * len(head))

    def row(label: str, tally: Tally, unit: int = 1) -> None:
        held = mean(tally.held) / cfg.block_size
        logical = mean(tally.logical) / cfg.block_size
        print(f"{label:<42} | {mean(tally.batch) / unit:>6.1f} | {held:>11.1f} | {logical:>8.1f} | "
              f"{100 * (1 - held / logical) if logical else 0.0:>5.1f}%")

    paper = PAPER_SAVINGS[name]
    for n in (2, 4, 6):
        forked = [Job(j.rid, j.prompt, j.output_len, j.arrival, n=n) for j in jobs]
        row(f"parallel sampling n={n} (paper: {paper[0]})", run_paged(forked, cfg))
    apart = [Job(f"{j.rid}.{k}", j.prompt, j.output_len, j.arrival) for j in jobs for k in range(4)]
    row("n=4 as 4 requests, no sharing", run_paged(apart, cfg))
    for width in (2, 4, 6):
        beams = [Job(j.rid, j.prompt, j.output_len, j.arrival, beam_width=width) for j in jobs]
        row(f"beam search width {width} (paper: {paper[1]})", run_paged(beams, cfg))
    budget = cfg.max_model_len - len(system_prompt)
    prefixed = []
    for j in jobs:  # keep system prompt + prompt + output within max_model_len
        prompt = j.prompt[:budget // 2]
        prefixed.append(Job(j.rid, system_prompt + prompt, min(j.output_len, budget - len(prompt)), j.arrival))
    row(f"{len(system_prompt)}-token system prompt, prefix cache on", run_paged(prefixed, cfg, caching=True))
    row(f"{len(system_prompt)}-token system prompt, prefix cache off", run_paged(prefixed, cfg, caching=False))
    print("(batch: sequences computed per step; unshared: blocks the running sequences' tables name, counting a "
          "shared block once per holder)")


def make_jobs(dataset: str, num: int, rate: float, max_model_len: int, seed: int) -> list[Job]:
    spec = WorkloadSpec(dataset, num, vocab_size=32000, max_model_len=max_model_len, special_ids=(0,))
    samples = build_requests(spec, seed)
    times = arrival_times(num, rate, 1.0, seed)
    return [Job(f"{dataset}-{i}", s.prompt_token_ids, s.max_tokens, t) for i, (s, t) in enumerate(zip(samples, times))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", nargs="+", choices=["sharegpt", "alpaca"], default=["sharegpt", "alpaca"])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=0.0,
                   help="Poisson arrivals per scheduler step (0 = 1 for sharegpt, 10 for alpaca: beyond capacity)")
    p.add_argument("--num-blocks", type=int, default=1000, help="KV budget in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=1024, help="high, so that memory is what limits the batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="300 requests on 400 blocks")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.num_blocks = 300, 400
    cfg = Config(args.num_blocks, args.block_size, args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    system_prompt = list(range(1, args.system_prompt_len + 1))
    for dataset in args.dataset:
        rate = args.rate or {"sharegpt": 1.0, "alpaca": 10.0}[dataset]
        jobs = make_jobs(dataset, args.num_requests, rate, args.max_model_len, args.seed)
        utilization_table(f"{dataset} ({rate:g} requests/step)", jobs, cfg)
        sharing_table(dataset, jobs, cfg, system_prompt)
    print("\nvLLM paper (Fig. 2): 96.3% of KV memory holds token states with paging vs 20.4-38.2% for contiguous "
          "systems; batches 2.2-4.3x larger.")


if __name__ == "__main__":
    main()
