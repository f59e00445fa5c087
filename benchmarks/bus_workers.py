"""Simulated workers that only meet the scheduler on the bus, many to a process, for issue 39's capacity benchmark.

Each registers and keeps its heartbeat as a worker does, reads its plans, takes the cost model's time for each step
(a sleep: a GPU step is device time), and answers with a token for every sequence whose chunk reaches its end. They
write no `out:` streams and hold no model state, so that two cores hold sixteen of them beside a scheduler: what
they measure is the scheduler's side. The real worker's own cost and Redis's per token are measured on the full
stack (benchmarks/scheduler_capacity.py runs both).

    python -m benchmarks.bus_workers --redis-url URL --workers 16 [--profile h200-llama-3-8b]
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import time
import uuid
from dataclasses import dataclass, field

from gpu_worker.cost_model import ChunkSize, Profile, get_profile
from shared.bus import connect_async, decode_entry
from shared.keys import FIELD, RESULTS_MAXLEN, Keys
from shared.protocol import StepPlan, StepResult, WorkerRegistration, encode

TOKEN = 7  # every token sampled here: never an EOS id (the registration names none)
HEARTBEATS_PER_TTL = 4


@dataclass(slots=True)
class BusWorker:
    reg: WorkerRegistration
    profile: Profile
    lengths: dict[int, int] = field(default_factory=dict)  # seq id → its tokens, those sampled here included
    epoch: int = 0

    def step(self, plan: StepPlan) -> tuple[list[int], float]:
        """Take the plan into the worker's state: the sequences that sample a token, and the step's modelled time."""
        if plan.epoch != self.epoch:  # a new scheduler: nothing cached here is its
            self.lengths.clear()
            self.epoch = plan.epoch
        for seq_id in plan.freed:
            self.lengths.pop(seq_id, None)
        for new in plan.new_sequences:
            parent = self.lengths.get(new.fork_of, 0) if new.fork_of is not None else 0
            self.lengths[new.seq_id] = parent + len(new.prompt_token_ids) + len(new.output_token_ids)
        # The decode columns are read without an object each (each samples: the lane plans a sequence's next token
        # only): what these workers spend per sequence comes off the scheduler's cores, as a GPU host's would not.
        decodes = plan.decodes
        chunks = [ChunkSize(start, 1) for start in decodes.num_computed_tokens]
        sampled = list(decodes.seq_ids)
        self.lengths.update(zip(sampled, [start + 2 for start in decodes.num_computed_tokens]))
        for s in plan.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            chunks.append(ChunkSize(s.num_computed_tokens, s.num_new_tokens))
            if end >= self.lengths.get(s.seq_id, 0):  # its end (a lookahead counts the token in flight before it)
                sampled.append(s.seq_id)
                self.lengths[s.seq_id] = end + 1
        return sampled, self.profile.step_time(chunks, len(sampled), block_size=self.reg.block_size)


async def serve(worker: BusWorker, url: str, keys: Keys, stop: asyncio.Event) -> None:
    """One worker: plans read ahead as they land (as the real worker's reader does), each run for its modelled time
    and answered; `waited` as the real worker counts it, the time it held sequences with no plan there to run."""
    loop = asyncio.get_running_loop()
    landed: asyncio.Queue[tuple[StepPlan, float]] = asyncio.Queue()
    reading = asyncio.create_task(read_plans(worker, url, keys, landed))
    writer = connect_async(url)
    ended = None
    try:
        while not stop.is_set():
            try:
                plan, at = await asyncio.wait_for(landed.get(), 0.5)
            except asyncio.TimeoutError:
                if reading.done():  # its reader failed: end here rather than look alive and answer nothing
                    reading.result()
                continue
            began = max(at, ended) if ended is not None else at
            waited = began - ended if ended is not None and worker.lengths else 0.0
            sampled, seconds = worker.step(plan)
            await asyncio.sleep(max(0.0, began + seconds - loop.time()))
            result = StepResult(worker.reg.worker_id, plan.epoch, plan.step_id, sampled, [TOKEN] * len(sampled),
                                waited=waited)
            await writer.xadd(keys.results, {FIELD: encode(result)}, maxlen=RESULTS_MAXLEN, approximate=True)
            ended = loop.time()
    finally:
        reading.cancel()


async def read_plans(worker: BusWorker, url: str, keys: Keys, landed: asyncio.Queue) -> None:
    """Every plan on the worker's stream from its start (a fresh Redis: it holds only this run's), as it lands. A
    plan's time is when it landed: the end of its entry id's millisecond, on Redis's clock on this machine, or when
    this loop read it if that was sooner (a worker with a host of its own reads a plan as it lands; this loop, which
    sixteen workers share with the scheduler's two cores, may take it later)."""
    reader = connect_async(url, blocking=True)
    stream, cursor = keys.plans(worker.reg.worker_id), "0-0"
    loop = asyncio.get_running_loop()
    while True:
        reply = await reader.xread({stream: cursor}, count=16, block=500)
        read_at = loop.time()
        to_loop = read_at - time.time()
        for _, entries in reply or []:
            for entry_id, fields in entries:
                cursor = entry_id
                plan = decode_entry(stream, entry_id, fields, StepPlan)
                if plan is not None:
                    landed.put_nowait((plan, min(read_at, (int(entry_id.split(b"-")[0]) + 1) / 1e3 + to_loop)))


async def heartbeats(workers: list[BusWorker], url: str, keys: Keys, ttl: float, stop: asyncio.Event) -> None:
    client = connect_async(url)
    while not stop.is_set():
        async with client.pipeline(transaction=False) as pipe:
            for w in workers:
                pipe.hset(keys.workers, w.reg.worker_id, encode(w.reg))
                pipe.set(keys.heartbeat(w.reg.worker_id), 1, px=int(ttl * 1000))
            await pipe.execute()
        try:
            await asyncio.wait_for(stop.wait(), ttl / HEARTBEATS_PER_TTL)
        except asyncio.TimeoutError:
            pass


async def run(args: argparse.Namespace) -> None:
    keys, profile = Keys(), get_profile(args.profile)
    instance = uuid.uuid4().hex
    workers = [BusWorker(WorkerRegistration(f"{args.prefix}-{i}", args.model_id, args.num_blocks, 0, args.block_size,
                                            args.max_model_len, [], instance, args.vocab_size), profile)
               for i in range(args.workers)]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await asyncio.gather(heartbeats(workers, args.redis_url, keys, args.heartbeat_ttl, stop),
                         *(serve(w, args.redis_url, keys, stop) for w in workers))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--profile", default="h200-llama-3-8b")
    p.add_argument("--model-id", default="tiny", help="the model the requests name")
    p.add_argument("--num-blocks", type=int, default=40_000, help="KV blocks each worker registers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=0)
    p.add_argument("--heartbeat-ttl", type=float, default=5.0)
    p.add_argument("--prefix", default="bus-worker")
    asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
